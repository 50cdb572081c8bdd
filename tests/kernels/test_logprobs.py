"""Chunked lm_head log-probs: values, entropy and gradients match the full-logits computation."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from polo.kernels.logprobs import (
    ChunkedTokenLogprobs,
    LogprobSettings,
    completion_logprobs_fused,
    supports_fused_logprobs,
    token_logprobs,
)


def naive(hidden, weight, targets, temperature, matmul_dtype=None):
    """Full-logits reference: (logprobs, entropy) over the last dim, softmax in hidden's float dtype."""
    if matmul_dtype is None:
        logits = hidden @ weight.T
    else:
        logits = (hidden.to(matmul_dtype) @ weight.to(matmul_dtype).T).float()
    logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def random_case(batch=1, seq=37, vocab=101, d=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, d, generator=generator, dtype=dtype)
    weight = torch.randn(vocab, d, generator=generator, dtype=dtype) * 0.5
    targets = torch.randint(0, vocab, (batch, seq), generator=generator)
    upstream = torch.randn(batch, seq, generator=generator, dtype=dtype)
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("vocab_block", [4096, 16, 7])  # one block, and blocks merged online (7 does not divide 101)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(1, 37), (3, 5)])
def test_forward_and_gradients_match_full_logits(temperature, shape, vocab_block):
    hidden, weight, targets, upstream = random_case(*shape)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    logprobs, entropy = token_logprobs(
        h1,
        w1,
        targets,
        LogprobSettings(temperature=temperature, chunk_size=8, vocab_block=vocab_block, with_entropy=True),
    )
    ref_logprobs, ref_entropy = naive(h2, w2, targets, temperature)
    assert logprobs.shape == entropy.shape == targets.shape and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-5, rtol=1e-5)

    (logprobs * upstream).sum().backward()  # the entropy unused: its gradient is None, as the reference's is
    (ref_logprobs * upstream).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4)


def test_float64_matches_reference_tightly():
    hidden, weight, targets, _ = random_case(dtype=torch.float64)
    logprobs, entropy = token_logprobs(
        hidden, weight, targets, LogprobSettings(temperature=1.3, chunk_size=8, vocab_block=10, with_entropy=True)
    )
    ref_logprobs, ref_entropy = naive(hidden, weight, targets, 1.3)
    assert logprobs.dtype == torch.float64
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-12, rtol=0)


def test_gradcheck_float64():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=generator)

    def logprobs_only(h, w):
        settings = LogprobSettings(0.7, with_entropy=True, chunk_size=2, vocab_block=3, compute_dtype=torch.float64)
        return ChunkedTokenLogprobs.apply(h, w, targets, settings)[0]

    assert torch.autograd.gradcheck(logprobs_only, (hidden, weight))


@pytest.mark.parametrize("keep_logits", [True, False])  # backward from the forward's kept logits, or recomputed
@pytest.mark.parametrize("with_logprobs", [True, False])
def test_entropy_gradients_match_full_logits(keep_logits, with_logprobs):
    """∂H/∂z = −p (log p + H) / T through both inputs, alone and beside the log-probs' gradient (an entropy bonus)."""
    hidden, weight, targets, upstream = random_case(3, 5)
    entropy_upstream = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    settings = LogprobSettings(0.8, with_entropy=True, chunk_size=4, vocab_block=16, keep_logits=keep_logits)
    logprobs, entropy = token_logprobs(h1, w1, targets, settings)
    ref_logprobs, ref_entropy = naive(h2, w2, targets, 0.8)
    assert entropy.requires_grad
    scale = 1.0 if with_logprobs else 0.0
    ((logprobs * upstream).sum() * scale + (entropy * entropy_upstream).sum()).backward()
    ((ref_logprobs * upstream).sum() * scale + (ref_entropy * entropy_upstream).sum()).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4)


def test_entropy_gradcheck_float64_and_none_without_entropy():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=generator)
    settings = LogprobSettings(0.7, with_entropy=True, chunk_size=2, vocab_block=3, compute_dtype=torch.float64)

    def both(h, w):
        return ChunkedTokenLogprobs.apply(h, w, targets, settings)

    assert torch.autograd.gradcheck(both, (hidden, weight))
    assert torch.autograd.gradcheck(lambda h, w: both(h, w)[1], (hidden, weight))
    plain = ChunkedTokenLogprobs.apply(hidden, weight, targets, LogprobSettings(0.7, compute_dtype=torch.float64))
    assert not plain[1].requires_grad


