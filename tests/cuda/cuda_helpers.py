"""What the CUDA tests share: a tiny run's config, a fixed batch of groups, and one RL step on a given device."""

from __future__ import annotations

import os
from dataclasses import fields, replace
from pathlib import Path

import torch

GROUP_SIZE = 4
PROMPTS = ["1+2=", "13+4=", "2+2=", "7+30="]


def run_config(model_dir: Path, output_dir: Path, device: str, precision: str = "fp32", **sections) -> dict:
    """Return a tiny GRPO run's config (a mapping) on `device`: 4 prompts x 4 completions, KL to a reference."""
    config = {
        "model": {"name": str(model_dir)},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 16, "num_eval": 0},
        "rewards": {"correct": 1.0},
        "sampling": {"max_new_tokens": 8, "temperature": 1.0},
        "algorithm": {"name": "grpo", "group_size": GROUP_SIZE, "beta": 0.1},
        "train": {
            "steps": 2,
            "prompts_per_step": len(PROMPTS),
            "micro_batch_size": 8,
            "learning_rate": 1e-3,
            "precision": precision,
            "device": device,
            "seed": 3,
            "gradient_checkpointing": False,
        },
        "eval": {"before": False, "after": False},
        "output": {"dir": str(output_dir), "save_every": 1, "progress": False, "report_to": [], "plots": False},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def fixed_batch(tokenizer):
    """Return a Batch of len(PROMPTS) groups whose completions and rewards are fixed (CPU tensors, no sampling).

    Sampling draws differ between devices, so a step compared across devices trains on this batch.
    """
    from polo.generation.rollouts import Rollouts
    from polo.rl.batching import Batch

    generator = torch.Generator(device="cpu").manual_seed(0)
    prompt_texts = [f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n" for prompt in PROMPTS]
    prompt_rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompt_texts]
    prompt_len, completion_len, rows = max(map(len, prompt_rows)), 8, len(PROMPTS) * GROUP_SIZE
    prompt_ids = torch.full((rows, prompt_len), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_len), dtype=torch.long)
    for row in range(rows):
        ids = prompt_rows[row // GROUP_SIZE]
        prompt_ids[row, prompt_len - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, prompt_len - len(ids) :] = 1
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    completion_ids = digits[torch.randint(0, 10, (rows, completion_len), generator=generator)]
    lengths = torch.randint(
        2, completion_len + 1, (rows,), generator=generator
    )  # different lengths: token counts matter
    completion_mask = (torch.arange(completion_len)[None, :] < lengths[:, None]).long()
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.tensor(tokenizer.eos_token_id))
    completion_ids[torch.arange(rows), lengths - 1] = tokenizer.eos_token_id
    rollouts = Rollouts(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=torch.zeros(rows, dtype=torch.bool),
        texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        group_size=GROUP_SIZE,
    )
    rewards = torch.linspace(-1.0, 2.0, rows)[torch.randperm(rows, generator=generator)]
    return Batch(rollouts, rewards, prompt_texts)


def on_device(batch, device: torch.device):
    """Return `batch` with every tensor of it (and of its rollouts) on `device`."""

    def moved(value):
        return value.to(device) if isinstance(value, torch.Tensor) else value

    rollouts = replace(
        batch.rollouts, **{f.name: moved(getattr(batch.rollouts, f.name)) for f in fields(batch.rollouts)}
    )
    values = {f.name: moved(getattr(batch, f.name)) for f in fields(batch) if f.name != "rollouts"}
    if isinstance(values.get("columns"), dict):
        values["columns"] = {name: moved(column) for name, column in values["columns"].items()}
    return replace(batch, rollouts=rollouts, **values)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def one_step(config: dict, batch, monkeypatch) -> tuple[dict, dict[str, torch.Tensor]]:
    """Return (metrics, saved fp32 weights on the CPU) after one RL step of a fresh run of `config` on `batch`.

    The run is built by polo.rl.setup.set_up as `polo train` builds it; only the sampling is
    replaced by the fixed batch, moved to the run's device.
    """
    from safetensors.torch import load_file

    from polo.rl import step as rl_step_module
    from polo.rl.setup import set_up

    run = set_up(config)
    share = on_device(batch, model_device(run.model))
    monkeypatch.setattr(
        rl_step_module,
        "collect_batch",
        lambda *args, **kwargs: rl_step_module.SampledStep(share, {"reward/mean": float(share.rewards.mean())}, []),
    )
    metrics = rl_step_module.rl_step(run, 1).metrics
    saved = run.save(1)
    weights = load_file(str(saved / "model.safetensors")) if saved is not None else {}
    return metrics, weights


def with_pythonpath(directory: Path, **extra: str) -> dict[str, str]:
    """Return this process's environment with `directory` first on PYTHONPATH (what was there stays), plus `extra`."""
    paths = [str(directory), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}
