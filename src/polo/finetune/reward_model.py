"""Reward models (`polo rm`): a causal LM's trunk with a scalar head, learned from ranked responses.

The model is `AutoModelForSequenceClassification` with `num_labels=1` on top of a causal-LM
directory (the SFT model, as in InstructGPT): r(x, y) is the head's output at the last token of
`[prompt | response + EOS]` that is not the pad token. Trained with the Bradley-Terry loss
`polo.core.pairwise_loss`, −log σ(r(x, y_w) − r(x, y_l)), averaged over every (better, worse)
pair of every ranking in the batch; each response is scored once however many pairs it is in.

At the end the model is saved with `save_pretrained` to `<output.dir>/final` (it reloads with
`AutoModelForSequenceClassification.from_pretrained`), next to `reward_stats.json`: the mean and
standard deviation of its scores over the held-out responses (the training responses when there
is no held-out file), which `model:PATH?normalize` uses. The held-out scores themselves, one row
per ranking in file order, go to `<output.dir>/heldout_scores.jsonl`.

As a reward function in an RL recipe, ``rewards: {"model:PATH": 1.0}`` scores each completion with
the reward model at PATH (`RewardModelReward`), batched, on exactly the text the policy saw: the
row's ``prompt_text`` followed by the completion and EOS, tokenized the way training did.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from polo import core
from polo.config import ModelConfig, config_to_dict
from polo.finetune.fit import (
    DataConfig,
    Example,
    FinetuneOutputConfig,
    FinetuneResult,
    FinetuneTrainConfig,
    collate,
    collate_rankings,
    encode,
    fit,
    load_finetune_config,
    pair_indices,
    prepare_run,
    ranking_rewards,
    save_model,
    score_sequences,
    sequence_rewards,
    write_summary,
)
from polo.models.loading import enable_activation_checkpointing
from polo.data.preferences import Ranking, read_rankings, render_prompt, write_jsonl

STATS_FILE = "reward_stats.json"
REWARD_PREFIX = "model:"
LOG_NAME = "rm"


@dataclass
class RewardModelConfig:
    """A reward-model run: `polo rm RECIPE.yaml`."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the causal LM whose trunk carries the head
    data: DataConfig = field(default_factory=DataConfig)
    train: FinetuneTrainConfig = field(default_factory=FinetuneTrainConfig)
    output: FinetuneOutputConfig = field(default_factory=lambda: FinetuneOutputConfig(dir="runs/rm"))


def load_reward_model_config(recipe=None, overrides: list[str] | None = None) -> RewardModelConfig:
    """Return a validated `RewardModelConfig` from a recipe (path, mapping or config) and dotted overrides."""
    return load_finetune_config(RewardModelConfig, recipe, overrides)


def encode_rankings(tokenizer, rankings: Sequence[Ranking], system_prompt: str | None, max_length: int) -> list[Example]:
    """Return one `Example` per ranking: its K responses after the chat-templated prompt, best first."""
    prompts, responses, sizes = [], [], []
    for ranking in rankings:
        prompt = render_prompt(tokenizer, ranking.messages, system_prompt)
        prompts.extend([prompt] * len(ranking.responses))
        responses.extend(ranking.responses)
        sizes.append(len(ranking.responses))
    encoded = encode(tokenizer, prompts, responses, max_length)
    examples, start = [], 0
    for size in sizes:
        examples.append(Example(tuple(encoded[start : start + size])))
        start += size
    return examples


def num_pairs(example: Example) -> int:
    """Return how many (better, worse) pairs a ranking of K responses stands for: K(K−1)/2."""
    size = len(example.sequences)
    return size * (size - 1) // 2


class PairwiseObjective:
    """The reward model's Bradley-Terry loss; the unit is a (better, worse) pair."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def units(self, example: Example) -> int:
        return num_pairs(example)

    def loss(self, model, examples: Sequence[Example]) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (Σ −log σ(r_w − r_l) over the pairs, summed statistics: loss, accuracy, margin, chosen and rejected rewards)."""
        rewards = ranking_rewards(model, collate_rankings(examples, self.pad_id))
        better, worse = pair_indices(examples)
        losses = core.pairwise_loss(rewards[better], rewards[worse])
        margins = (rewards[better] - rewards[worse]).detach()
        stats = {
            "loss": float(losses.detach().sum()),
            "accuracy": float((margins > 0).sum()),
            "margin": float(margins.sum()),
            "reward/chosen": float(rewards[better].detach().sum()),
            "reward/rejected": float(rewards[worse].detach().sum()),
        }
        return losses.sum(), stats


