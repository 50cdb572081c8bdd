"""benchmarks/grpo_vs_trl.py --model-shape: the public shapes' sizes, the flag, a random model written and run on."""

from __future__ import annotations

import pytest
import torch

from polo.models.loading import load_policy, load_tokenizer


@pytest.fixture(scope="module")
def grpo_vs_trl(load_benchmark):
    return load_benchmark("grpo_vs_trl")


@pytest.mark.parametrize(("shape", "billions"), [("qwen2.5-0.5b", 0.49), ("qwen2.5-1.5b", 1.54), ("qwen2.5-7b", 7.62)])
def test_each_shape_has_its_public_models_parameter_count(grpo_vs_trl, tiny_model_dir, shape, billions):
    """The parameter counts Qwen2.5's model cards give (0.49B, 1.54B, 7.61B), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    config = grpo_vs_trl.shape_config(shape, load_tokenizer(str(tiny_model_dir)))
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert count / 1e9 == pytest.approx(billions, abs=0.01)
    assert config.rope_parameters["rope_theta"] == 1e6


def test_the_flag_takes_the_shapes_and_refuses_others(grpo_vs_trl, capsys):
    parser = grpo_vs_trl.build_parser()
    args = parser.parse_args(["--model-shape", "qwen2.5-7b", "--gradient-checkpointing", "true"])
    assert (args.model_shape, args.gradient_checkpointing) == ("qwen2.5-7b", "true")
    assert parser.parse_args([]).model_shape is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-shape", "qwen2.5-70b"])
    assert "qwen2.5-0.5b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        grpo_vs_trl.use_model(parser.parse_args(["--model-shape", "qwen2.5-0.5b", "--accuracy-steps", "4"]), parser)


def test_a_tiny_shape_is_written_loaded_and_handed_to_every_run(grpo_vs_trl, tiny_model_dir, tmp_path, monkeypatch):
    shapes = {"tiny": {**grpo_vs_trl.MODEL_SHAPES["qwen2.5-0.5b"], "hidden_size": 32, "intermediate_size": 64}}
    shapes["tiny"].update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    directory = grpo_vs_trl.write_shape_model("tiny", tmp_path, shapes, tokenizer_from=str(tiny_model_dir))
    model, tokenizer = load_policy(str(directory))
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 32 and len(tokenizer) <= 128
    assert grpo_vs_trl.write_shape_model("tiny", tmp_path, shapes) == directory  # written once
    commands = []

    def child(command, **kwargs):
        commands.append(command)
        return 1

    monkeypatch.setattr(grpo_vs_trl, "MODEL", str(directory))
    monkeypatch.setattr(grpo_vs_trl, "RECOMPUTE", True)
    monkeypatch.setattr(grpo_vs_trl.subprocess, "call", child)
    with pytest.raises(SystemExit):
        grpo_vs_trl.run_child("polo", 2, tmp_path / "run")
    assert commands[0][-4:] == ["--model-dir", str(directory), "--gradient-checkpointing", "true"]
    config = grpo_vs_trl.polo_config(2, tmp_path / "out")
    assert config["model"]["name"] == str(directory) and config["train"]["gradient_checkpointing"] is True
