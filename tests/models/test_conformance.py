"""The architecture conformance matrix: every family of tests/models/families.py (why those: its docstring) through
every path polo runs a model on, one test id per family and check.

Each check compares polo with transformers' own model built from the same config, untouched: greedy
samples of both samplers are `generate`'s tokens; the scored log-probs (the chunked lm_head of
polo.kernels.logprobs, plain rows and the shared-prompt layout of polo.models.scoring) are the log-softmax of
the full logits; one GRPO update, one SFT step and one DPO step move the weights and keep them finite; a
checkpoint written mid-run resumes to the same weights as the run that went on. polo prepares each model as
its trainer does (the device's attention, lean layers), so a family that cannot take a fast path checks the
fallback it takes (`test_fallbacks_are_named_and_exact`).

The same matrix runs on CUDA as `cuda`-marked tests (skipped, with the reason shown, where torch sees no GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import EOS, FAMILIES, MOE_FAMILIES, PAD, char_tokenizer, tiny_family

from conftest import tiny_rl_config
from polo.config import load_config
from polo.data.preferences import Demonstration, Ranking
from polo.finetune.dpo import DPOObjective, with_reference_logps
from polo.finetune.reward_model import encode_rankings
from polo.finetune.sft import SFTObjective, encode_demonstrations
from polo.generation import cpu_sampler, static_sampler
from polo.generation.prompts import tokenize_prompts
from polo.generation.rollouts import Decoding
from polo.generation.stopping import Stopping
from polo.kernels import fast_path_fallbacks, use_fast_attention, use_lean_layers
from polo.kernels.cpu.decode import LEAN_FAMILIES
from polo.models.loading import load_policy
from polo.models.scoring import completion_logprobs, position_ids_from_mask
from polo.rl.batching import UpdateBatch
from polo.rl.update import Learner, policy_update
from polo.runtime.checkpoint import Checkpointer, load_trainer_state
from polo.runtime.device import Compute

PROMPTS = ["What is 1 + 2?", "A longer prompt, so the others are left-padded: 17 * 3 = ", "x"]
NEW_TOKENS = 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
_TOKENIZER = char_tokenizer("left")
_BUILT: dict[str, torch.nn.Module] = {}


def reference(family: str, device: str) -> torch.nn.Module:
    """Return transformers' own model of `family` on `device` (built once, copied per test), untouched by polo."""
    if family not in _BUILT:
        _BUILT[family] = tiny_family(family, len(_TOKENIZER))
    return copy.deepcopy(_BUILT[family]).to(device)


def prepared(model: torch.nn.Module, compute: Compute) -> torch.nn.Module:
    """Return a copy of `model` as polo's trainer and samplers prepare it: the device's attention, lean layers."""
    model = copy.deepcopy(model)
    use_fast_attention(model, compute)
    use_lean_layers(model)
    return model


def fp32(device: str) -> Compute:
    return Compute.named("fp32", torch.device(device))


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


def assert_moved_and_finite(before: dict, model: torch.nn.Module) -> None:
    after = weights(model)
    assert all(torch.isfinite(value).all() for value in after.values())
    assert any(not torch.equal(before[name], after[name]) for name in before)


family_ids = pytest.mark.parametrize("family", list(FAMILIES))
device_ids = pytest.mark.parametrize("device", DEVICES)


@device_ids
@pytest.mark.parametrize("sampler", [cpu_sampler, static_sampler], ids=["cpu_sampler", "static_sampler"])
@family_ids
def test_greedy_samples_are_generates(family, sampler, device):
    """Each prompt sampled twice (a group over one prefill); both samplers give transformers' `generate` tokens."""
    model = reference(family, device)
    prompt_ids, prompt_mask = (t.to(device) for t in tokenize_prompts(_TOKENIZER, PROMPTS))
    completion_ids, completion_mask, _ = sampler.generate(
        prepared(model, fp32(device)),
        prompt_ids,
        prompt_mask,
        Decoding(max_new_tokens=NEW_TOKENS, temperature=0.0),
        Stopping(stop_ids=(EOS,), pad_id=PAD),
        compute=fp32(device),
        samples_per_prompt=2,
    )
    expected = model.generate(
        input_ids=prompt_ids.repeat_interleave(2, 0),
        attention_mask=prompt_mask.repeat_interleave(2, 0),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=[EOS],
    )[:, prompt_ids.shape[1] :]
    for row, mask, want in zip(completion_ids.tolist(), completion_mask.tolist(), expected.tolist()):
        length = sum(mask)
        assert length > 0 and row[:length] == want[:length]


@device_ids
@family_ids
def test_scored_logprobs_are_the_full_logits_log_softmax(family, device):
    """Plain rows (group 1) and the shared-prompt layout (groups of 3 rows over one prompt) alike."""
    model = reference(family, device)
    generator = torch.Generator().manual_seed(2)
    prompt_ids = torch.randint(3, 90, (2, 7), generator=generator).repeat_interleave(3, 0).to(device)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[3:, :2] = 0  # the second prompt left-padded
    completion_ids = torch.randint(3, 90, (6, 5), generator=generator).to(device)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 2:] = completion_mask[4, 4:] = 0
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    expected = torch.log_softmax(logits[:, 6:-1].double(), -1).gather(-1, completion_ids[..., None])[..., 0]
    polo_model = prepared(model, fp32(device))
    for group_size in (1, 3):
        with torch.no_grad():
            logprobs, _ = completion_logprobs(
                polo_model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=group_size
            )
        real = completion_mask.bool()
        torch.testing.assert_close(logprobs[real].double(), expected[real], atol=2e-5, rtol=1e-5)