def ranking_metrics(scores: Sequence[Sequence[float]]) -> dict[str, float]:
    """Return pair accuracy, loss and margin over every (better, worse) pair, plus the score mean and std.

    `scores[i]` are the rewards of ranking i's responses, best first. A tie counts as wrong.
    """
    from polo.data.preferences import ranking_pairs

    margins = [values[better] - values[worse] for values in scores for better, worse in ranking_pairs(len(values))]
    flat = [value for values in scores for value in values]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((value - mean) ** 2 for value in flat) / max(len(flat) - 1, 1))
    return {
        "pair_accuracy": sum(margin > 0 for margin in margins) / len(margins),
        "loss": float(core.pairwise_loss(torch.tensor(margins, dtype=torch.float64), torch.zeros(len(margins), dtype=torch.float64)).mean()),
        "margin": sum(margins) / len(margins),
        "reward_mean": mean,
        "reward_std": std,
    }


def new_reward_model(name_or_path: str, tokenizer, attn_implementation: str | None = None):
    """Return a sequence-classification model (one output) to train as a reward model.

    From a causal LM (the usual start: the SFT model) the trunk is the LM's and the head is new
    (randomly initialised). From a reward model (a `polo rm` output) the trunk and the head are
    both kept, so training continues: iterated RLHF, or a reward model taught one kind of mistake
    and then more. `config.pad_token_id` is set to the tokenizer's pad token so the head reads
    the last real token of padded batches.
    """
    from transformers import AutoModelForSequenceClassification

    from polo.models.loading import CAUSAL_LM_ARCHITECTURES, ModelLoadError, resolve_model_path

    path = resolve_model_path(name_or_path, CAUSAL_LM_ARCHITECTURES + ("ForSequenceClassification",))
    saved = json.loads((path / "config.json").read_text())
    outputs = len(saved.get("id2label") or {"0": None})
    if any(arch.endswith("ForSequenceClassification") for arch in saved.get("architectures") or []) and outputs != 1:
        raise ModelLoadError(f"{path} is a sequence classifier with {outputs} outputs; a reward model has one")
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32, **options)
    except (ValueError, OSError) as error:
        raise ModelLoadError(f"could not put a sequence-classification head on {path}: {error}") from error
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def train_reward_model(config: RewardModelConfig | str | Path | dict | None = None, overrides: list[str] | None = None) -> FinetuneResult:
    """Train a reward model on ranked comparisons and return the result; it lands in `<output.dir>/final`."""
    from polo.models.loading import load_tokenizer

    config = load_reward_model_config(config, overrides)
    started = time.perf_counter()
    precision = prepare_run(config, config_to_dict(config))
    tokenizer = load_tokenizer(config.model.name)
    model = new_reward_model(config.model.name, tokenizer, config.model.attn_implementation)
    if config.train.gradient_checkpointing:
        enable_activation_checkpointing(model)
    data = config.data
    train_examples = encode_rankings(tokenizer, read_rankings(data.train_path, data.num_train), data.system_prompt, data.max_length)
    eval_examples = (
        encode_rankings(tokenizer, read_rankings(data.eval_path, data.num_eval), data.system_prompt, data.max_length) if data.eval_path else []
    )
    pad_id = tokenizer.pad_token_id
    micro = config.train.micro_batch_size
    last_scores: list[list[float]] = []

    def evaluate() -> dict[str, float]:
        last_scores[:] = score_sequences(ranking_rewards, model, eval_examples, pad_id, micro, precision)
        return ranking_metrics(last_scores)

    rows, before, after = fit(
        model, train_examples, PairwiseObjective(pad_id), config, precision=precision,
        evaluate=evaluate if eval_examples else None, name="polo rm", headline=("loss", "accuracy"),
    )
    output_dir = Path(config.output.dir)
    if eval_examples:  # per ranking, for analyses such as accuracy by kind of pair
        write_jsonl(output_dir / "heldout_scores.jsonl", [{"scores": values} for values in last_scores])
    else:  # normalisation statistics from the training responses instead
        last_scores = score_sequences(ranking_rewards, model, train_examples, pad_id, micro, precision)
    stats = ranking_metrics(last_scores)
    model_dir = save_model(model, tokenizer, output_dir / "final")
    (model_dir / STATS_FILE).write_text(json.dumps({
        "mean": stats["reward_mean"], "std": stats["reward_std"], "num_responses": sum(len(values) for values in last_scores),
        "source": data.eval_path or data.train_path,
    }, indent=1) + "\n")
    seconds = time.perf_counter() - started
    write_summary(output_dir, model_dir=model_dir, eval_before=before, eval_after=after, seconds=seconds)
    return FinetuneResult(output_dir, model_dir, len([row for row in rows if "loss" in row]), before, after, rows, seconds)


