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

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from polo import core
from polo.config import config_to_dict
from polo.config.finetune import DPOConfig, load_dpo_config
from polo.data.preferences import read_rankings
from polo.finetune.fit import (
    Example,
    FinetuneResult,
    collate_rankings,
    encode_splits,
    evaluate_objective,
    finetune_run,
    finish_run,
    fit,
    pair_indices,
    prepare_model,
    prepare_run,
    ranking_logprobs,
    save_model,
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


def dpo(config: DPOConfig | str | Path | dict | None = None, overrides: list[str] | None = None) -> FinetuneResult:
    """Train a policy with DPO on ranked comparisons and return the result; it lands in `<output.dir>/final`."""
    from polo.models.loading import load_policy

    config = load_dpo_config(config, overrides)
    with finetune_run(config):
        started = time.perf_counter()
        compute = prepare_run(config, config_to_dict(config))
        model, tokenizer = load_policy(config.model.name, attn_implementation=config.model.attn_implementation)
        # The reference is scored in the weights the policy trains in (bf16 under bf16_master), so the
        # log-ratios start at exactly 0; activations are recomputed only in training (`recomputes_activations`).
        trainee = prepare_model(model, compute, config.train.gradient_checkpointing)
        model = trainee.model
        data, micro, pad_id = config.data, config.train.micro_batch_size, tokenizer.pad_token_id
        train_examples, eval_examples = encode_splits(tokenizer, data, read_rankings, encode_rankings)
        # The reference is the starting model: score every response with it before the first update.
        train_examples = with_reference_logps(model, train_examples, pad_id, micro, compute)
        eval_examples = with_reference_logps(model, eval_examples, pad_id, micro, compute) if eval_examples else []
        objective = DPOObjective(pad_id, config.dpo.beta, config.dpo.nll_weight, compute.device)
        evaluate = (
            (lambda: evaluate_objective(model, eval_examples, objective, micro, compute)) if eval_examples else None
        )
        rows, before, after = fit(
            trainee,
            train_examples,
            objective,
            config,
            evaluate=evaluate,
            name="polo dpo",
            headline=("loss", "rewards/accuracies", "rewards/margins"),
        )
        output_dir = Path(config.output.dir)
        model_dir = save_model(trainee, tokenizer, output_dir / "final")
        held_out = HeldOut(
            f"Implicit-reward preference accuracy and margin on {len(eval_examples)} held-out rankings",
            ("rewards/accuracies", "rewards/margins"),
            before,
            after,
        )
        return finish_run(config, model_dir, rows, "dpo", held_out, started)
