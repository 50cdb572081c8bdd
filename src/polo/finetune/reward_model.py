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
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from polo import core
from polo.config import config_to_dict
from polo.config.finetune import RewardModelConfig, load_reward_model_config
from polo.data.preferences import Ranking, read_rankings, write_jsonl
from polo.finetune.fit import (
    Example,
    FinetuneResult,
    collate_rankings,
    encode,
    encode_splits,
    finetune_run,
    finish_run,
    fit,
    pair_indices,
    prepare_model,
    prepare_run,
    ranking_rewards,
    save_model,
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


def train_reward_model(
    config: RewardModelConfig | str | Path | dict | None = None, overrides: list[str] | None = None
) -> FinetuneResult:
    """Train a reward model on ranked comparisons and return the result; it lands in `<output.dir>/final`."""
    from polo.models.loading import load_tokenizer

    config = load_reward_model_config(config, overrides)
    with finetune_run(config):
        started = time.perf_counter()
        compute = prepare_run(config, config_to_dict(config))
        tokenizer = load_tokenizer(config.model.name)
        model = new_reward_model(config.model.name, tokenizer, config.model.attn_implementation)
        trainee = prepare_model(model, compute, config.train.gradient_checkpointing)
        model = trainee.model
        data = config.data
        train_examples, eval_examples = encode_splits(tokenizer, data, read_rankings, encode_rankings)
        pad_id = tokenizer.pad_token_id
        micro = config.train.micro_batch_size
        last_scores: list[list[float]] = []

        def evaluate() -> dict[str, float]:
            last_scores[:] = score_sequences(ranking_rewards, model, eval_examples, pad_id, micro, compute)
            return ranking_metrics(last_scores)

        rows, before, after = fit(
            trainee,
            train_examples,
            PairwiseObjective(pad_id, compute.device),
            config,
            evaluate=evaluate if eval_examples else None,
            name="polo rm",
            headline=("loss", "accuracy"),
        )
        output_dir = Path(config.output.dir)
        if eval_examples:  # per ranking, for analyses such as accuracy by kind of pair
            write_jsonl(output_dir / "heldout_scores.jsonl", [{"scores": values} for values in last_scores])
        else:  # normalisation statistics from the training responses instead
            last_scores = score_sequences(ranking_rewards, model, train_examples, pad_id, micro, compute)
        stats = ranking_metrics(last_scores)
        model_dir = save_model(trainee, tokenizer, output_dir / "final")
        (model_dir / STATS_FILE).write_text(
            json.dumps(
                {
                    "mean": stats["reward_mean"],
                    "std": stats["reward_std"],
                    "num_responses": sum(len(values) for values in last_scores),
                    "source": data.eval_path or data.train_path,
                },
                indent=1,
            )
            + "\n"
        )
        description = f"Pair accuracy and mean margin r(better) − r(worse) on {len(eval_examples)} held-out rankings"
        held_out = HeldOut(description, ("pair_accuracy", "margin"), before, after)
        return finish_run(config, model_dir, rows, "reward model", held_out, started)
