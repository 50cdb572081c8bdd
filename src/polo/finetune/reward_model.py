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

As a reward function in an RL recipe it is `polo.rewards.reward_model`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from polo import core
from polo.config.finetune import RewardModelConfig
from polo.config.finetune import load_reward_model_config as load_reward_model_config  # callers load it from here
from polo.data.preferences import Ranking, ranking_from_row, write_jsonl
from polo.finetune.fit import (
    Example,
    FinetuneResult,
    FitTrainer,
    PassedRows,
    collate_rankings,
    encode,
    encode_splits,
    finetune,
    pair_indices,
    ranking_rewards,
    score_sequences,
)
from polo.generation.prompts import render_prompt
from polo.models.hub import HeldOut
from polo.rewards.reward_model import STATS_FILE
from polo.runtime.device import CPU


def encode_rankings(
    tokenizer, rankings: Sequence[Ranking], system_prompt: str | None, max_length: int
) -> list[Example]:
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

    def __init__(self, pad_id: int, device: torch.device = CPU.device):
        self.pad_id, self.device = pad_id, device  # batches are built on the model's device

    def units(self, example: Example) -> int:
        return num_pairs(example)

    def loss(self, model, examples: Sequence[Example]) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (Σ −log σ(r_w − r_l) over the pairs, summed statistics: loss, accuracy, margin, chosen and
        rejected rewards)."""
        rewards = ranking_rewards(model, collate_rankings(examples, self.pad_id, self.device))
        better, worse = pair_indices(examples, rewards.device)
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
    margins_tensor = torch.tensor(margins, dtype=torch.float64, device=CPU.device)  # host statistics of Python floats
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((value - mean) ** 2 for value in flat) / max(len(flat) - 1, 1))
    return {
        "pair_accuracy": sum(margin > 0 for margin in margins) / len(margins),
        "loss": float(core.pairwise_loss(margins_tensor, torch.zeros_like(margins_tensor)).mean()),
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
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), num_labels=1, dtype=torch.float32, **options
        )
    except (ValueError, OSError) as error:
        raise ModelLoadError(f"could not put a sequence-classification head on {path}: {error}") from error
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


class RewardModelTrainer(FitTrainer):
    """`polo rm`: the Bradley-Terry loss of a causal LM's trunk with a scalar head; its final model carries the score
    statistics that `model:PATH?normalize` uses."""

    name, method, headline = "polo rm", "reward model", ("loss", "accuracy")

    def load(self, source: str) -> tuple[torch.nn.Module, Any]:
        from polo.models.loading import load_tokenizer

        tokenizer = load_tokenizer(source)
        return new_reward_model(source, tokenizer, self.config.model.attn_implementation), tokenizer

    def examples(self, state: dict | None) -> tuple[list[Example], list[Example]]:
        self.last_scores: list[list[float]] = []
        return encode_splits(self.tokenizer, self.config.data, ranking_from_row, encode_rankings, self.rows)

    def make_objective(self) -> PairwiseObjective:
        return PairwiseObjective(self.tokenizer.pad_token_id, self.compute.device)

    def scores(self, examples: Sequence[Example]) -> list[list[float]]:
        """Return the reward model's score of every response of `examples`, grouped per ranking."""
        micro = self.config.train.micro_batch_size
        return score_sequences(
            ranking_rewards, self.trainee.model, examples, self.tokenizer.pad_token_id, micro, self.compute
        )

    def held_out_metrics(self) -> dict[str, float]:
        self.last_scores = self.scores(self.eval_examples)
        return ranking_metrics(self.last_scores)

    def held_out(self, before: dict | None, after: dict | None) -> HeldOut:
        description = (
            f"Pair accuracy and mean margin r(better) − r(worse) on {len(self.eval_examples)} held-out rankings"
        )
        return HeldOut(description, ("pair_accuracy", "margin"), before, after)

    def finish_model(self, model_dir: Path) -> None:
        """Write `reward_stats.json` into the final model, and the held-out scores per ranking beside it."""
        data, scores = self.config.data, self.last_scores
        if self.eval_examples:  # per ranking, for analyses such as accuracy by kind of pair
            if not scores:  # the final evaluation was the one a resumed run had already made
                scores = self.scores(self.eval_examples)
            write_jsonl(self.output_dir / "heldout_scores.jsonl", [{"scores": values} for values in scores])
        else:  # normalisation statistics from the training responses instead
            scores = self.scores(self.train_examples)
        stats = ranking_metrics(scores)
        summary = {
            "mean": stats["reward_mean"],
            "std": stats["reward_std"],
            "num_responses": sum(len(values) for values in scores),
            "source": data.eval_path or data.train_path,
        }
        (model_dir / STATS_FILE).write_text(json.dumps(summary, indent=1) + "\n")


def train_reward_model(
    config: RewardModelConfig | str | Path | dict | None = None,
    overrides: list[str] | None = None,
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    callbacks: list | None = None,
) -> FinetuneResult:
    """Train a reward model on ranked comparisons and return the result; it lands in `<output.dir>/final`.

    With `output.resume=true` a stopped run continues from its newest checkpoint, exactly;
    `callbacks` follow `polo.runtime.callbacks`. `train_dataset` / `eval_dataset` (a `datasets.Dataset` or a
    list of dicts, rows as in the jsonl files) stand in for data.train_path / data.eval_path.
    """
    rows = PassedRows(train_dataset, eval_dataset)
    return finetune(RewardModelTrainer, RewardModelConfig, config, overrides, callbacks, rows)
