"""Gemma 3 as a second model family, on a tiny random Gemma3 (offline, seconds): BOS everywhere, sliding-window
attention in polo's sampler and scoring, the chunked log-probs decided by structure, and the built-in's fetch.

The real Gemma 3 270M is only touched by benchmarks/model_families.py (and `polo fetch-model gemma3-270m`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import string
import zipfile
from pathlib import Path

import pytest
import torch

from polo.data.preferences import Demonstration, Ranking
from polo.finetune.reward_model import encode_rankings
from polo.finetune.sft import encode_demonstrations
from polo.generation.cpu_sampler import generate, rollout
from polo.generation.prompts import format_prompt, stop_token_ids, tokenize_prompts
from polo.generation.rollouts import Decoding
from polo.generation.stopping import Stopping
from polo.kernels.cpu.attention import use_polo_attention
from polo.kernels.logprobs import supports_fused_logprobs
from polo.models import loading, scoring
from polo.models.family import attention_window, encode_prompts, fits_attention_window, prompt_prefix_ids
from polo.models.loading import BUILTIN_MODELS, BuiltinModel, ModelLoadError, load_policy
from polo.models.sequences import encode
from polo.rl.train import train

PAD, EOS, BOS = 0, 1, 2
WINDOW = 4  # sliding window of the tiny model: shorter than every sequence below, so it matters
GEMMA_CHAT_TEMPLATE = (  # writes the BOS itself, as Gemma's instruction-tuned template does
    "{{ bos_token }}{% for message in messages %}"
    "<start>{{ message['role'] }}\n{{ message['content'] }}<end>\n{% endfor %}"
    "{% if add_generation_prompt %}<start>model\n{% endif %}"
)


def gemma_tokenizer(chat_template: str | None = None):
    """Return a character tokenizer laid out like Gemma's: <pad> 0, <eos> 1, <bos> 2, and <bos> put in front by its
    post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start>", "<end>"]
    vocab = {token: index for index, token in enumerate(specials + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start>", "<end>"],
    )
    tokenizer.padding_side = "left"
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def gemma_config(vocab_size: int, sliding_window: int = WINDOW):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=8,  # scaling 8^-0.5, not head_dim^-0.5
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        tie_word_embeddings=True,
    )


def tiny_gemma(seed: int = 0, sliding_window: int = WINDOW):
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    return Gemma3ForCausalLM(gemma_config(len(gemma_tokenizer()), sliding_window))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """A saved tiny Gemma 3 base model (no chat template), loadable with `load_policy` like the real one."""
    directory = tmp_path_factory.mktemp("tiny-gemma")
    tiny_gemma().save_pretrained(str(directory))
    gemma_tokenizer().save_pretrained(str(directory))
    return directory


# ------------------------------------------------------------ BOS: once, everywhere, only where the tokenizer adds it


def test_gemma_like_tokenizers_get_their_bos_and_smollm2_like_ones_nothing(gemma_dir, tiny_model_dir):
    _, tokenizer = load_policy(str(gemma_dir))
    assert prompt_prefix_ids(tokenizer) == (BOS,)
    _, smol = load_policy(str(tiny_model_dir))
    assert prompt_prefix_ids(smol) == ()


def test_sampling_prompts_start_with_exactly_one_bos():
    tokenizer = gemma_tokenizer()
    prompts = [format_prompt(tokenizer, question, "Q: {question}\nA:") for question in ("1+2=", "12+34=")]
    assert prompts[0] == "Q: 1+2=\nA:\n"  # no chat template: plain completion-style text
    input_ids, mask = tokenize_prompts(tokenizer, prompts)
    for row, row_mask in zip(input_ids.tolist(), mask.tolist()):
        real = [token for token, keep in zip(row, row_mask) if keep]
        assert real[0] == BOS and real.count(BOS) == 1
        assert tokenizer.decode(real[1:]) in prompts


def test_a_chat_template_that_writes_the_bos_gets_no_second_one():
    tokenizer = gemma_tokenizer(GEMMA_CHAT_TEMPLATE)
    prompt = format_prompt(tokenizer, "1+2=", "{question}")
    assert prompt.startswith("<bos>")
    (row,) = encode_prompts(tokenizer, [prompt])
    assert row[0] == BOS and row.count(BOS) == 1
    input_ids, _ = tokenize_prompts(tokenizer, [prompt])
    assert input_ids[0].tolist() == row


