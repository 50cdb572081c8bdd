"""Direct Preference Optimization (`polo dpo`): learn from ranked responses without a reward model.

For every (better, worse) pair (y_w, y_l) of every ranking (`polo.core.dpo_loss`):

    loss = −log σ(β [(log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))])

averaged over the pairs of the optimizer batch. log π(y|x) sums the response tokens' log-probs
(EOS included, prompt excluded). DPO only moves the log-ratio between the two answers, and it
commonly lowers the likelihood of the preferred one as well; `dpo.nll_weight` = α adds the
preferred answer's negative log-likelihood per token, as Llama 3 did (α = 0.2) and TRL's
`rpo_alpha` does:

    loss = DPO loss + α · (−log π(y_w|x) / |y_w|)

The reference π_ref is the starting model, frozen: its log-probs are computed once, before the
first update, for every training and held-out response, so no second model is kept in memory.
Logged like TRL's DPOTrainer: `rewards/chosen`, `rewards/rejected` (the implicit rewards
β·log π/π_ref), `rewards/margins`, `rewards/accuracies` (fraction of pairs with r_w > r_l),
`logps/chosen`, `logps/rejected`; plus `nll/chosen`, the preferred answers' per-token NLL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from polo import core
from polo.config import ConfigError
from polo.config.finetune import DPOConfig
from polo.config.finetune import load_dpo_config as load_dpo_config  # callers load the recipe from here
from polo.data.preferences import ranking_from_row
from polo.finetune.fit import (
    Example,
    FinetuneResult,
    FitTrainer,
    PassedRows,
    collate_rankings,
    encode_splits,
    finetune,
    pair_indices,
    ranking_logprobs,
    score_sequences,
)
from polo.finetune.reward_model import encode_rankings, num_pairs
from polo.models.hub import HeldOut
from polo.runtime.device import CPU, Compute


class DPOObjective:
    """The DPO loss (plus α times the preferred answers' per-token NLL); the unit is a (better, worse) pair.

    Examples carry their reference log-probs.
    """

    def __init__(self, pad_id: int, beta: float, nll_weight: float = 0.0, device: torch.device = CPU.device):
        self.pad_id, self.device = pad_id, device  # batches are built on the model's device
        self.beta = beta
        self.nll_weight = nll_weight

    def units(self, example: Example) -> int:
        return num_pairs(example)

    def loss(self, model, examples: Sequence[Example]) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (Σ loss over the pairs, summed statistics with TRL's names)."""
        batch = collate_rankings(examples, self.pad_id, self.device)
        logps = ranking_logprobs(model, batch)
        reference = torch.tensor(
            [value for example in examples for value in example.reference_logps], dtype=logps.dtype, device=logps.device
        )
        better, worse = pair_indices(examples, logps.device)
        losses, chosen_rewards, rejected_rewards = core.dpo_loss(
            logps[better], logps[worse], reference[better], reference[worse], self.beta
        )
        chosen_nll = -logps[better] / batch.response_mask.sum(-1)[better].clamp(min=1)  # per token
        if self.nll_weight:
            losses = losses + self.nll_weight * chosen_nll
        margins = chosen_rewards - rejected_rewards
        stats = {
            "loss": float(losses.detach().sum()),
            "rewards/chosen": float(chosen_rewards.sum()),
            "rewards/rejected": float(rejected_rewards.sum()),
            "rewards/margins": float(margins.sum()),
            "rewards/accuracies": float((margins > 0).sum()),
            "logps/chosen": float(logps[better].detach().sum()),
            "logps/rejected": float(logps[worse].detach().sum()),
            "nll/chosen": float(chosen_nll.detach().sum()),
        }
        return losses.sum(), stats


def with_reference_logps(
    model, examples: Sequence[Example], pad_id: int, micro_batch_size: int, compute: Compute
) -> list[Example]:
    """Return the examples with `reference_logps` = log π_ref(y|x) of each response under `model` (no gradient)."""
    scores = score_sequences(ranking_logprobs, model, examples, pad_id, micro_batch_size, compute)
    return [replace(example, reference_logps=tuple(values)) for example, values in zip(examples, scores)]


class DPOTrainer(FitTrainer):
    """`polo dpo`: the DPO loss against the starting model, whose log-probs are scored once, before the first
    update (and kept in every checkpoint, so a resumed run needs no second model)."""

    name, method, headline = "polo dpo", "dpo", ("loss", "rewards/accuracies", "rewards/margins")

    def load(self, source: str) -> tuple[torch.nn.Module, Any]:
        from polo.models.loading import load_policy

        return load_policy(source, attn_implementation=self.config.model.attn_implementation)

    def examples(self, state: dict | None) -> tuple[list[Example], list[Example]]:
        """Return the rankings with their reference log-probs: scored now in a fresh run (the reference is scored
        in the weights the policy trains in, so the log-ratios start at exactly 0), read from `state` in a
        resumed one."""
        train_examples, eval_examples = encode_splits(
            self.tokenizer, self.config.data, ranking_from_row, encode_rankings, self.rows
        )
        if state is not None:
            saved = state["reference_logps"]
            return with_logps(train_examples, saved["train"]), with_logps(eval_examples, saved["eval"])
        model, pad_id, micro = self.trainee.model, self.tokenizer.pad_token_id, self.config.train.micro_batch_size
        train_examples = with_reference_logps(model, train_examples, pad_id, micro, self.compute)
        if eval_examples:
            eval_examples = with_reference_logps(model, eval_examples, pad_id, micro, self.compute)
        return train_examples, eval_examples

    def make_objective(self) -> DPOObjective:
        dpo = self.config.dpo
        return DPOObjective(self.tokenizer.pad_token_id, dpo.beta, dpo.nll_weight, self.compute.device)

    def run_state(self) -> dict:
        logps = {
            name: [list(example.reference_logps) for example in examples]
            for name, examples in (("train", self.train_examples), ("eval", self.eval_examples))
        }
        return {"reference_logps": logps}

    def held_out(self, before: dict | None, after: dict | None) -> HeldOut:
        return HeldOut(
            f"Implicit-reward preference accuracy and margin on {len(self.eval_examples)} held-out rankings",
            ("rewards/accuracies", "rewards/margins"),
            before,
            after,
        )


def with_logps(examples: Sequence[Example], logps: Sequence[Sequence[float]]) -> list[Example]:
    """Return the examples with `reference_logps` set from `logps` (one list per example, as a checkpoint keeps
    them)."""
    if len(logps) != len(examples):
        raise ConfigError(
            f"the checkpoint holds reference log-probs of {len(logps)} rankings, the data has {len(examples)}: "
            "resume with the data the run started with"
        )
    return [replace(example, reference_logps=tuple(values)) for example, values in zip(examples, logps)]


def dpo(
    config: DPOConfig | str | Path | dict | None = None,
    overrides: list[str] | None = None,
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    callbacks: list | None = None,
) -> FinetuneResult:
    """Train a policy with DPO on ranked comparisons and return the result; it lands in `<output.dir>/final`.

    With `output.resume=true` a stopped run continues from its newest checkpoint, exactly;
    `callbacks` follow `polo.runtime.callbacks`. `train_dataset` / `eval_dataset` (a `datasets.Dataset` or a
    list of dicts, rows as in the jsonl files) stand in for data.train_path / data.eval_path.
    """
    rows = PassedRows(train_dataset, eval_dataset)
    return finetune(DPOTrainer, DPOConfig, config, overrides, callbacks, rows)