def test_chunk_size_does_not_change_the_result():
    hidden, weight, targets, _ = random_case()
    results = [
        token_logprobs(hidden, weight, targets, LogprobSettings(chunk_size=size, with_entropy=True))
        for size in (1, 8, 37, 4096)
    ]
    for logprobs, entropy in results[1:]:
        torch.testing.assert_close(logprobs, results[0][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, results[0][1], atol=1e-5, rtol=0)


def test_without_entropy_returns_none_and_same_logprobs():
    hidden, weight, targets, _ = random_case()
    with_entropy, _ = token_logprobs(hidden, weight, targets, LogprobSettings(chunk_size=8, with_entropy=True))
    logprobs, entropy = token_logprobs(hidden, weight, targets, LogprobSettings(chunk_size=8, with_entropy=False))
    assert entropy is None
    torch.testing.assert_close(logprobs, with_entropy, atol=1e-6, rtol=0)


def test_frozen_weight_gets_no_gradient_and_hidden_gradient_is_unchanged():
    hidden, weight, targets, upstream = random_case()
    h1 = hidden.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (
        token_logprobs(h1, weight, targets, LogprobSettings(chunk_size=8, with_entropy=True))[0] * upstream
    ).sum().backward()
    (token_logprobs(h2, w2, targets, LogprobSettings(chunk_size=8, with_entropy=True))[0] * upstream).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(h1.grad, h2.grad, atol=0, rtol=0)


def test_bf16_compute_matches_bf16_matmul_with_fp32_softmax():
    hidden, weight, targets, upstream = random_case()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, entropy = token_logprobs(
        h1, w1, targets, LogprobSettings(chunk_size=8, compute_dtype=torch.bfloat16, with_entropy=True)
    )
    ref_logprobs, ref_entropy = naive(h2, w2, targets, 1.0, matmul_dtype=torch.bfloat16)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-2, rtol=1e-2)

    (logprobs * upstream).sum().backward()
    (ref_logprobs * upstream).sum().backward()
    assert h1.grad.dtype == torch.float32 and w1.grad.dtype == torch.float32
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w1.grad, w2.grad, atol=2e-2, rtol=2e-2)


def test_autocast_selects_bf16_and_backward_outside_autocast_works():
    hidden, weight, targets, upstream = random_case()
    explicit, _ = token_logprobs(
        hidden, weight, targets, LogprobSettings(chunk_size=8, compute_dtype=torch.bfloat16, with_entropy=True)
    )
    h = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = token_logprobs(h, weight, targets, LogprobSettings(chunk_size=8, with_entropy=True))
    torch.testing.assert_close(logprobs, explicit, atol=0, rtol=0)
    (logprobs * upstream).sum().backward()
    assert h.grad.dtype == torch.float32 and torch.isfinite(h.grad).all()


def test_bf16_inputs_return_bf16_gradients():
    hidden, weight, targets, upstream = random_case(dtype=torch.bfloat16)
    hidden.requires_grad_()
    weight.requires_grad_()
    logprobs, entropy = token_logprobs(hidden, weight, targets, LogprobSettings(chunk_size=8, with_entropy=True))
    assert logprobs.dtype == entropy.dtype == torch.float32
    (logprobs * upstream.float()).sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def test_shape_errors_are_clear():
    hidden, weight, targets, _ = random_case()
    with pytest.raises(ValueError, match="targets must have shape"):
        token_logprobs(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match=r"\(batch, seq, d\)"):
        token_logprobs(hidden[0], weight, targets)


# --- Hugging Face integration -------------------------------------------------------------


def left_padded_batch(prompt_lengths=(6, 3, 1), prompt_width=6, completion_len=5, vocab=97, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    prompt_ids = torch.randint(2, vocab, (batch, prompt_width), generator=generator)
    prompt_mask = torch.zeros(batch, prompt_width, dtype=torch.long)
    for row, length in enumerate(prompt_lengths):
        prompt_mask[row, prompt_width - length :] = 1
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(2, vocab, (batch, completion_len), generator=generator)
    completion_mask = torch.ones(batch, completion_len, dtype=torch.long)
    completion_mask[1, -2:] = 0  # a finished row padded on the right
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, completion_ids


def full_logits_path(model, input_ids, attention_mask, position_ids, completion_ids, temperature):
    completion_len = completion_ids.shape[1]
    logits = (
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=completion_len + 1,
        )
        .logits[:, :-1]
        .float()
        / temperature
    )
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1).detach()
    return logp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), entropy


def tracked_grads(model) -> dict[str, torch.Tensor]:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    params = dict(model.named_parameters())
    return {name: params[name].grad.clone() for name in names}


