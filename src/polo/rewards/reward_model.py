"""A trained reward model as a reward function: ``rewards: {"model:PATH": 1.0}`` in an RL recipe.

Each completion is scored with the reward model at PATH (`RewardModelReward`), batched, on
exactly the text the policy saw: the row's ``prompt_text`` followed by the completion and EOS,
tokenized the way `polo rm` trained it. ``model:PATH?normalize`` standardises the scores with the
statistics `polo rm` saved next to the model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from polo.generation.prompts import PLAIN_INSTRUCTION, fill_instruction, render_prompt
from polo.models.loading import ModelLoadError
from polo.models.sequences import collate, encode, sequence_rewards
from polo.runtime.device import Compute, autocast_compute

STATS_FILE = "reward_stats.json"


REWARD_PREFIX = "model:"


LOG_NAME = "rm"


def load_reward_model(path: str | Path):
    """Return `(model, tokenizer)` for a saved reward model: a one-output sequence classifier, frozen, in eval mode."""
    path = Path(path).expanduser()
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(
            f"reward model {str(path)!r} has no config.json: train one with `polo rm RECIPE.yaml` "
            "(it saves to <output.dir>/final)"
        )
    config = json.loads(config_path.read_text())
    architectures = config.get("architectures") or []
    if not any(arch.endswith("ForSequenceClassification") for arch in architectures):
        raise ModelLoadError(
            f"{path} holds {architectures}, not a reward model (expected an architecture ending in "
            "ForSequenceClassification, as `polo rm` saves)"
        )
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ModelLoadError(f"reward model {path} has {model.config.num_labels} outputs; a reward model has exactly 1")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def parse_reward_spec(spec: str) -> tuple[Path, dict[str, bool]]:
    """Return (reward model directory, options) for ``"model:PATH"`` or ``"model:PATH?normalize"``.

    The only option is ``normalize``: scores become (r − mean) / std with the statistics saved
    next to the model (`reward_stats.json`). The flag form keeps the name free of "=", so it also
    works as a command-line override: ``rewards.model:runs/rlhf_rm/final?normalize=1.0``.
    """
    if not spec.startswith(REWARD_PREFIX) or len(spec) == len(REWARD_PREFIX):
        raise ValueError(f"a reward-model reward looks like 'model:PATH' or 'model:PATH?normalize', got {spec!r}")
    path, _, query = spec[len(REWARD_PREFIX) :].partition("?")
    options = {"normalize": False}
    for flag in filter(None, query.split("&")):
        if flag not in options:
            raise ValueError(
                f"reward {spec!r}: unknown option {flag!r}; options: {sorted(options)} (e.g. 'model:PATH?normalize')"
            )
        options[flag] = True
    return Path(path).expanduser(), options


class RewardModelReward:
    """A batched reward function: a saved reward model's score of `prompt_text + completion + EOS`.

    Called as `reward(completions, rows) -> list[float]` (`batched = True`, see
    `polo.rewards.RewardSet`). The prompt is `row["prompt_text"]`, the exact text the RL trainer
    gave the policy; rows without one get their `prompt` (a user message) or `question` (filled into
    `instruction`, the task's) rendered through the reward model's chat template. Sequences are
    scored `batch_size` at a time without gradients on `compute` (default: `autocast_compute()`,
    the GPU when there is one, bf16 autocast where the device has fast bf16).
    """

    batched = True

    def __init__(
        self,
        path: str | Path,
        *,
        normalize: bool = False,
        batch_size: int = 16,
        instruction: str | None = None,
        system_prompt: str | None = None,
        max_length: int = 1024,
        compute: Compute | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = Path(path)
        self.compute = compute if compute is not None else autocast_compute()
        self.model, self.tokenizer = load_reward_model(self.path)
        self.model.to(self.compute.device)
        self.pad_id = int(self.model.config.pad_token_id)
        self.batch_size = batch_size
        self.instruction = instruction
        self.system_prompt = system_prompt
        self.max_length = max_length
        self.mean, self.std = 0.0, 1.0
        if normalize:
            self.mean, self.std = self._statistics()
        self.__name__ = LOG_NAME

    def _statistics(self) -> tuple[float, float]:
        stats_path = self.path / STATS_FILE
        if not stats_path.exists():
            raise FileNotFoundError(
                f"{stats_path} not found: '?normalize' needs the statistics `polo rm` saves next to the model"
            )
        stats = json.loads(stats_path.read_text())
        if not stats.get("std", 0) > 0:
            raise ValueError(f"{stats_path}: std must be > 0 to normalise, got {stats.get('std')!r}")
        return float(stats["mean"]), float(stats["std"])

    def prompt_text(self, row: dict) -> str:
        """Return the prompt the policy saw for `row` (see the class docstring)."""
        if "prompt_text" in row:
            return row["prompt_text"]
        if "prompt" in row:
            user = row["prompt"]
        elif "question" in row:
            user = fill_instruction(self.instruction or PLAIN_INSTRUCTION, row["question"])
        else:
            raise KeyError(
                "the row has no 'prompt_text', 'prompt' or 'question' to score the completion against; "
                f"fields: {sorted(row)}"
            )
        return render_prompt(self.tokenizer, [{"role": "user", "content": user}], self.system_prompt)

    @torch.no_grad()
    def __call__(self, completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
        """Return the (normalised) reward of each completion, in order."""
        encoded = encode(self.tokenizer, [self.prompt_text(row) for row in rows], list(completions), self.max_length)
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            with self.compute.autocast():
                rewards = sequence_rewards(
                    self.model, collate(encoded[start : start + self.batch_size], self.pad_id, self.compute.device)
                )
            scores.extend(((rewards.float() - self.mean) / self.std).tolist())
        return scores


def reward_model_reward(spec: str, task: Any = None) -> RewardModelReward:
    """Return the reward function for ``"model:PATH[?normalize]"``; `task` supplies the fallback instruction."""
    path, options = parse_reward_spec(spec)
    instruction = getattr(task, "instruction", None)
    return RewardModelReward(path, normalize=options["normalize"], instruction=instruction)