def rl_config(**overrides):
    config = tiny_rl_config("unused", "unused")
    config["train"].update({"micro_batch_size": 3, "learning_rate": 1e-2, **overrides})
    return load_config(config)


def optimizer_of(model: torch.nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@device_ids
@family_ids
def test_one_grpo_update_moves_the_weights(family, device):
    """Rollouts of the family's own sampling, group-relative advantages, one `policy_update`."""
    compute = fp32(device)
    model = prepared(reference(family, device), compute).train()
    torch.manual_seed(0)
    rollouts = cpu_sampler.rollout(
        model, _TOKENIZER, PROMPTS[:2], 3, Decoding(NEW_TOKENS, temperature=1.0), compute=compute
    )
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.8, 0.2, -1.0], device=device)
    before = weights(model)
    optimizer, scheduler = optimizer_of(model)
    metrics = policy_update(
        Learner(model, optimizer, scheduler, compute), UpdateBatch(rollouts, advantages), rl_config()
    )
    assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values())
    assert_moved_and_finite(before, model)
    assert ("router/aux_loss" in metrics) == (family in MOE_FAMILIES)


def sft_examples():
    demonstrations = [
        Demonstration(({"role": "user", "content": "What is 2 + 3?"},), "5"),
        Demonstration(({"role": "user", "content": "Name a colour."},), "Blue, as the sky."),
    ]
    return encode_demonstrations(_TOKENIZER, demonstrations, None, 64)


def sft_step(model, optimizer) -> None:
    loss, _ = SFTObjective(PAD, next(model.parameters()).device).loss(model, sft_examples())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@device_ids
@family_ids
def test_one_sft_step_moves_the_weights(family, device):
    model = prepared(reference(family, device), fp32(device)).train()
    before = weights(model)
    sft_step(model, optimizer_of(model)[0])
    assert_moved_and_finite(before, model)


@device_ids
@family_ids
def test_one_dpo_step_moves_the_weights(family, device):
    """The reference is the starting model, scored first: the loss starts at log 2."""
    compute = fp32(device)
    model = prepared(reference(family, device), compute).train()
    rankings = [Ranking(({"role": "user", "content": "What is 2 + 3?"},), ("5", "six", "It is 7"))]
    examples = with_reference_logps(model, encode_rankings(_TOKENIZER, rankings, None, 64), PAD, 8, compute)
    loss, stats = DPOObjective(PAD, beta=0.1, device=compute.device).loss(model, examples)
    assert stats["loss"] == pytest.approx(3 * torch.log(torch.tensor(2.0)).item(), rel=1e-4)  # 3 pairs at log 2
    before = weights(model)
    optimizer = optimizer_of(model)[0]
    loss.backward()
    optimizer.step()
    assert_moved_and_finite(before, model)


@device_ids
@family_ids
def test_a_checkpoint_resumes(family, device, tmp_path):
    """Two SFT steps in one go, and one step, a checkpoint, a fresh load of it and the second step: the same weights."""
    compute = fp32(device)
    straight = prepared(reference(family, device), compute).train()
    optimizer, scheduler = optimizer_of(straight)
    sft_step(straight, optimizer)
    scheduler.step()
    checkpoint = Checkpointer(tmp_path, keep=1).save(1, straight, _TOKENIZER, optimizer, scheduler, {})
    sft_step(straight, optimizer)

    loaded, _ = load_policy(str(checkpoint))
    resumed = prepared(loaded.to(device), compute).train()
    optimizer, scheduler = optimizer_of(resumed)
    state = load_trainer_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sft_step(resumed, optimizer)
    for name, value in weights(straight).items():
        torch.testing.assert_close(dict(resumed.named_parameters())[name].detach(), value, atol=1e-6, rtol=1e-5)


@family_ids
def test_fallbacks_are_named_and_exact(family):
    """A family outside polo's lean decode step decodes through its forward, and the banner's note says so; either
    way a decode step's logits are the untouched model's."""
    compute = fp32("cpu")
    model = reference(family, "cpu")
    polo_model = prepared(model, compute)
    note = fast_path_fallbacks(polo_model, compute)
    assert ("decode step through the model's forward" in note) == (family not in LEAN_FAMILIES)
    prompt_ids, prompt_mask = tokenize_prompts(_TOKENIZER, PROMPTS)
    stopping, decoding = Stopping(stop_ids=(EOS,), pad_id=PAD), Decoding(max_new_tokens=1, temperature=0.0)
    with torch.no_grad():
        expected = model(
            input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask)
        ).logits[:, -1]
    first, _, _ = cpu_sampler.generate(polo_model, prompt_ids, prompt_mask, decoding, stopping, compute=compute)
    assert torch.equal(first[:, 0], expected.argmax(-1))