def test_decoder_is_the_trunk_and_head_is_tied():
    model = tiny_llama()
    assert model.get_decoder() is model.model
    assert model.get_output_embeddings().weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_fused_completion_logprobs_match_full_logits_path(temperature):
    model = tiny_llama()
    input_ids, attention_mask, position_ids, completion_ids = left_padded_batch()
    upstream = torch.randn(completion_ids.shape, generator=torch.Generator().manual_seed(3))

    logprobs, entropy = completion_logprobs_fused(
        model,
        input_ids,
        attention_mask,
        position_ids,
        completion_ids,
        LogprobSettings(temperature, with_entropy=True, chunk_size=4),
    )
    (logprobs * upstream).sum().backward()
    fused_grads = tracked_grads(model)
    model.zero_grad(set_to_none=True)

    ref_logprobs, ref_entropy = full_logits_path(
        model, input_ids, attention_mask, position_ids, completion_ids, temperature
    )
    (ref_logprobs * upstream).sum().backward()
    ref_grads = tracked_grads(model)

    assert logprobs.shape == entropy.shape == completion_ids.shape
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(
            fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_fused_completion_logprobs_under_bf16_autocast_track_full_path():
    model = tiny_llama()
    input_ids, attention_mask, position_ids, completion_ids = left_padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, entropy = completion_logprobs_fused(
            model, input_ids, attention_mask, position_ids, completion_ids, LogprobSettings(1.0, with_entropy=False)
        )
        ref_logprobs, _ = full_logits_path(model, input_ids, attention_mask, position_ids, completion_ids, 1.0)
    assert entropy is None and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-2, rtol=1e-2)
    logprobs.sum().backward()
    fused = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    ref_logprobs.sum().backward()
    torch.testing.assert_close(fused, model.model.embed_tokens.weight.grad, atol=2e-2, rtol=5e-2)


def test_supports_fused_for_llama():
    assert supports_fused_logprobs(tiny_llama())


def test_no_fused_path_when_lm_head_has_a_bias():
    model = tiny_llama()
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(32, 97, bias=True)
    assert model.get_output_embeddings().bias is not None
    assert not supports_fused_logprobs(model)


@pytest.mark.parametrize(
    "field, value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625), ("logits_scaling", 8.0)]
)
def test_no_fused_path_when_config_post_processes_logits(field, value):
    model = tiny_llama()
    setattr(model.config, field, value)
    assert not supports_fused_logprobs(model)


def test_no_fused_path_when_config_or_structure_rule_it_out():
    from transformers import CohereConfig, CohereForCausalLM

    cohere = CohereForCausalLM(
        CohereConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    assert not supports_fused_logprobs(cohere)  # logits * logit_scale
    assert not supports_fused_logprobs(torch.nn.Linear(4, 4))


def test_fused_path_is_decided_by_structure_not_by_the_family_name():
    """An unknown model type whose logits are lm_head(final-normed trunk) takes the fused path and matches the full
    logits."""
    model = tiny_llama()
    model.config.model_type = "some_family_polo_never_heard_of"
    assert supports_fused_logprobs(model)
    input_ids, attention_mask, position_ids, completion_ids = left_padded_batch()
    logprobs, _ = completion_logprobs_fused(model, input_ids, attention_mask, position_ids, completion_ids)
    ref_logprobs, _ = full_logits_path(model, input_ids, attention_mask, position_ids, completion_ids, 1.0)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)


def test_no_fused_path_when_the_forward_changes_logits_after_the_head():
    """Post-processing that no config field names (here the logits are halved) is caught by the traced forward."""
    from transformers import LlamaForCausalLM

    class HalvedLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits / 2
            return output

    model = tiny_llama()
    model.__class__ = HalvedLogits
    assert not supports_fused_logprobs(model)


def test_a_model_is_traced_once_and_again_only_when_its_head_changes():
    model = tiny_llama()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    assert supports_fused_logprobs(model) and supports_fused_logprobs(model)
    assert len(calls) == 1
    model.lm_head = torch.nn.Linear(32, 97, bias=False)  # untied, a new module: traced anew
    assert supports_fused_logprobs(model) and len(calls) == 2


def test_no_fused_path_when_something_sits_between_trunk_and_head():
    model = tiny_llama()
    model.lm_head.register_forward_pre_hook(
        lambda module, args: (args[0] * 2,)
    )  # the head no longer reads the trunk's output
    assert not supports_fused_logprobs(model)
    assert supports_fused_logprobs(tiny_llama())


def other_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=97,
            n_embd=32,
            n_layer=1,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=1,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    qwen2_untied = tiny_qwen2(num_hidden_layers=1)
    return {"gpt2": gpt2, "qwen2_untied": qwen2_untied}


@pytest.mark.parametrize("name", ["gpt2", "qwen2_untied"])
def test_fused_path_matches_on_other_families(name):
    model = other_families()[name]
    assert supports_fused_logprobs(model)
    input_ids, attention_mask, position_ids, completion_ids = left_padded_batch()
    logprobs, _ = completion_logprobs_fused(
        model, input_ids, attention_mask, position_ids, completion_ids, LogprobSettings(1.0, with_entropy=False)
    )
    logprobs.sum().backward()
    head = model.get_output_embeddings().weight
    fused_head_grad = head.grad.clone()
    model.zero_grad(set_to_none=True)
    ref_logprobs, _ = full_logits_path(model, input_ids, attention_mask, position_ids, completion_ids, 1.0)
    ref_logprobs.sum().backward()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_head_grad, head.grad, atol=1e-5, rtol=1e-4)


