"""Data-parallel training under torchrun: 2 CPU processes must reproduce the single-process update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import final_weights, tiny_config, without_times

from polo.generation.cpu_sampler import rollout
from polo.generation.rollouts import Decoding
from polo.rl.batching import Batch

WORKER = Path(__file__).with_name("data_parallel_worker.py")

# Each config exercises a batch-spanning normaliser: seq-mean-token-mean over all sequences (grpo),
# token-mean over all tokens (dapo), batch whitening of returns (reinforce_pp), and PPO's separate
# critic trained alongside. Micro-batches of 3 over 4 local sequences accumulate gradients without
# syncing, two minibatches take two optimizer steps, and two epochs use the old log-probs.
BASE = {
    "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 8, "num_eval": 2},
    "sampling": {"max_new_tokens": 8, "temperature": 1.0},
    "train": {
        "prompts_per_step": 4,
        "micro_batch_size": 3,
        "num_minibatches": 2,
        "learning_rate": 1e-3,
        "precision": "fp32",
        "gradient_checkpointing": False,
    },
}
CONFIGS = {
    "grpo_kl": {"algorithm": {"name": "grpo", "group_size": 4, "beta": 0.1, "update_epochs": 2}},
    "dapo": {"algorithm": {"name": "dapo", "group_size": 4, "dynamic_sampling": False}},
    "reinforce_pp": {"algorithm": {"name": "reinforce_pp", "group_size": 4}},
    "ppo": {"algorithm": {"name": "ppo", "group_size": 4, "critic_learning_rate": 1e-3}},
    "grpo_kl_fsdp": {
        "algorithm": {"name": "grpo", "group_size": 4, "beta": 0.1, "update_epochs": 2},
        "train": {"data_parallel": "fsdp"},
    },
}


def with_pythonpath(directory: Path) -> dict[str, str]:
    """Return this process's environment with `directory` put first on PYTHONPATH (what was there stays:
    some machines find installed packages through it)."""
    paths = [str(directory), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def torchrun(*args: str, processes: int = 2) -> subprocess.CompletedProcess:
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT) prints every thread's Python stack into the failure's stderr
    env = {**with_pythonpath(WORKER.parent), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        str(WORKER),
        *args,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def config_for(model_dir, name: str) -> dict:
    config = {section: dict(values) for section, values in BASE.items()}
    config["model"] = {"name": str(model_dir)}
    for section, values in CONFIGS[name].items():
        config.setdefault(section, {}).update(values)
    return config


@pytest.fixture(scope="module")
def saved_batch(tiny_model_dir, tmp_path_factory):
    """Four groups of four sampled completions with spread-out rewards, saved for every process to load."""
    from polo.models.loading import load_policy

    torch.manual_seed(1)
    model, tokenizer = load_policy(str(tiny_model_dir))
    prompts = [
        f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n" for a, b in [(1, 2), (13, 4), (2, 2), (7, 30)]
    ]
    rollouts = rollout(model, tokenizer, prompts, 4, Decoding(8, temperature=1.0))
    assert rollouts.completion_mask.sum(-1).unique().numel() > 1  # lengths differ, so the token counts matter
    rewards = torch.linspace(-1.0, 2.0, len(rollouts))[torch.randperm(len(rollouts))]
    path = tmp_path_factory.mktemp("dp-batch") / "batch.pt"
    torch.save(Batch(rollouts, rewards, prompts), path)
    return path


def regroup(batch: Batch, order: list[int], group_size: int) -> Batch:
    rows = torch.tensor([group * group_size + member for group in order for member in range(group_size)])
    return Batch(batch.rollouts.select(rows), batch.rewards[rows], [batch.prompts[group] for group in order])


def test_two_processes_update_equals_one_process(tiny_model_dir, saved_batch, tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    from data_parallel_worker import one_update

    configs = {name: config_for(tiny_model_dir, name) for name in CONFIGS}
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    result = torchrun("update", str(saved_batch), str(tmp_path / "configs.json"), str(tmp_path), str(tiny_model_dir))
    assert result.returncode == 0, result.stderr[-4000:]

    # Minibatch i of the 2-process run is rank 0's i-th share of groups plus rank 1's: with 4 groups and
    # 2 minibatches that is groups (0, 2) then (1, 3), so the single process gets them in that order.
    batch = regroup(torch.load(saved_batch, weights_only=False), [0, 2, 1, 3], group_size=4)
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, config in configs.items():
        single, single_metrics = one_update(batch, config, str(tiny_model_dir))
        parallel = torch.load(tmp_path / f"{name}.pt")
        assert single.keys() == parallel["weights"].keys()
        for key, value in single.items():
            torch.testing.assert_close(parallel["weights"][key], value, atol=1e-5, rtol=0, msg=f"{name}: {key}")
        moved = max((single[key] - initial[key]).abs().max().item() for key in initial if key in single)
        assert moved > 1e-4, f"{name}: the update barely moved the weights, so the comparison proves little"
        # The logged metrics are global too (sums over ranks), not rank 0's half.
        for key in ("loss", "entropy", "grad_norm"):
            assert parallel["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), f"{name}: {key}"


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp", "ddp_lora"])
def test_two_process_resume_equals_an_uninterrupted_two_process_run(tiny_model_dir, tmp_path, data_parallel):
    def run(directory: Path, *extra: str, **output) -> subprocess.CompletedProcess:
        config = tiny_config(
            tiny_model_dir, directory, output={"save_every": 3, "plots": False, "report_to": [], **output}
        )
        config["train"].update({"prompts_per_step": 4, "data_parallel": data_parallel.removesuffix("_lora")})
        if data_parallel.endswith("_lora"):  # LoRA adapters under DDP, with the KL to the base (adapters off)
            config["model"]["lora"] = {"r": 4, "alpha": 8}
            config["algorithm"]["beta"] = 0.05
        config_path = directory.with_suffix(".json")
        config_path.write_text(json.dumps(config))
        return torchrun("train", str(config_path), *extra)

    straight = run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-4000:]
    interrupted = run(tmp_path / "resumed", "--interrupt-at", "3")
    assert interrupted.returncode != 0  # Ctrl-C on rank 0 stopped both ranks after step 3
    assert [path.name for path in (tmp_path / "resumed" / "checkpoints").glob("step-*")] == ["step-000003"]
    resumed = run(tmp_path / "resumed", resume=True)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    def metrics(directory: Path) -> list[dict]:
        return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]

    # Only rank 0 wrote: one row per step (and per evaluation), not two.
    assert [row["step"] for row in metrics(tmp_path / "straight") if "loss" in row] == [1, 2, 3, 4]
    assert without_times(metrics(tmp_path / "resumed")) == without_times(metrics(tmp_path / "straight"))
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_prompts_per_step_must_split_into_whole_groups(tiny_model_dir, tmp_path):
    config = tiny_config(tiny_model_dir, tmp_path / "odd", output={"plots": False, "report_to": []})
    config["train"].update({"prompts_per_step": 3, "steps": 1})
    (tmp_path / "odd.json").write_text(json.dumps(config))
    result = torchrun("train", str(tmp_path / "odd.json"))
    assert result.returncode != 0
    assert "train.prompts_per_step=3 is not divisible by the 2 processes" in result.stderr


def test_the_torchrun_helper_puts_the_worker_first_and_keeps_the_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"/tmp/site{os.pathsep}/opt/more")
    assert with_pythonpath(Path("/work/tests"))["PYTHONPATH"] == os.pathsep.join(
        ["/work/tests", "/tmp/site", "/opt/more"]
    )
    monkeypatch.delenv("PYTHONPATH")
    assert with_pythonpath(Path("/work/tests"))["PYTHONPATH"] == "/work/tests"
