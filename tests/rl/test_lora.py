"""LoRA training (model.lora.r > 0): adapters only, the reference is the base model, adapter checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import interrupted_then_resumed, tiny_config, without_times

from polo.config import ConfigError, load_config
from polo.finetune.sft import load_sft_config
from polo.models.loading import load_policy
from polo.models.lora import add_adapters, is_adapter_dir
from polo.rl.train import train

LORA = {"lora": {"r": 4, "alpha": 8}}


def checkpoints(output_dir):
    return sorted((output_dir / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("precision", ["bf16_master", "bf16"])
def test_lora_run_trains_adapters_against_the_base_model(tiny_model_dir, tmp_path, precision):
    """LoRA + KL: step 1 starts at the reference (B = 0), adapters move it away, checkpoints hold fp32 adapters."""
    sections = {
        "model": LORA,
        "algorithm": {"beta": 0.1},
        "train": {"precision": precision, "steps": 3},
        "output": {"save_every": 3, "report_to": [], "plots": False},
    }
    result = train(tiny_config(tiny_model_dir, tmp_path / "run", **sections))
    rows = [row for row in result.metrics if "reward/mean" in row]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the fresh adapters change nothing: policy == reference
    assert rows[-1]["kl"] > 0  # the adapters moved the policy away from the base (the reference)

    (latest,) = checkpoints(tmp_path / "run")
    assert is_adapter_dir(latest) and not (latest / "model.safetensors").exists()
    adapter = load_file(str(latest / "adapter_model.safetensors"))
    assert adapter and all("lora_" in name for name in adapter)
    assert all(tensor.dtype == torch.float32 for tensor in adapter.values())  # the fp32 masters
    assert any(name.endswith("lora_B.weight") and tensor.abs().sum() > 0 for name, tensor in adapter.items())

    # load_policy on the checkpoint: the base with the adapter merged in, an ordinary model
    merged, tokenizer = load_policy(str(latest))
    base, _ = load_policy(str(tiny_model_dir))
    assert not hasattr(merged, "peft_config") and tokenizer.pad_token is not None
    merged_state, base_state = merged.state_dict(), base.state_dict()
    assert merged_state.keys() == base_state.keys()
    changed = {name for name in base_state if not torch.equal(merged_state[name], base_state[name])}
    assert changed and all(name.endswith("proj.weight") for name in changed)  # only adapted linear layers moved

    # `polo eval` takes the adapter checkpoint like any model directory
    if precision == "bf16_master":
        from polo.cli import main

        command = ["eval", "--model", str(latest), "--greedy", "--limit", "3", "--max-new-tokens", "4", "--no-progress"]
        assert main(command + ["-o", str(tmp_path / "eval.json")]) == 0
        assert len(json.loads((tmp_path / "eval.json").read_text())["problems"]) == 3


def test_lora_resume_equals_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C during step 3 of a LoRA run, resume from the adapter checkpoint: same metrics, same adapter."""
    sections = {
        "model": LORA,
        "algorithm": {"beta": 0.05},
        "output": {"save_every": 3, "report_to": [], "plots": False},
    }
    straight = train(tiny_config(tiny_model_dir, tmp_path / "straight", **sections))

    resumed = interrupted_then_resumed(tiny_config(tiny_model_dir, tmp_path / "resumed", **sections), monkeypatch)
    assert without_times(resumed.metrics) == without_times(straight.metrics)
    a = load_file(str(checkpoints(tmp_path / "straight")[-1] / "adapter_model.safetensors"))
    b = load_file(str(checkpoints(tmp_path / "resumed")[-1] / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="model.lora.r must be at least 0, got -1"):
        load_config({"model": {"lora": {"r": -1}}})
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        load_config({"model": {"lora": {"r": 4, "dropout": 1.5}}})
    with pytest.raises(ConfigError, match="unknown config key 'model.lora.rank'.*r, alpha, dropout, target_modules"):
        load_config({"model": {"lora": {"rank": 4}}})
    with pytest.raises(ConfigError, match="PPO's critic"):
        load_config({"model": LORA, "algorithm": {"name": "ppo"}})
    with pytest.raises(ConfigError, match="fsdp"):
        load_config({"model": LORA, "train": {"data_parallel": "fsdp"}})
    with pytest.raises(ConfigError, match="polo train"):
        load_sft_config({"model": LORA, "data": {"train_path": "x.jsonl"}})


def test_unknown_target_module_names_the_model_linear_layers(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    settings = load_config({"model": {"lora": {"r": 2, "target_modules": ["qkv"]}}}).model.lora
    with pytest.raises(ConfigError, match=r"target_modules=\['qkv'\].*q_proj"):
        add_adapters(model, settings)


def test_adapter_checkpoint_without_a_base_is_a_clear_error(tmp_path):
    from polo.models.loading import ModelLoadError

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ModelLoadError, match="base_model_name_or_path"):
        load_policy(str(tmp_path))


def test_merged_sampling_weights_match_the_adapters_and_restore_the_base(tiny_model_dir):
    from polo.models.lora import merged_for_sampling

    model, _ = load_policy(str(tiny_model_dir))
    model = add_adapters(model, load_config({"model": LORA}).model.lora)
    torch.manual_seed(0)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)  # fresh adapters are zero: give them something to merge
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with merged_for_sampling(model) as sampler:
            assert type(sampler).__name__ == "LlamaForCausalLM"  # the plain transformers model, no peft wrapper
            merged = sampler(input_ids=ids).logits
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapters do change the output
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=1e-4)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # base and adapters untouched
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, adapted)  # adapters back on