# ---------------------------------------------------------------- a reward model as a reward function


def load_reward_model(path: str | Path):
    """Return `(model, tokenizer)` for a saved reward model: a one-output sequence classifier, frozen, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from polo.models.loading import ModelLoadError

    path = Path(path).expanduser()
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"reward model {str(path)!r} has no config.json: train one with `polo rm RECIPE.yaml` (it saves to <output.dir>/final)")
    config = json.loads(config_path.read_text())
    architectures = config.get("architectures") or []
    if not any(arch.endswith("ForSequenceClassification") for arch in architectures):
        raise ModelLoadError(
            f"{path} holds {architectures}, not a reward model (expected an architecture ending in ForSequenceClassification, "
            "as `polo rm` saves)"
        )
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ModelLoadError(f"reward model {path} has {model.config.num_labels} outputs; a reward model has exactly 1")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
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
    path, _, query = spec[len(REWARD_PREFIX):].partition("?")
    options = {"normalize": False}
    for flag in filter(None, query.split("&")):
        if flag not in options:
            raise ValueError(f"reward {spec!r}: unknown option {flag!r}; options: {sorted(options)} (e.g. 'model:PATH?normalize')")
        options[flag] = True
    return Path(path).expanduser(), options


class RewardModelReward:
    """A batched reward function: a saved reward model's score of `prompt_text + completion + EOS`.

    Called as `reward(completions, rows) -> list[float]` (`batched = True`, see
    `polo.rewards.RewardSet`). The prompt is `row["prompt_text"]`, the exact text the RL trainer
    gave the policy; rows without one get their `prompt` (a user message) or `question` (filled into
    `instruction`, the task's) rendered through the reward model's chat template. Sequences are
    scored `batch_size` at a time without gradients, under bf16 autocast where the CPU has it.
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
        precision: str = "auto",
    ):
        from polo.runtime.device import resolve_precision

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = Path(path)
        self.model, self.tokenizer = load_reward_model(self.path)
        self.pad_id = int(self.model.config.pad_token_id)
        self.batch_size = batch_size
        self.instruction = instruction
        self.system_prompt = system_prompt
        self.max_length = max_length
        self.precision = resolve_precision(precision)
        self.mean, self.std = 0.0, 1.0
        if normalize:
            self.mean, self.std = self._statistics()
        self.__name__ = LOG_NAME

    def _statistics(self) -> tuple[float, float]:
        stats_path = self.path / STATS_FILE
        if not stats_path.exists():
            raise FileNotFoundError(f"{stats_path} not found: '?normalize' needs the statistics `polo rm` saves next to the model")
        stats = json.loads(stats_path.read_text())
        if not stats.get("std", 0) > 0:
            raise ValueError(f"{stats_path}: std must be > 0 to normalise, got {stats.get('std')!r}")
        return float(stats["mean"]), float(stats["std"])

    def prompt_text(self, row: dict) -> str:
        """Return the prompt the policy saw for `row` (see the class docstring)."""
        if "prompt_text" in row:
            return row["prompt_text"]
        from polo.data.base import PLAIN_INSTRUCTION, fill_instruction

        if "prompt" in row:
            user = row["prompt"]
        elif "question" in row:
            user = fill_instruction(self.instruction or PLAIN_INSTRUCTION, row["question"])
        else:
            raise KeyError(f"the row has no 'prompt_text', 'prompt' or 'question' to score the completion against; fields: {sorted(row)}")
        return render_prompt(self.tokenizer, [{"role": "user", "content": user}], self.system_prompt)

    @torch.no_grad()
    def __call__(self, completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
        """Return the (normalised) reward of each completion, in order."""
        from polo.runtime.device import autocast_context

        encoded = encode(self.tokenizer, [self.prompt_text(row) for row in rows], list(completions), self.max_length)
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            with autocast_context(self.precision):
                rewards = sequence_rewards(self.model, collate(encoded[start : start + self.batch_size], self.pad_id))
            scores.extend(((rewards.float() - self.mean) / self.std).tolist())
        return scores


def reward_model_reward(spec: str, task: Any = None) -> RewardModelReward:
    """Return the reward function for ``"model:PATH[?normalize]"``; `task` supplies the fallback instruction."""
    path, options = parse_reward_spec(spec)
    instruction = getattr(task, "instruction", None)
    return RewardModelReward(path, normalize=options["normalize"], instruction=instruction)
