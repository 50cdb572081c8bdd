"""Device discipline proven on the CPU: whole steps of every kind run under `implicit_device_guard`.

Inside the guard a tensor factory called from polo without `device=` fails, the default device is
`meta` (an allocation the check cannot see holds no data and fails as soon as it meets a real
tensor), and an op mixing two devices fails. Models are loaded before the guard's meta default is
on (under the factory check alone), as a user places a model and its inputs before running it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from polo.runtime.device import CPU
from polo.runtime.guard import DeviceMixError, ImplicitDeviceError, implicit_device_guard


def rl_config(model_dir: Path, output_dir: Path, **algorithm) -> dict:
    return {
        "model": {"name": str(model_dir)},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 40, "num_eval": 6},
        "rewards": {"correct": 1.0, "tag_count": 0.5},
        "sampling": {"max_new_tokens": 8, "temperature": 1.0},
        # beta > 0 and two epochs: the reference and the old log-probs are scored too
        "algorithm": {"group_size": 4, "beta": 0.1, "update_epochs": 2, **algorithm},
        "train": {
            "steps": 1,
            "prompts_per_step": 2,
            "micro_batch_size": 4,
            "learning_rate": 1e-3,
            "precision": "fp32",
            "seed": 3,
            "device": "cpu",
        },
        "eval": {"batch_size": 4, "max_new_tokens": 6},
        "output": {"dir": str(output_dir), "save_every": 1, "progress": False, "report_to": [], "plots": False},
    }


def guarded_rl_step(config: dict, overrides: list[str] | None = None) -> tuple[dict, Path]:
    """Return (metrics, checkpoint) of step 1 of `config`, set up under the factory check, run whole under the guard."""
    from polo.rl.setup import set_up
    from polo.rl.step import rl_step

    with implicit_device_guard(default_device=None):  # loading builds modules on the default device: keep it real
        run = set_up(config, overrides)
    with implicit_device_guard():
        metrics = rl_step(run, 1).metrics
        checkpoint = run.save(1)
    return metrics, checkpoint


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.precision=fp32"],
        ["train.precision=bf16_master"],
        ["train.precision=bf16_master", "model.lora.r=4"],
        [
            "algorithm.advantage_estimator=gdpo",
            "algorithm.sampler_correction=sequence_mask",
            "algorithm.off_policy_mask_threshold=0.1",
            "algorithm.policy_loss=gspo",
            "algorithm.loss_aggregation=seq_mean_token_sum",
        ],
        ["algorithm.name=vespo"],
    ],
    ids=["fp32", "bf16_master", "lora", "gdpo_luspo_sampler_correction", "vespo"],
)
def test_a_whole_grpo_step_names_the_device_of_every_tensor(tiny_model_dir, tmp_path, overrides):
    """Sample, score, reference, old log-probs, advantages, update and checkpoint, under the guard."""
    metrics, checkpoint = guarded_rl_step(rl_config(tiny_model_dir, tmp_path / "run"), overrides)
    assert metrics["grad_norm"] > 0 and "kl" in metrics
    assert (checkpoint / "trainer_state.pt").exists()


@pytest.mark.parametrize("layout", ["separate", "head"])
def test_a_ppo_step_with_its_critic_names_the_device_of_every_tensor(tiny_model_dir, tmp_path, layout):
    metrics, _ = guarded_rl_step(rl_config(tiny_model_dir, tmp_path / "run", name="ppo", critic=layout))
    assert "value/loss" in metrics and "value/explained_variance" in metrics


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_an_sft_step_names_the_device_of_every_tensor(tiny_model_dir, tmp_path):
    from polo.config.finetune import load_sft_config
    from polo.finetune.sft import SFTTrainer

    demos = [{"prompt": f"What is {i} + 1?", "response": f"{i + 1}"} for i in range(4)]
    config = load_sft_config(
        {
            "model": {"name": str(tiny_model_dir)},
            "data": {"train_path": write_jsonl(tmp_path / "demos.jsonl", demos), "max_length": 64},
            "train": {"max_steps": 1, "batch_size": 4, "micro_batch_size": 2, "device": "cpu", "precision": "fp32"},
            "output": {"dir": str(tmp_path / "sft"), "report_to": [], "progress": False},
        }
    )
    trainer = SFTTrainer(config)  # polo's attention: the batch runs without its padding
    model = trainer.trainee.model
    before = model.lm_head.weight.detach().clone()
    with implicit_device_guard():
        report = trainer.step(1)
    assert report.metrics["loss"] > 0 and not torch.equal(before, model.lm_head.weight.detach())


def test_a_dpo_step_names_the_device_of_every_tensor(tiny_model_dir, tmp_path):
    from polo.config.finetune import load_dpo_config
    from polo.finetune.dpo import DPOTrainer, with_reference_logps

    rankings = [{"prompt": "Say 1.", "ranked": ["1", "2", "3"]}, {"prompt": "Say 1.", "ranked": ["one", "two"]}]
    config = load_dpo_config(
        {
            "model": {"name": str(tiny_model_dir)},
            "data": {"train_path": write_jsonl(tmp_path / "rankings.jsonl", rankings), "max_length": 64},
            "train": {
                "max_steps": 1,
                "batch_size": 2,
                "micro_batch_size": 3,
                "device": "cpu",
                "precision": "fp32",
                "learning_rate": 1e-3,
            },
            "output": {"dir": str(tmp_path / "dpo"), "report_to": [], "progress": False},
        }
    )
    trainer = DPOTrainer(config)
    with implicit_device_guard():
        scored = with_reference_logps(
            trainer.trainee.model, trainer.train_examples, trainer.tokenizer.pad_token_id, 2, CPU
        )
        report = trainer.step(1)
    assert [example.reference_logps for example in scored] == [e.reference_logps for e in trainer.train_examples]
    assert report.metrics["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: the policy starts as its reference


def test_an_eval_batch_names_the_device_of_every_tensor(tiny_model_dir):
    """A `polo eval` batch: greedy decoding of held-out prompts through the sampler, scored."""
    from polo.config import load_config
    from polo.data import instruction_for, make_task
    from polo.evaluation.evaluate import greedy_accuracy
    from polo.generation.grouped import GroupSampling
    from polo.models.loading import load_policy

    config = load_config(
        {"model": {"name": str(tiny_model_dir)}, "task": {"name": "arithmetic", "num_train": 4, "num_eval": 4}}
    )
    task = make_task(config)
    model, tokenizer = load_policy(str(tiny_model_dir))
    prompts = task.prompts(tokenizer, task.eval_rows, instruction_for(config, task), None)
    with implicit_device_guard():
        sampling = GroupSampling(max_new_tokens=6, batch_size=4, compute=CPU)
        result = greedy_accuracy(model, tokenizer, prompts, task.eval_rows, task.correctness, sampling)
    assert 0.0 <= result["accuracy"] <= 1.0


def planted_in(module, source: str, name: str):
    """Return function `name` defined by `source` as if it were written in `module`'s file (the guard reads the
    caller's file)."""
    namespace = dict(vars(module))
    exec(compile(source, module.__file__, "exec"), namespace)
    return namespace[name]


