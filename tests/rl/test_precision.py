"""bf16 weights with fp32 master weights, and attention whose backward runs in fp32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import final_weights, interrupted_then_resumed, tiny_config, without_times

from polo.config import ConfigError, load_config
from polo.kernels.cpu.attention import POLO_ATTENTION
from polo.models.loading import load_policy
from polo.models.precision import MasterWeights
from polo.rl.train import train
from polo.runtime import device as trainer_module
from polo.runtime import rates as rates_module
from polo.runtime.device import finetune_compute, inference_compute, train_compute
from polo.runtime.rates import MatmulRates


def test_master_weights_cast_the_model_and_keep_fp32_copies(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    masters = MasterWeights(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert {name: b.dtype for name, b in model.named_buffers()} == buffers  # rotary frequencies stay fp32
    assert len(masters.parameters) == len(list(model.parameters()))
    for (name, _), master in zip(model.named_parameters(), masters.parameters):
        assert master.dtype == torch.float32 and torch.equal(master, original[name])  # exact, not via bf16
    state = masters.state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert all(tensor.dtype == torch.float32 for tensor in state.values())
    if model.config.tie_word_embeddings:
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # still tied


def test_gradients_accumulate_in_fp32_masters_and_steps_reach_the_model(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    masters = MasterWeights(model)
    optimizer = torch.optim.SGD(masters.parameters, lr=0.1)
    masters.attach(optimizer)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    grads = []
    for _ in range(2):  # two micro-batches
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        assert all(p.grad is None for p in model.parameters())  # each bf16 gradient moved out at once
        grads.append([m.grad.clone() for m in masters.parameters])
    for first, total in zip(grads[0], grads[1]):
        assert total.dtype == torch.float32
        torch.testing.assert_close(total, 2 * first, rtol=1e-2, atol=1e-6)  # same batch twice: summed
    before = [m.detach().clone() for m in masters.parameters]
    optimizer.step()
    for (parameter, master), old, grad in zip(masters.pairs, before, grads[1]):
        torch.testing.assert_close(master.detach(), old - 0.1 * grad)
        assert torch.equal(parameter.detach(), master.detach().to(torch.bfloat16))  # pushed back, rounded


def test_a_step_after_zero_grad_holds_only_its_own_gradient(tiny_model_dir):
    """`zero_grad(set_to_none=True)` drops each master's `.grad`; the next step's gradient has nothing of the step
    before in it."""
    model, _ = load_policy(str(tiny_model_dir))
    masters = MasterWeights(model)
    optimizer = torch.optim.SGD(masters.parameters, lr=0.0)
    masters.attach(optimizer)
    batches = [torch.randint(0, model.config.vocab_size, (2, 6)) for _ in range(2)]
    grads = []
    for ids in batches + batches[1:]:  # step on batch 0, then batch 1 twice
        optimizer.zero_grad(set_to_none=True)
        assert all(m.grad is None for m in masters.parameters)
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        grads.append([m.grad.clone() for m in masters.parameters])
        optimizer.step()
    for second, third in zip(grads[1], grads[2]):
        assert torch.equal(second, third)  # batch 1's gradient alone, whatever batch 0 left
    assert any(not torch.equal(first, second) for first, second in zip(grads[0], grads[1]))


def test_updates_below_bf16_resolution_accumulate_in_the_masters(tiny_model_dir):
    """100 steps of 1e-4 relative each: lost entirely in bf16 weights (2^-8 resolution), kept by the masters."""
    model, _ = load_policy(str(tiny_model_dir))
    masters = MasterWeights(model)
    parameter, master = masters.pairs[0]
    optimizer = torch.optim.SGD([master], lr=1.0)
    masters.attach(optimizer)
    start = master.detach().clone()
    for _ in range(100):
        master.grad = -1e-4 * start.abs().clamp(min=1e-3)
        optimizer.step()
    bf16_alone = start.to(torch.bfloat16)
    for _ in range(100):  # the same updates applied to bf16 weights directly round away
        bf16_alone = bf16_alone + (1e-4 * start.abs().clamp(min=1e-3)).to(torch.bfloat16)
    big = start.abs() > 1e-2
    assert torch.equal(bf16_alone[big], start.to(torch.bfloat16)[big])  # bf16 weights alone never moved
    moved = parameter.detach().float() != start.to(torch.bfloat16).float()
    assert moved[big].float().mean() > 0.5  # through the masters most of them did (+1% each)
    torch.testing.assert_close(master.detach(), start + 1e-2 * start.abs().clamp(min=1e-3), rtol=1e-5, atol=1e-7)


def measured(fp32: float, bf16: float, monkeypatch) -> None:
    """Make this CPU report native bf16 and the given matmul rates (GFLOP/s): nothing is timed."""
    monkeypatch.setattr(trainer_module, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(trainer_module, "cached_rates", lambda: MatmulRates(fp32=fp32, bf16=bf16, cached=True))


def test_auto_precision_picks_master_weights_unless_a_critic_is_trained(monkeypatch):
    measured(300.0, 860.0, monkeypatch)  # an EPYC with AVX-512 BF16: bf16 about 3x fp32
    on_cpu = {"precision": "auto", "device": "cpu"}
    compute = train_compute(load_config({"train": on_cpu}))
    assert (compute.precision, compute.param_dtype, compute.master_weights) == ("bf16_master", torch.bfloat16, True)
    assert str(compute) == "bf16_master on cpu (auto: fp32 300 / bf16 860 GFLOP/s (cached))"
    ppo = load_config({"algorithm": {"name": "ppo"}, "train": on_cpu})
    assert train_compute(ppo).precision == "bf16" and train_compute(ppo).autocast_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="bf16_master.*critic"):
        train_compute(
            load_config({"algorithm": {"name": "ppo"}, "train": {"precision": "bf16_master", "device": "cpu"}})
        )
    monkeypatch.setattr(trainer_module, "cpu_supports_bf16", lambda: False)
    assert train_compute(load_config({"train": on_cpu})).precision == "fp32"


def test_auto_precision_follows_the_measured_rates_not_the_flags(monkeypatch):
    """A CPU that lists avx512_bf16 but multiplies bf16 at half its fp32 rate (issue 28's Intel VM) trains in fp32."""
    measured(320.0, 167.0, monkeypatch)
    for section in (
        {"train": {"precision": "auto", "device": "cpu"}},
        {"algorithm": {"name": "ppo"}, "train": {"device": "cpu"}},
    ):
        compute = train_compute(load_config(section))
        assert compute.precision == "fp32" and "fp32 320 / bf16 167" in compute.basis
    assert finetune_compute("auto", "cpu").precision == "fp32"  # polo sft / rm / dpo
    assert inference_compute("auto", "cpu").precision == "fp32"  # polo eval, the pipeline's sampling
    explicit = train_compute(load_config({"train": {"precision": "bf16_master", "device": "cpu"}}))
    assert (explicit.precision, explicit.basis) == ("bf16_master", "explicit")  # an explicit precision always wins
    measured(300.0, 2200.0, monkeypatch)  # an Intel with AMX
    assert finetune_compute("auto", "cpu").precision == "bf16_master"
    assert inference_compute("auto", "cpu").precision == "bf16_weights"


@pytest.mark.parametrize(("fp32", "bf16", "expected"), [(300.0, 860.0, "bf16_master"), (320.0, 167.0, "fp32")])
def test_fine_tuning_takes_polo_trains_precision_decision(monkeypatch, fp32, bf16, expected):
    """`polo sft / rm / dpo` and `polo train` resolve `auto` by one function, from the same measured rates."""
    measured(fp32, bf16, monkeypatch)
    rl = train_compute(load_config({"train": {"precision": "auto", "device": "cpu"}}))
    finetune = finetune_compute("auto", "cpu")
    assert finetune == rl and finetune.precision == expected
    assert str(finetune) == str(rl) == f"{expected} on cpu (auto: fp32 {fp32:.0f} / bf16 {bf16:.0f} GFLOP/s (cached))"
    for explicit in ("fp32", "bf16", "bf16_master"):  # an explicit precision wins either way
        assert (finetune_compute(explicit, "cpu").precision, finetune_compute(explicit, "cpu").basis) == (
            explicit,
            "explicit",
        )
    monkeypatch.setattr(trainer_module.parallel, "world_size", lambda: 2)  # masters need one process, as in RL
    assert finetune_compute("auto", "cpu").precision == ("bf16" if expected == "bf16_master" else "fp32")
    with pytest.raises(ConfigError, match="bf16_master: it trains in one process only"):
        finetune_compute("bf16_master", "cpu")
    with pytest.raises(ConfigError, match="train.precision 'bf16_weights' is not one of auto, fp32, bf16, bf16_master"):
        finetune_compute("bf16_weights", "cpu")


def test_matmul_rates_are_cached_per_machine_key(tmp_path, monkeypatch):
    """The first call measures and writes the cache; the next reads it; another key (threads) measures again."""
    monkeypatch.setenv("POLO_CACHE", str(tmp_path))
    calls = []

    def fake_measure():
        calls.append(1)
        return MatmulRates(fp32=100.0, bf16=50.0 * len(calls))

    first = rates_module.cached_rates(fake_measure)
    second = rates_module.cached_rates(fake_measure)
    assert (first.cached, second.cached, len(calls)) == (False, True, 1)
    assert (second.fp32, second.bf16) == (100.0, 50.0)
    monkeypatch.setattr(rates_module, "cache_key", lambda: "another machine")
    assert rates_module.cached_rates(fake_measure).bf16 == 100.0 and len(calls) == 2
    (tmp_path / "matmul_rates.json").write_text("{not json")
    assert rates_module.cached_rates(fake_measure).cached is False  # a broken cache costs a measurement, not a failure


def test_a_kernel_environment_variable_or_another_cpu_is_another_cache_key(tmp_path, monkeypatch):
    """ONEDNN_MAX_CPU_ISA changes which kernels run (bf16 fell below fp32 with it), so it is measured anew; and two
    CPUs with one bare model name ("AMD EPYC") but other families or flags do not share a measurement."""
    monkeypatch.setenv("POLO_CACHE", str(tmp_path))
    for name in rates_module.KERNEL_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    calls = []

    def fake_measure():
        calls.append(1)
        return MatmulRates(fp32=200.0, bf16=900.0 if len(calls) == 1 else 150.0)

    plain_key = rates_module.cache_key()
    assert "ONEDNN" not in plain_key
    assert rates_module.cached_rates(fake_measure).bf16_faster
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert rates_module.cache_key() == f"{plain_key} | ONEDNN_MAX_CPU_ISA=AVX512_CORE"
    capped = rates_module.cached_rates(fake_measure)
    assert (capped.cached, capped.bf16_faster, len(calls)) == (False, False, 2)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert rates_module.cached_rates(fake_measure).bf16 == 900.0 and len(calls) == 2  # the first entry still holds

    def cpuinfo(family: str, flags: str) -> str:
        return f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: {family}\nmodel\t\t: 1\nflags\t\t: {flags}\n\n"

    keys = []
    for family, flags in (("25", "fpu avx512f"), ("26", "fpu avx512f avx512_bf16"), ("26", "avx512_bf16 avx512f fpu")):
        text = cpuinfo(family, flags)
        monkeypatch.setattr(rates_module.Path, "read_text", lambda self, text=text: text)
        keys.append(rates_module.cpu_identity())
    assert keys[0] != keys[1] and keys[1] == keys[2]  # the flags' order does not matter
    assert keys[1].startswith("AMD EPYC | family 26 model 1 | flags ")


def test_bf16_master_run_saves_fp32_weights_and_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """Checkpoints hold the fp32 masters (loadable anywhere), and Ctrl-C + resume equals a straight run."""
    sections = {
        "train": {"precision": "bf16_master"},
        "output": {"save_every": 3, "report_to": [], "plots": False},
    }
    straight = train(tiny_config(tiny_model_dir, tmp_path / "straight", **sections))
    weights = final_weights(tmp_path / "straight")
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(weights[name], initial[name]) for name in initial)  # it trained
    saved_config = json.loads(
        (sorted((tmp_path / "straight" / "checkpoints").glob("step-*"))[-1] / "config.json").read_text()
    )
    assert POLO_ATTENTION not in json.dumps(saved_config)  # a plain transformers checkpoint
    assert saved_config["dtype"] == "float32"  # what from_pretrained(dtype="auto") will load

    resumed = interrupted_then_resumed(tiny_config(tiny_model_dir, tmp_path / "resumed", **sections), monkeypatch)
    assert without_times(resumed.metrics) == without_times(straight.metrics)
    resumed_weights = final_weights(tmp_path / "resumed")
    assert all(torch.equal(weights[name], resumed_weights[name]) for name in weights)


def test_master_gradients_sum_micro_batches_in_fp32_and_are_freed_after_each_step(tiny_model_dir):
    import weakref

    model, _ = load_policy(str(tiny_model_dir))
    masters = MasterWeights(model)
    optimizer = torch.optim.AdamW(masters.parameters, lr=1e-3)
    masters.attach(optimizer)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    for half in (ids[:1], ids[1:]):  # two micro-batches: the second adds into the first's fp32 gradient
        model(input_ids=half).logits.float().pow(2).mean().backward()
    grads = [master.grad for master in masters.parameters]
    assert all(grad is not None and grad.dtype == torch.float32 and grad.is_contiguous() for grad in grads)
    assert all(parameter.grad is None for parameter in model.parameters())  # the bf16 gradients went to the masters
    kept = [weakref.ref(grad) for grad in grads]
    del grads
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert all(ref() is None for ref in kept)  # nothing holds a gradient between steps
