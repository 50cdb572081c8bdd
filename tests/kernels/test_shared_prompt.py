"""A group's prompt run once for all its completions: same log-probs, entropies and gradients as separate rows."""

from __future__ import annotations

import pytest
import torch

from polo.kernels.cpu import shared_prompt
from polo.kernels.cpu.attention import use_polo_attention
from polo.kernels.cpu.shared_prompt import share_prompts, sharing_pays, without_padding
from polo.models import scoring
from polo.models.loading import load_policy
from polo.models.scoring import completion_logprobs, shared_completion_logprobs


def grouped_batch(
    vocab: int, group_size: int = 3, prompt_lengths=(5, 2), completion_lengths=(4, 1, 3, 2, 4, 1), seed: int = 0
):
    """Two groups: left-padded prompts of different lengths, right-padded completions of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    width = max(prompt_lengths)
    prompt_ids, prompt_mask = [], []
    for length in prompt_lengths:
        ids = torch.randint(3, vocab, (width,), generator=generator)
        mask = (torch.arange(width) >= width - length).long()
        for _ in range(group_size):
            prompt_ids.append(ids.masked_fill(mask == 0, 0))
            prompt_mask.append(mask)
    completion_width = max(completion_lengths)
    completion_ids = torch.randint(3, vocab, (len(completion_lengths), completion_width), generator=generator)
    completion_mask = (torch.arange(completion_width)[None, :] < torch.tensor(completion_lengths)[:, None]).long()
    return (
        torch.stack(prompt_ids),
        torch.stack(prompt_mask),
        completion_ids.masked_fill(completion_mask == 0, 0),
        completion_mask,
    )


@pytest.fixture(autouse=True)
def always_share(monkeypatch):
    """Tiny shapes would not pass the cost test; the layout is what is under test here."""
    monkeypatch.setattr("polo.kernels.cpu.shared_prompt.sharing_pays", lambda *args: True)


def test_mask_lets_a_completion_see_its_prompt_and_itself_only():
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(50)
    shared = share_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    assert shared.input_ids.shape == (2, p + 3 * c) and shared.attention_mask.shape == (2, 1, p + 3 * c, p + 3 * c)
    mask = shared.attention_mask[:, 0]
    for group in range(2):
        for k in range(3):
            row = group * 3 + k
            real = int(completion_mask[row].sum())
            for t in range(real):
                query = p + k * c + t
                visible = mask[group, query].nonzero().squeeze(1).tolist()
                expected = [i for i in range(p) if prompt_mask[row, i]] + [p + k * c + s for s in range(t + 1)]
                assert visible == expected
            # positions restart after the prompt for every completion
            assert shared.position_ids[group, p + k * c : p + k * c + real].tolist() == [
                int(prompt_mask[row].sum()) + s for s in range(real)
            ]


def test_rows_that_are_not_whole_groups_of_one_prompt_are_not_shared():
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(50)
    assert share_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, 0) is None
    assert share_prompts(prompt_ids[:5], prompt_mask[:5], completion_ids[:5], completion_mask[:5], 3) is None
    different = prompt_ids.clone()
    different[1, -1] += 1
    assert share_prompts(different, prompt_mask, completion_ids, completion_mask, 3) is None


def test_cost_model_shares_short_completions_not_long_ones():
    d, per_layer = 576, 4 * 576 * 576 + 3 * 576 * 1536  # SmolLM2-135M
    assert sharing_pays(84, 64, 8, d, per_layer)
    assert not sharing_pays(100, 1024, 8, d, per_layer)  # dense attention over 8,292 positions
    assert not sharing_pays(400, 512, 8, d, per_layer) and sharing_pays(400, 512, 8, d, per_layer, blockwise=True)
    assert not sharing_pays(100, 1024, 8, d, per_layer, blockwise=True)  # saves under 20%: not worth a second code path
    assert not sharing_pays(84, 64, 1, d, per_layer, blockwise=True)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "polo"])
def test_shared_layout_gives_the_same_logprobs_and_gradients(tiny_model_dir, with_entropy, attention, monkeypatch):
    """Dense (transformers' SDPA over the full mask) and block-wise (polo's attention) alike."""
    model, _ = load_policy(str(tiny_model_dir))
    blocks = []
    if attention == "polo":
        assert use_polo_attention(model)
        real_shared_attention = shared_prompt.shared_attention
        monkeypatch.setattr(shared_prompt, "shared_attention", lambda *a: blocks.append(1) or real_shared_attention(*a))
    batch = grouped_batch(model.config.vocab_size)
    completion_mask = batch[3]
    results = []
    for group_size in (1, 3):  # 1: every row on its own
        model.zero_grad(set_to_none=True)
        logprobs, entropy = completion_logprobs(
            model, *batch, temperature=0.7, with_entropy=with_entropy, group_size=group_size
        )
        (logprobs * completion_mask).sum().backward()
        results.append((logprobs.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (separate, separate_entropy, separate_grads), (shared, shared_entropy, shared_grads) = results
    real = completion_mask.bool()
    torch.testing.assert_close(shared[real], separate[real], rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(shared_entropy[real], separate_entropy[real], rtol=1e-5, atol=1e-5)
    for name, grad in separate_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # the layout reached every layer, in both passes (group_size 1: every row its own block, unpadded)
    assert len(blocks) == (2 * model.config.num_hidden_layers if attention == "polo" else 0)


def test_block_wise_attention_equals_attention_under_the_full_mask():
    from polo.kernels.cpu.attention import polo_attention

    torch.manual_seed(0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(50)
    shared = share_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    groups, length = shared.input_ids.shape
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    query, key, value = (
        torch.randn(groups, 4, length, 8),
        torch.randn(groups, 2, length, 8),
        torch.randn(groups, 2, length, 8),
    )
    dense, _ = polo_attention(module, query, key, value, shared.attention_mask)
    blocks, _ = polo_attention(module, query, key, value, shared.attention_mask, shared_layout=shared.layout)
    assert blocks.shape == dense.shape == (groups, length, 4, 8)
    real = torch.cat([prompt_mask.view(2, 3, -1)[:, 0], completion_mask.view(2, -1)], dim=1).bool()
    torch.testing.assert_close(blocks[real], dense[real], rtol=1e-5, atol=1e-6)


def test_the_shared_path_is_taken_only_when_asked(tiny_model_dir):
    """transformers' SDPA cannot skip blocks: rows on their own stay plain rows; groups share their prompt."""
    model, _ = load_policy(str(tiny_model_dir))
    batch = grouped_batch(model.config.vocab_size)
    with torch.no_grad():
        assert shared_completion_logprobs(model, *batch, group_size=1) is None
        assert shared_completion_logprobs(model, *batch, group_size=3) is not None