def test_the_guard_catches_an_implicit_allocation_planted_in_the_rl_step(tiny_model_dir, tmp_path, monkeypatch):
    """`torch.zeros(n)` planted in polo/rl/step.py's advantages fails at once, naming the function and the line."""
    from polo.rl import step
    from polo.rl.setup import set_up

    run = set_up(rl_config(tiny_model_dir, tmp_path / "run"))
    sampled = step.collect_batch(run, 1, {})  # sampled outside: the planted line is the only leak
    monkeypatch.setattr(step, "collect_batch", lambda *args: sampled)
    source = (
        "def planted_advantages(batch, *args):\n"
        "    scratch = torch.zeros(len(batch.rewards))  # planted: no device\n"
        "    return compute_advantages(batch, *args)\n"
    )
    monkeypatch.setattr(step, "compute_advantages", planted_in(step, source, "planted_advantages"))
    with implicit_device_guard(), pytest.raises(ImplicitDeviceError) as caught:
        step.rl_step(run, 1)
    message = str(caught.value)
    print(message)
    assert message.startswith("torch.zeros() without device= at polo/rl/step.py:2: ")
    assert "pass device= (the run's Compute.device, or an input tensor's .device)" in message


def test_an_allocation_that_slips_through_lands_on_meta_and_a_device_mix_fails():
    with implicit_device_guard():
        slipped = torch.zeros(3)  # called from a test, not from polo: not checked, but it holds no data
        assert slipped.device.type == "meta"
        with pytest.raises(
            DeviceMixError, match=r"Tensor.add\(\) mixes tensors on cpu, meta at .*test_device_guard.py:\d+"
        ):
            torch.ones(3, device=CPU.device) + slipped
        torch.ones(3, device=CPU.device) + torch.tensor(
            1.0, device=CPU.device
        )  # a 0-dim CPU scalar mixes with anything, as in torch
        assert (
            torch.ones(2, device=CPU.device).to("meta").device.type == "meta"
        )  # moving between devices is what `to` is for
    assert torch.zeros(1).device == CPU.device  # the default device is back


def test_factories_outside_polo_pass_and_a_module_polo_builds_without_a_device_fails():
    from polo.models import critic

    with implicit_device_guard(default_device=None):
        torch.nn.Linear(2, 2)  # built for the test, not by polo: not polo's to fix
        with pytest.raises(ImplicitDeviceError, match=r"torch.empty\(\) without device= at polo/models/critic.py:2: "):
            planted_in(critic, "def head(size):\n    return torch.nn.Linear(size, 1)\n", "head")(8)
        trunk = torch.nn.Linear(2, 2, device=CPU.device)
        trunk.config = SimpleNamespace(hidden_size=2)
        assert critic.new_value_head(trunk).weight.device == CPU.device  # the real head names its device: the trunk's