def test_smollm2_like_prompts_are_tokenized_as_before(tiny_model_dir):
    _, tokenizer = load_policy(str(tiny_model_dir))
    prompts = [format_prompt(tokenizer, question, "{question}") for question in ("1+2=", "a longer question?")]
    input_ids, mask = tokenize_prompts(tokenizer, prompts)
    before = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    assert torch.equal(input_ids, before["input_ids"]) and torch.equal(mask, before["attention_mask"])


def test_sft_dpo_reward_model_and_rollouts_all_start_prompts_with_one_bos(gemma_dir):
    model, tokenizer = load_policy(str(gemma_dir))
    prompt = ({"role": "user", "content": "Q: 1+2=\nA:"},)
    (sft,) = encode_demonstrations(tokenizer, [Demonstration(prompt, " 3")], None, 64)
    (dpo,) = encode_rankings(tokenizer, [Ranking(prompt, (" 3", " 4"))], None, 64)
    (scored,) = encode(tokenizer, ["Q: 1+2=\nA:\n"], [" 3"], 64)
    for sequence in (*sft.sequences, *dpo.sequences, scored):
        assert sequence.prompt_ids[0] == BOS and sequence.prompt_ids.count(BOS) == 1
        assert BOS not in sequence.response_ids and sequence.response_ids[-1] == EOS
    sampled = rollout(model, tokenizer, ["Q: 1+2=\nA:\n", "Q: 12+34=\nA:\n"], 2, Decoding(3, temperature=1.0))
    for row, row_mask in zip(sampled.prompt_ids.tolist(), sampled.prompt_mask.tolist()):
        real = [token for token, keep in zip(row, row_mask) if keep]
        assert real[0] == BOS and real.count(BOS) == 1


# ---------------------------------------------------------------- sliding-window attention in polo's sampler


def completions_until_stop(ids: torch.Tensor, stop: int) -> list[list[int]]:
    rows = []
    for row in ids.tolist():
        rows.append(row[: row.index(stop) + 1] if stop in row else row)
    return rows


@pytest.mark.parametrize("polo_attention", [False, True])
def test_polo_greedy_sampling_equals_transformers_generate_with_bos(gemma_dir, polo_attention):
    model, tokenizer = load_policy(str(gemma_dir))
    model.eval()
    assert attention_window(model) == WINDOW
    prompts = ["Q: 7+8=\nA:", "Q: 12+34=\nA:", "x"]  # left padding, and prompts longer than the window
    input_ids, mask = tokenize_prompts(tokenizer, prompts)
    new_tokens = 12
    expected = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )[:, input_ids.shape[1] :]
    if polo_attention:
        assert use_polo_attention(model)
    stopping = Stopping(stop_token_ids(tokenizer, model), PAD)
    ids, completion_mask, _ = generate(model, input_ids, mask, Decoding(new_tokens, temperature=0.0), stopping)
    got = [row[: int(length)] for row, length in zip(ids.tolist(), completion_mask.sum(-1).tolist())]
    assert got == completions_until_stop(expected, EOS)
    # The window matters here: the same weights attending to everything write something else.
    unwindowed = tiny_gemma(sliding_window=1000)
    unwindowed.load_state_dict(model.state_dict())
    unwindowed.eval()
    other = unwindowed.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )[:, input_ids.shape[1] :]
    assert completions_until_stop(other, EOS) != got


# ---------------------------------------------------------------- log-probs: fused by structure, windows respected


def grouped_batch(tokenizer, group_size: int = 3, completion_len: int = 6, seed: int = 0):
    input_ids, mask = tokenize_prompts(tokenizer, ["Q: 7+8=\nA:", "Q: 1+2=\nA:"])
    prompt_ids, prompt_mask = input_ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
    generator = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(3, len(tokenizer), (prompt_ids.shape[0], completion_len), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 4:] = 0
    completion_ids[0, 4] = EOS
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def full_logits_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=scoring.position_ids_from_mask(mask)).logits
    logprobs = torch.log_softmax(logits[:, -completion_ids.shape[1] - 1 : -1].float(), -1)
    return logprobs.gather(-1, completion_ids[..., None]).squeeze(-1)