def test_micro_batches_hold_whole_groups_when_they_can():
    from polo.rl.batching import micro_batches

    rows = torch.arange(24)
    assert [len(m) for m in micro_batches(rows, 20, group_size=8)] == [16, 8]  # rounded down to 2 groups
    assert [len(m) for m in micro_batches(rows, 5, group_size=8)] == [5, 5, 5, 5, 4]  # smaller than a group: as asked
    assert [len(m) for m in micro_batches(rows, 20)] == [20, 4]


def test_rows_on_their_own_run_without_padding_and_give_the_same_logprobs_and_gradients(tiny_model_dir):
    """group_size 1 under polo's attention: each row is its own block, the trunk runs real tokens only."""
    model, _ = load_policy(str(tiny_model_dir))
    batch = grouped_batch(model.config.vocab_size)
    completion_mask = batch[3]
    results = []
    for polo in (False, True):
        if polo:
            assert use_polo_attention(model)
        results.append(logprobs_entropy_grads(model, batch))
    (plain, plain_entropy, plain_grads), (unpadded, unpadded_entropy, unpadded_grads) = results
    real = completion_mask.bool()
    torch.testing.assert_close(unpadded[real], plain[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpadded_entropy[real], plain_entropy[real], rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(unpadded_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    rows = shared_completion_logprobs(model, *batch, 1)
    assert rows is not None  # the unpadded path was taken


def test_without_padding_runs_exactly_the_real_tokens():
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(50)
    for group_size in (1, 3):
        shared = share_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
        real = int(prompt_mask[::group_size].sum() + completion_mask.sum())
        exact = without_padding(shared, row_multiple=1)
        assert exact.input_ids.shape == (1, real)
        unpadded = without_padding(shared)  # filler tokens round the row up to a multiple of 8
        length = unpadded.input_ids.shape[1]
        assert length % 8 == 0 and real <= length < real + 8 and length > real
        assert unpadded.input_ids[0, :real].tolist() == exact.input_ids[0].tolist()
        assert unpadded.attention_mask is None
        # the row holds each group's real prompt tokens, then its completions' real tokens, in order
        expected = []
        for group in range(prompt_ids.shape[0] // group_size):
            first = group * group_size
            expected += prompt_ids[first][prompt_mask[first].bool()].tolist()
            for row in range(first, first + group_size):
                expected += completion_ids[row][completion_mask[row].bool()].tolist()
        assert exact.input_ids[0].tolist() == expected


def prefixed_batch(vocab: int, prefix: int = 6, rests=(0, 3, 1, 2), completion_lengths=(4, 1, 3, 2), seed: int = 1):
    """Rows whose left-padded prompts open with the same `prefix` tokens, then differ (`rests` more tokens each)."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=generator)
    width = prefix + max(rests)
    prompt_ids = torch.zeros(len(rests), width, dtype=torch.long)
    prompt_mask = torch.zeros(len(rests), width, dtype=torch.long)
    for row, rest in enumerate(rests):
        own = torch.randint(3, vocab, (rest,), generator=generator)  # row 0 has no rest: the prefix is all 6
        prompt_ids[row, width - prefix - rest :] = torch.cat([shared, own])
        prompt_mask[row, width - prefix - rest :] = 1
    completion_width = max(completion_lengths)
    completion_ids = torch.randint(3, vocab, (len(rests), completion_width), generator=generator)
    completion_mask = (torch.arange(completion_width)[None, :] < torch.tensor(completion_lengths)[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids.masked_fill(completion_mask == 0, 0), completion_mask


def test_rows_are_split_at_their_prompts_common_prefix():
    from polo.kernels.cpu.shared_prompt import split_common_prefix

    prompt_ids, prompt_mask, completion_ids, completion_mask = prefixed_batch(50)
    split = split_common_prefix(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert split.prompt_ids.shape == (4, 6) and split.offset.tolist() == [0, 3, 1, 2]
    for row in range(4):  # [prefix | rest] holds exactly the row's real tokens, in order
        real = (
            prompt_ids[row][prompt_mask[row].bool()].tolist()
            + completion_ids[row][completion_mask[row].bool()].tolist()
        )
        rest = split.completion_ids[row][split.completion_mask[row].bool()].tolist()
        assert split.prompt_ids[row].tolist() + rest == real
    assert split.completion_ids.shape[1] == max(3 + 1, 1 + 3, 2 + 2, 0 + 4)
    assert split_common_prefix(*grouped_batch(50, group_size=1, completion_lengths=(4, 1))) is None  # nothing shared
    assert split_common_prefix(prompt_ids[:1], prompt_mask[:1], completion_ids[:1], completion_mask[:1]) is None


@pytest.mark.parametrize("attention", ["sdpa", "polo"])
def test_rows_sharing_a_prompt_prefix_run_it_once_with_the_same_logprobs_and_gradients(
    tiny_model_dir, attention, monkeypatch
):
    model, _ = load_policy(str(tiny_model_dir))
    if attention == "polo":
        assert use_polo_attention(model)
    batch = prefixed_batch(model.config.vocab_size)
    completion_mask = batch[3]
    ran = []
    real_without_padding = scoring.without_padding
    monkeypatch.setattr(scoring, "without_padding", lambda s: ran.append(real_without_padding(s)) or ran[-1])
    results = []
    for fused in (False, True):  # False: plain logits over each row whole
        monkeypatch.setattr(scoring, "FUSED_LOGPROBS", fused)
        results.append(logprobs_entropy_grads(model, batch, temperature=0.7))
    (plain, plain_entropy, plain_grads), (prefixed, prefixed_entropy, prefixed_grads) = results
    real = completion_mask.bool()
    torch.testing.assert_close(prefixed[real], plain[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefixed_entropy[real], plain_entropy[real], rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(prefixed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (prefixed[~real] == 0).all()
    if attention == "polo":  # the trunk ran the 6 prefix tokens once, then each row's rest and completion
        (unpadded,) = ran
        real = 6 + (3 + 1 + 2) + int(completion_mask.sum())
        assert unpadded.input_ids.shape == (1, -(-real // 8) * 8)  # with filler up to a multiple of 8
    else:
        assert not ran


def logprobs_entropy_grads(model, batch, **options) -> tuple:
    """Return (log-probs, entropy, {parameter name: gradient}) of `completion_logprobs` on `batch` (prompt ids and
    mask, completion ids and mask), after backpropagating the summed log-probs of real completion tokens."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = completion_logprobs(model, *batch, with_entropy=True, **options)
    (logprobs * batch[3]).sum().backward()
    return logprobs.detach(), entropy, {name: p.grad.clone() for name, p in model.named_parameters()}


def groups_with_a_common_prefix(vocab: int, group_size: int = 3, prefix: int = 5, rests=(2, 0, 4), seed: int = 2):
    """Groups of `group_size` rows whose prompts open with the same `prefix` tokens and then differ (`rests` more)."""
    prompt_ids, prompt_mask, _, _ = prefixed_batch(
        vocab, prefix=prefix, rests=rests, completion_lengths=rests, seed=seed
    )
    generator = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(1, 6, (len(rests) * group_size,), generator=generator)
    completion_ids = torch.randint(3, vocab, (len(lengths), 5), generator=generator)
    completion_mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    return (
        prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids.masked_fill(completion_mask == 0, 0),
        completion_mask,
    )


def test_groups_whose_prompts_open_alike_run_the_common_prefix_once(tiny_model_dir, monkeypatch):
    """GRPO groups behind one system prompt: the trunk runs that prefix once, with the log-probs and gradients of
    separate rows."""
    model, _ = load_policy(str(tiny_model_dir))
    batch = groups_with_a_common_prefix(model.config.vocab_size)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    shared = share_prompts(*batch, 3)
    exact = without_padding(shared, row_multiple=1)
    every_group = without_padding(shared, row_multiple=1, common_prefix=False)
    real = int(prompt_mask[::3].sum() + completion_mask.sum())
    assert every_group.input_ids.shape == (1, real)
    assert exact.input_ids.shape == (1, real - 2 * 5)  # the two later groups' 5 prefix tokens are not run again
    expected = []  # the row: the prefix once, each group's rest of prompt and its completions
    for group in range(3):
        first = group * 3
        expected += prompt_ids[first][prompt_mask[first].bool()].tolist()[5 if group else 0 :]
        for row in range(first, first + 3):
            expected += completion_ids[row][completion_mask[row].bool()].tolist()
    assert exact.input_ids[0].tolist() == expected

    ran = []
    real_without_padding = scoring.without_padding
    monkeypatch.setattr(scoring, "without_padding", lambda s: ran.append(real_without_padding(s)) or ran[-1])
    plain = logprobs_entropy_grads(model, batch, group_size=3)  # transformers' SDPA: separate rows
    assert use_polo_attention(model)
    prefixed = logprobs_entropy_grads(model, batch, group_size=3)
    assert len(ran) == 1 and ran[0].input_ids.shape[1] == -(-(real - 10) // 8) * 8
    mask = completion_mask.bool()
    torch.testing.assert_close(prefixed[0][mask], plain[0][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefixed[1][mask], plain[1][mask], rtol=1e-5, atol=1e-5)
    for name, grad in plain[2].items():
        torch.testing.assert_close(prefixed[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