def test_no_tokens_give_empty_results_and_zero_gradients():
    hidden = torch.zeros(0, 16, requires_grad=True)
    weight = torch.randn(101, 16, requires_grad=True)
    settings = LogprobSettings(1.0, with_entropy=True, chunk_size=8, vocab_block=7, compute_dtype=torch.float32)
    logprobs, entropy = ChunkedTokenLogprobs.apply(hidden, weight, torch.zeros(0, dtype=torch.long), settings)
    assert logprobs.shape == entropy.shape == (0,)
    logprobs.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_a_mask_scores_only_its_tokens_and_gives_the_same_values_and_gradients():
    """Masked positions never reach the head (0 out, no gradient into them); the rest equal the unmasked call."""
    torch.manual_seed(3)
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    upstream = torch.randn(3, 5, dtype=torch.float64)
    full, full_entropy = token_logprobs(
        hidden, weight, targets, LogprobSettings(chunk_size=4, vocab_block=3, with_entropy=True)
    )
    ((full * mask) * upstream).sum().backward()
    expected_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    masked, masked_entropy = token_logprobs(
        hidden, weight, targets, LogprobSettings(chunk_size=4, vocab_block=3, with_entropy=True), mask=mask
    )
    (masked * upstream).sum().backward()
    real = mask.bool()
    torch.testing.assert_close(masked[real], full[real])
    torch.testing.assert_close(masked_entropy[real], full_entropy[real])
    assert torch.all(masked[~real] == 0) and torch.all(masked_entropy[~real] == 0)
    torch.testing.assert_close(hidden.grad, expected_grads[0])
    torch.testing.assert_close(weight.grad, expected_grads[1])
    assert torch.all(hidden.grad[~real] == 0)


@pytest.mark.parametrize(
    "dtype, autocast, onednn",
    [
        (torch.float32, False, False),
        (torch.bfloat16, False, False),
        (torch.float32, True, False),
        (torch.float32, False, True),
    ],
)
def test_kept_logits_give_the_recomputed_values_and_gradients_bit_for_bit(monkeypatch, dtype, autocast, onednn):
    """The forward's kept logits (KEPT_LOGITS_BYTES) stand in for backward's recompute exactly, on every matmul path,
    and are dropped once backward has used them."""
    import polo.kernels.logprobs as logprobs

    monkeypatch.setattr(logprobs, "_through_onednn", lambda device, dtype: onednn)
    hidden, weight, targets, upstream = random_case(seq=300, vocab=900, d=32, dtype=dtype)
    settings = LogprobSettings(temperature=0.7, with_entropy=True, chunk_size=128, vocab_block=256)
    kept_tiles = []
    kept_tile_logits = logprobs._kept_tile_logits
    monkeypatch.setattr(logprobs, "_kept_tile_logits", lambda *a: kept_tiles.append(1) or kept_tile_logits(*a))
    results, contexts = [], []
    for budget in (0, 1 << 30):
        monkeypatch.setattr(logprobs, "KEPT_LOGITS_BYTES", budget)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, entropy = token_logprobs(h, w, targets, settings)
        contexts.append(logp.grad_fn.next_functions[0][0])  # the ChunkedTokenLogprobs node, under the view
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, h.grad, w.grad))
    assert len(kept_tiles) == 2 * 3 * 4  # forward and backward, 3 token chunks x 4 vocabulary blocks, budget > 0 only
    for recomputed, kept in zip(*results, strict=True):
        assert torch.equal(recomputed, kept)
    assert contexts[1].kept is None  # spent by backward


def test_logits_are_kept_only_where_a_backward_follows_and_they_fit(monkeypatch):
    import polo.kernels.logprobs as logprobs

    hidden, weight, targets, _ = random_case(seq=64, vocab=300, d=8)
    sizes = []
    blocks = logprobs._kept_blocks
    monkeypatch.setattr(logprobs, "_kept_blocks", lambda *a: sizes.append(b := blocks(*a)) or b)
    with torch.no_grad():
        token_logprobs(hidden, weight.requires_grad_(), targets)  # scoring: no backward to keep them for
    assert sizes == []
    token_logprobs(hidden, weight.detach(), targets)  # nothing needs a gradient
    token_logprobs(hidden, weight.requires_grad_(), targets)
    monkeypatch.setattr(logprobs, "KEPT_LOGITS_BYTES", 64 * 300 * 4 - 1)  # one byte short of the fp32 logits
    token_logprobs(hidden, weight, targets)
    assert sizes[0] is None and sizes[2] is None
    assert [tuple(block.shape) for block in sizes[1]] == [(64, 300)]