def test_gemma3_takes_the_fused_path_and_it_matches_the_full_logits():
    model, tokenizer = tiny_gemma(), gemma_tokenizer()
    assert supports_fused_logprobs(model)  # no allow-list: a final norm and a linear head, found by tracing
    batch = grouped_batch(tokenizer)
    fused, _ = scoring.completion_logprobs(model, *batch)
    fused.mul(batch[3]).sum().backward()
    fused_grad = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad(set_to_none=True)
    reference = full_logits_logprobs(model, *batch)
    reference.mul(batch[3]).sum().backward()
    real = batch[3].bool()  # padding positions are not scored (0) on the fused path
    torch.testing.assert_close(fused[real], reference[real], atol=2e-6, rtol=1e-5)
    assert torch.all(fused[~real] == 0)
    torch.testing.assert_close(fused_grad, model.get_output_embeddings().weight.grad, atol=1e-5, rtol=1e-4)


def test_the_full_logits_fallback_gives_the_same_values_with_a_frozen_head(monkeypatch):
    model, tokenizer = tiny_gemma(), gemma_tokenizer()
    batch = grouped_batch(tokenizer)
    fused, _ = scoring.completion_logprobs(model, *batch)
    monkeypatch.setattr(scoring, "FUSED_LOGPROBS", False)
    model.requires_grad_(
        False
    )  # a reference / LoRA base: the case where a strided head input copied the weight per row
    with torch.no_grad():
        fallback, _ = scoring.completion_logprobs(model, *batch, group_size=3)
    real = batch[3].bool()  # the fused path leaves padding positions unscored
    torch.testing.assert_close(fallback[real], fused.detach()[real], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window, shared", [(WINDOW, False), (64, True)])
def test_shared_prompt_scoring_only_where_no_window_cuts_a_row(monkeypatch, window, shared):
    monkeypatch.setattr(scoring, "sharing_pays", lambda *args, **kwargs: True)
    model, tokenizer = tiny_gemma(sliding_window=window), gemma_tokenizer()
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch = grouped_batch(tokenizer)
    assert fits_attention_window(model, prompt_ids.shape[1] + completion_ids.shape[1]) is shared
    result = scoring.shared_completion_logprobs(model, *batch, 3)
    assert (result is not None) is shared
    logprobs, _ = scoring.completion_logprobs(model, *batch, group_size=3)  # shared or not, the same values
    expected = full_logits_logprobs(model, *batch)
    torch.testing.assert_close(logprobs * completion_mask, expected * completion_mask, atol=1e-5, rtol=1e-5)


def test_dpo_and_reward_model_prompt_sharing_respects_the_window():
    """SFT/DPO/reward models share a ranking's prompt through a KV cache, whose sliding-window layers transformers
    keeps exact."""
    from polo.finetune.fit import RankingBatch, ranking_logprobs, sequence_logprobs

    model, tokenizer = tiny_gemma(), gemma_tokenizer()
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(tokenizer)
    batch = RankingBatch(
        prompt_ids[::3], prompt_mask[::3], completion_ids, completion_mask, torch.arange(2).repeat_interleave(3)
    )
    assert not fits_attention_window(model, prompt_ids.shape[1] + completion_ids.shape[1])
    torch.testing.assert_close(
        ranking_logprobs(model, batch), sequence_logprobs(model, batch.expanded()), atol=1e-5, rtol=1e-5
    )


def test_lora_on_gemma3_keeps_the_fused_path():
    from polo.config import LoraSettings
    from polo.models.lora import add_adapters

    model = add_adapters(tiny_gemma(), LoraSettings(r=4, alpha=8))
    assert supports_fused_logprobs(model)
    batch = grouped_batch(gemma_tokenizer())
    logprobs, _ = scoring.completion_logprobs(model, *batch)
    real = batch[3].bool()
    torch.testing.assert_close(logprobs[real], full_logits_logprobs(model, *batch)[real], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("lora", [0, 4])
def test_grpo_runs_end_to_end_on_a_tiny_gemma3(gemma_dir, tmp_path, lora):
    config = {
        "model": {"name": str(gemma_dir), "lora": {"r": lora, "alpha": 8}},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 20, "num_eval": 4},
        "rewards": {"correct": 1.0},
        "sampling": {"max_new_tokens": 6},
        "algorithm": {"group_size": 4, "beta": 0.04},
        "train": {
            "steps": 2,
            "prompts_per_step": 2,
            "micro_batch_size": 8,
            "learning_rate": 1e-3,
            "precision": "fp32",
            "seed": 0,
        },
        "eval": {"batch_size": 4, "max_new_tokens": 4},
        "output": {"dir": str(tmp_path / "run"), "progress": False},
    }
    result = train(config)
    rows = [row for row in result.metrics if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2] and all(row["kl"] >= 0 for row in rows)


# ---------------------------------------------------------------- the built-in: wheels joined into one GGUF


def fake_wheels(directory: Path, chunks: dict[str, bytes]) -> dict[str, Path]:
    """Write one wheel per member and return member -> wheel, as `loading.download_wheels` does."""
    directory.mkdir(parents=True, exist_ok=True)
    members = {}
    for index, (member, data) in enumerate(chunks.items()):
        wheel_path = directory / f"pkg{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel_path, "w") as wheel:
            wheel.writestr(member, data)
        members[member] = wheel_path
    return members


def test_gemma_builtin_joins_its_four_chunks_in_order():
    spec = BUILTIN_MODELS["gemma3-270m"]
    assert [Path(part).name for part in spec.gguf_parts] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    assert spec.gguf_name == "gemma-3-270m-q4_k_m.gguf" and len(spec.wheels) == 5
    assert BUILTIN_MODELS["smollm2-135m-instruct"].gguf_name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_join_gguf_concatenates_the_parts_and_checks_the_digest(tmp_path):
    chunks = {"b/data/m.gguf.part00": b"GGUF-one-", "a/data/m.gguf.part01": b"two-", "c/data/m.gguf.part02": b"three"}
    members = fake_wheels(tmp_path / "wheels", chunks)
    whole = b"GGUF-one-two-three"
    spec = BuiltinModel(wheels=("x",), gguf_parts=tuple(chunks), sha256=hashlib.sha256(whole).hexdigest())
    path = loading.join_gguf(spec, members, tmp_path / "out")
    assert path.name == "m.gguf" and path.read_bytes() == whole
    with pytest.raises(ModelLoadError, match="sha256"):
        loading.join_gguf(BuiltinModel(("x",), tuple(chunks), sha256="0" * 64), members, tmp_path / "bad")
    with pytest.raises(ModelLoadError, match="in none of the downloaded wheels"):
        loading.join_gguf(BuiltinModel(("x",), ("missing.gguf",)), members, tmp_path / "missing")


def test_ensure_builtin_model_fetches_joins_converts_and_keeps_the_notices(tmp_path, monkeypatch):
    chunks = {"p1/m.gguf.part00": b"GG", "p2/m.gguf.part01": b"UF", "main/data/NOTICE.md": b"terms apply"}
    spec = BuiltinModel(
        wheels=("p1==1", "p2==1", "main==1"), gguf_parts=tuple(list(chunks)[:2]), notices=("main/data/NOTICE.md",)
    )
    monkeypatch.setitem(BUILTIN_MODELS, "tiny-split", spec)
    monkeypatch.setenv("POLO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "download_wheels", lambda requirements, directory: fake_wheels(directory, chunks))
    converted = []

    def fake_convert(gguf_path: Path, output_dir: Path) -> None:
        converted.append(gguf_path.read_bytes())
        output_dir.mkdir(parents=True)
        (output_dir / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
        (output_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    target = loading.ensure_builtin_model("tiny-split", log=lambda message: None)
    assert converted == [b"GGUF"]
    assert (target / "NOTICE.md").read_text() == "terms apply" and (target / "config.json").exists()
    assert loading.ensure_builtin_model("tiny-split", log=lambda message: None) == target and converted == [
        b"GGUF"
    ]  # cached


def test_the_tiny_gemma_is_a_copyable_gemma3(gemma_dir):
    model, _ = load_policy(str(gemma_dir))
    assert model.config.model_type == "gemma3_text"
    assert supports_fused_logprobs(copy.deepcopy(model))
