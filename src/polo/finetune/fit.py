"""Fine-tuning from fixed data: what SFT, reward-model training and DPO share.

- `encode` and `collate`: a (prompt text, response) pair as token ids, the response followed by
  EOS, and a batch of them in polo's rollout layout `[left-padded prompt | right-padded response]`
  (`polo.generation.cpu_sampler`), so the response positions are always the last columns.
- `sequence_logprobs`: log π(y|x) summed over the response tokens (never the prompt's), and
  `sequence_rewards`: a sequence-classification model's scalar for each whole sequence.
- `FitTrainer`: the step. AdamW, warm-up then a schedule, gradient accumulation over
  micro-batches, gradient clipping, one metrics row per optimizer step; its checkpoints hold the
  model, optimizer, schedule, random streams and data position, so a stopped run resumes exactly.
  Everything around the step (logging, held-out evaluation before, every `train.eval_every` steps
  and after, checkpoints, stop signals, callbacks) is the run lifecycle's (`polo.runtime.lifecycle`).
- `publish_finetuned`: the model card in `<output.dir>/final` and the `output.push_to_hub` upload.

The recipe sections the three commands share (`data`, `train`, `output`) are in
`polo.config.finetune`.

An *objective* tells the trainer what to learn: `units(example)` is how many things an example's loss
is averaged over (response tokens for SFT, pairs for a ranking), and `loss(model, examples)`
returns the loss *summed* over those units plus summed statistics. The step divides both by the
units of the whole optimizer batch, so accumulating micro-batches gives exactly the gradient of
the full batch, and every logged statistic is a mean per unit.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from polo import core
from polo.config import config_to_dict
from polo.config.finetune import FINETUNE_RESUME_KEYS, load_finetune_config
from polo.data.hf import check_same_rows, numbered_rows, rows_sha256
from polo.data.preferences import read_rows, rows_of
from polo.kernels import (
    LogprobSettings,
    supports_fused_logprobs,
    token_logprobs,
    use_fast_attention,
    use_lean_layers,
    use_onednn_linears,
)
from polo.models.family import cache_keyword
from polo.models.hub import HeldOut, ModelCard, check_push, publish
from polo.models.loading import recompute_scope, setup_activation_checkpointing
from polo.models.precision import MasterWeights, master_weights, trainer_optimizer
from polo.models.scoring import completion_logprobs, position_ids_from_mask
from polo.models.sequences import Encoded, TokenBatch, collate, encode, sequence_rewards  # noqa: F401  (the fit loop's batch types)
from polo.runtime.callbacks import run_callbacks
from polo.runtime.checkpoint import (
    Checkpointer,
    claim_output_dir,
    load_trainer_state,
    mark_float32,
    staged_directory,
)
from polo.runtime.device import CPU, Compute, finetune_compute, torch_threads
from polo.runtime.lifecycle import Cadence, Ending, Evaluation, StepReport, resume_point, run_lifecycle, snapshot_config
from polo.runtime.metrics import read_metrics, truncate_metrics
from polo.runtime.optimizer import build_schedule
from polo.runtime.parallel import is_main_process
from polo.runtime.resume import RECIPE_FILE, started_recipe
from polo.runtime.seeding import restore_rng, seed_everything
from polo.runtime.trackers import Trackers

# ---------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Example:
    """What one loss term is computed from: one sequence (SFT) or a ranking's K sequences, best first."""

    sequences: tuple[Encoded, ...]
    reference_logps: tuple[float, ...] | None = None  # DPO: log π_ref(y|x) of each sequence


def response_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    """Return log π(y_t | x, y_<t) for every response position, (batch, response_len); padding positions are not
    meaningful."""
    logprobs, _ = completion_logprobs(
        model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
    )
    return logprobs.float()


def sequence_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    """Return log π(y | x) = Σ_t log π(y_t | x, y_<t) over each response's tokens only, (batch,)."""
    return core.masked_sum(response_logprobs(model, batch), batch.response_mask, dim=1)


@dataclass
class RankingBatch:
    """Rankings with each prompt stored once: the K responses of a ranking share its prompt's forward pass.

    A ranking's prompt is most of its tokens (the arithmetic prompts are 54 tokens, the answers 11
    to 45), so running it once instead of K times halves the work of reward-model and DPO steps.
    """

    prompt_ids: torch.Tensor  # (rankings, prompt_len), left-padded
    prompt_mask: torch.Tensor  # (rankings, prompt_len)
    response_ids: torch.Tensor  # (sequences, response_len), right-padded, rankings one after another
    response_mask: torch.Tensor  # (sequences, response_len)
    owner: torch.Tensor  # (sequences,) long: the ranking (prompt row) each response belongs to

    def expanded(self) -> TokenBatch:
        """Return the same sequences in the plain layout, each response with its own copy of the prompt."""
        return TokenBatch(
            self.prompt_ids[self.owner], self.prompt_mask[self.owner], self.response_ids, self.response_mask
        )


def collate_rankings(examples: Sequence[Example], pad_id: int, device: torch.device = CPU.device) -> RankingBatch:
    """Return the examples (rankings whose sequences share one prompt) as a `RankingBatch` on `device`, padded with
    `pad_id`."""
    prompts, owner = [], []
    for index, example in enumerate(examples):
        if any(sequence.prompt_ids != example.sequences[0].prompt_ids for sequence in example.sequences):
            raise ValueError("the responses of a ranking must follow the same prompt tokens")
        prompts.append(Encoded(example.sequences[0].prompt_ids, (pad_id,)))
        owner.extend([index] * len(example.sequences))
    prompt_part = collate(prompts, pad_id, device)
    response_part = collate([sequence for example in examples for sequence in example.sequences], pad_id, device)
    return RankingBatch(
        prompt_part.prompt_ids,
        prompt_part.prompt_mask,
        response_part.response_ids,
        response_part.response_mask,
        torch.tensor(owner, dtype=torch.long, device=device),
    )


def recomputes_activations(model) -> bool:
    """Return True when `model`'s forward now records layers to recompute in backward, which then take no KV cache.

    transformers checkpoints a layer only in training mode with gradients on, and there it drops
    the cache (`use_cache=False`, the cache argument None), so the shared prompt's keys and values
    of `shared_prompt_hidden` would never reach the responses. Scoring without gradients (held-out
    evaluation, DPO's reference) keeps the cache and the shared prompt.
    """
    return (
        model.training
        and torch.is_grad_enabled()
        and any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    )


def shared_prompt_hidden(trunk, batch: RankingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the trunk's last hidden states: the prompt part (sequences, prompt_len, d) and the response part
    (sequences, response_len, d).

    The prompts run once, with a KV cache; the cache is then indexed by `owner` so every response
    attends to its own prompt's keys and values, and the responses run on top of it. Gradients
    flow back through the cache into the shared prompt pass. Position ids count real tokens only,
    so the values equal those of `[prompt | response]` run whole.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=trunk.config)  # filled by the prompt pass, under the keyword this transformers takes
    with_cache = {cache_keyword(trunk): cache}
    prompt_out = trunk(
        input_ids=batch.prompt_ids,
        attention_mask=batch.prompt_mask,
        position_ids=position_ids_from_mask(batch.prompt_mask),
        use_cache=True,
        **with_cache,
    )
    cache.batch_select_indices(batch.owner)
    attention_mask = torch.cat([batch.prompt_mask[batch.owner], batch.response_mask], dim=1)
    response_hidden = trunk(
        input_ids=batch.response_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask)[:, batch.prompt_ids.shape[1] :],
        use_cache=True,
        **with_cache,
    ).last_hidden_state
    return prompt_out.last_hidden_state[batch.owner], response_hidden


def ranking_logprobs(model, batch: RankingBatch) -> torch.Tensor:
    """Return log π(y | x) summed over each response's tokens, (sequences,), running each prompt once.

    The hidden state that predicts response token t sits one position earlier: the prompt's last
    position for t = 0, the response's own position t − 1 after that. Falls back to
    `sequence_logprobs` on the expanded batch when the lm_head cannot be applied directly (see
    `polo.kernels.supports_fused_logprobs`) or activations are recomputed.
    """
    if not supports_fused_logprobs(model) or recomputes_activations(model):
        return sequence_logprobs(model, batch.expanded())
    prompt_hidden, response_hidden = shared_prompt_hidden(model.get_decoder(), batch)
    hidden = torch.cat([prompt_hidden[:, -1:], response_hidden[:, :-1]], dim=1)
    logprobs, _ = token_logprobs(
        hidden, model.get_output_embeddings().weight, batch.response_ids, LogprobSettings(with_entropy=False)
    )
    return core.masked_sum(logprobs.float(), batch.response_mask, dim=1)


def ranking_rewards(reward_model, batch: RankingBatch) -> torch.Tensor:
    """Return the reward model's scalar for every response, (sequences,), running each prompt once.

    The same value as `sequence_rewards` on the expanded batch: the linear `score` head applied at
    the rightmost token that is not `config.pad_token_id`. Falls back to `sequence_rewards` for
    heads other than a plain `score` layer, or when activations are recomputed.
    """
    score = getattr(reward_model, "score", None)
    if not isinstance(score, torch.nn.Linear) or recomputes_activations(reward_model):
        return sequence_rewards(reward_model, batch.expanded())
    prompt_hidden, response_hidden = shared_prompt_hidden(reward_model.base_model, batch)
    hidden = torch.cat([prompt_hidden, response_hidden], dim=1)
    input_ids = batch.expanded().input_ids
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last_real = (positions * (input_ids != reward_model.config.pad_token_id)).argmax(-1)  # Hugging Face's own rule
    pooled = hidden[torch.arange(len(last_real), device=input_ids.device), last_real]
    return score(pooled).squeeze(-1).float()


def pair_indices(examples: Sequence[Example], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (better, worse) indices into the flattened sequences of `examples`, each (pairs,) on `device`.

    Every example is a ranking, best first, standing for all its K(K−1)/2 (better, worse) pairs.
    """
    from polo.data.preferences import ranking_pairs

    better, worse, offset = [], [], 0
    for example in examples:
        for first, second in ranking_pairs(len(example.sequences)):
            better.append(offset + first)
            worse.append(offset + second)
        offset += len(example.sequences)
    return torch.tensor(better, dtype=torch.long, device=device), torch.tensor(worse, dtype=torch.long, device=device)


def micro_batches(examples: Sequence[Example], max_sequences: int) -> list[list[Example]]:
    """Return consecutive groups of examples holding at most `max_sequences` sequences each (one example at least)."""
    groups: list[list[Example]] = []
    current: list[Example] = []
    count = 0
    for example in examples:
        size = len(example.sequences)
        if current and count + size > max_sequences:
            groups.append(current)
            current, count = [], 0
        current.append(example)
        count += size
    if current:
        groups.append(current)
    return groups


# ---------------------------------------------------------------- the loop


@dataclass
class Trainee:
    """The model a fine-tuning run trains, the Compute it trains on, and its fp32 masters under bf16_master."""

    model: torch.nn.Module
    compute: Compute
    masters: MasterWeights | None = None


def prepare_model(model: torch.nn.Module, compute: Compute, gradient_checkpointing: bool | str = False) -> Trainee:
    """Return `model` ready to train on `compute`, as `polo train` readies its policy (`polo.rl.setup`).

    On the run's device, on the device's fast attention (`polo.kernels.use_fast_attention`: polo's
    on the CPU, whose unpadded layout SFT batches then take), cast to bf16 with fp32 masters under
    bf16_master (`polo.models.precision`), recomputing activations in backward when asked.
    """
    model = model.to(compute.device)
    use_fast_attention(model, compute)
    use_lean_layers(model)
    use_onednn_linears(model, compute)
    masters = master_weights(model, compute)
    setup_activation_checkpointing(model, gradient_checkpointing, compute.available_memory())
    return Trainee(model, compute, masters)


class Objective(Protocol):
    """What a `FitTrainer` optimises (see the module docstring)."""

    def units(self, example: Example) -> int: ...

    def loss(self, model, examples: Sequence[Example]) -> tuple[torch.Tensor, dict[str, float]]: ...


@torch.no_grad()
def evaluate_objective(
    model, examples: Sequence[Example], objective: Objective, micro_batch_size: int, compute: Compute
) -> dict[str, float]:
    """Return the objective's statistics on `examples` without gradients, each a mean per unit."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    for group in micro_batches(examples, micro_batch_size):
        with compute.autocast():
            _, stats = objective.loss(model, group)
        for name, value in stats.items():
            sums[name] = sums.get(name, 0.0) + value
    model.train(was_training)
    units = max(sum(objective.units(example) for example in examples), 1)
    return {name: value / units for name, value in sums.items()}


@torch.no_grad()
def score_sequences(
    score: Callable[[Any, RankingBatch], torch.Tensor],
    model,
    examples: Sequence[Example],
    pad_id: int,
    micro_batch_size: int,
    compute: Compute,
) -> list[list[float]]:
    """Return `score(model, ranking batch)` (`ranking_rewards`, `ranking_logprobs`) for every sequence, grouped per
    example, no gradients."""
    was_training = model.training
    model.eval()
    scored: list[list[float]] = []
    for group in micro_batches(examples, micro_batch_size):
        with compute.autocast():
            values = score(model, collate_rankings(group, pad_id, compute.device)).float().tolist()
        for example in group:
            scored.append(values[: len(example.sequences)])
            values = values[len(example.sequences) :]
    model.train(was_training)
    return scored


@dataclass
class FinetuneResult:
    """What a finished SFT, reward-model or DPO run returns to a notebook caller."""

    output_dir: Path
    model_dir: Path  # loads with from_pretrained
    steps: int
    eval_before: dict | None = None
    eval_after: dict | None = None
    metrics: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def save_model(trainee: Trainee, tokenizer, target: Path) -> Path:
    """Save the model (fp32 masters under bf16_master) and tokenizer to `target`, replaced once the copy is whole."""
    model, masters = trainee.model, trainee.masters
    with staged_directory(target, "the model", f"{target} is unchanged" if target.exists() else "") as staging:
        model.save_pretrained(
            str(staging), safe_serialization=True, state_dict=masters.state_dict(model) if masters else None
        )
        if masters is not None:  # transformers writes the in-memory (bf16) dtype; the saved weights are fp32
            mark_float32(staging / "config.json")
        tokenizer.save_pretrained(str(staging))
    return target


class FitTrainer:
    """A fine-tuning run as the lifecycle drives it (`polo.runtime.lifecycle.Trainer`); SFT, RM and DPO subclass it.

    Built in this order (the random streams depend on it): the Compute, seeds, the resume point,
    the model (the checkpoint's when resuming), the examples, the objective, the optimizer and
    schedule, the resumed state (optimizer, schedule, random streams, data position), config.yaml.
    A subclass says how its model loads (`load`), which examples it reads (`examples`), what it
    optimises (`make_objective`) and evaluates, and what its final model needs (`finish_model`).
    Each optimizer step takes `train.batch_size` examples of a per-epoch shuffle and backpropagates
    `objective.loss / units(batch)` micro-batch by micro-batch.
    """

    name, method, headline = "polo fit", "fit", ("loss",)

    def __init__(self, config: Any, rows: PassedRows | None = None):
        self.config, self.started, self.rows = config, time.perf_counter(), rows or PassedRows()
        train, output = config.train, config.output
        self.output_dir, self.trackers = Path(output.dir), Trackers.of(config)
        self.compute = prepare_run(config)
        recipe = config_to_dict(config)
        self.checkpointer = Checkpointer(
            self.output_dir, output.keep_checkpoints, yaml.safe_dump(recipe, sort_keys=False), self.name
        )
        point = resume_point(self.checkpointer, self.name, output, recipe, FINETUNE_RESUME_KEYS)
        resume_from, fingerprint = point.checkpoint, self.rows.fingerprint()
        if resume_from is None:
            claim_output_dir(self.output_dir, output.overwrite, output.resume)
        elif fingerprint is not None:  # rows read from a path are data.train_path's, a key resume_point compares
            check_same_rows(self.output_dir / RECIPE_FILE, fingerprint[1])
        state = load_trainer_state(resume_from) if resume_from is not None else None
        model, self.tokenizer = self.load(str(resume_from) if resume_from is not None else config.model.name)
        self.trainee = prepare_model(model, self.compute, train.gradient_checkpointing)
        self.train_examples, self.eval_examples = self.examples(state)
        if not self.train_examples:
            raise ValueError("there are no training examples")
        self.objective = self.make_objective()
        self.steps_per_epoch = math.ceil(len(self.train_examples) / train.batch_size)
        total_steps = self.steps_per_epoch * train.epochs
        total_steps = total_steps if train.max_steps is None else min(train.max_steps, total_steps)
        trainable = [parameter for parameter in self.trainee.model.parameters() if parameter.requires_grad]
        self.optimizer = trainer_optimizer(trainable, train, self.trainee.masters)
        self.parameters = [parameter for group in self.optimizer.param_groups for parameter in group["params"]]
        self.scheduler = build_schedule(self.optimizer, train, total_steps)
        self.cadence = Cadence(
            total_steps=total_steps,
            save_every=output.save_every,
            eval_before=bool(self.eval_examples),
            eval_every=train.eval_every,
            eval_after=bool(self.eval_examples),
            progress=output.progress,
        )
        self.start_step, self.eval_before = 0, None
        self.restore(state)
        self.trainee.model.train()
        batches = _optimizer_batches(self.train_examples, train.batch_size, total_steps, train.seed)
        self.batches = itertools.islice(batches, self.start_step, None)  # a resumed run's data position
        snapshot_config(self.output_dir, recipe, self.rows.note(fingerprint), point)

    # ------------------------------------------------ what each command says

    def load(self, source: str) -> tuple[torch.nn.Module, Any]:
        """Return (model, tokenizer) from `source`: model.name, or the checkpoint a run resumes from."""
        raise NotImplementedError

    def examples(self, state: dict | None) -> tuple[list[Example], list[Example]]:
        """Return (training examples, held-out examples); `state` is the resumed checkpoint's (None: fresh)."""
        raise NotImplementedError

    def make_objective(self) -> Objective:
        raise NotImplementedError

    def held_out_metrics(self) -> dict[str, float]:
        """Return the held-out metrics of the model now (the objective's statistics per unit by default)."""
        micro = self.config.train.micro_batch_size
        return evaluate_objective(self.trainee.model, self.eval_examples, self.objective, micro, self.compute)

    def held_out(self, before: dict | None, after: dict | None) -> HeldOut:
        """Return the model card's held-out section."""
        raise NotImplementedError

    def run_state(self) -> dict:
        """Return what a checkpoint keeps besides the weights, optimizer, schedule and random streams."""
        return {}

    def finish_model(self, model_dir: Path) -> None:
        """Write what the final model needs besides its weights (a reward model's statistics)."""

    # ------------------------------------------------ the lifecycle's trainer

    def restore(self, state: dict | None) -> None:
        """Continue from a checkpoint's state: optimizer, schedule, random streams, step; or start a fresh run."""
        metrics = self.output_dir / "metrics.jsonl"
        if state is None:
            if is_main_process():
                metrics.unlink(missing_ok=True)  # a fresh run must not mix with an old run's rows
            return
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        self.start_step, self.eval_before = state["step"], state.get("eval_before")
        if is_main_process():
            truncate_metrics(metrics, self.start_step)

    def banner(self) -> str:
        train = self.config.train
        return (
            f"{self.name}: {len(self.train_examples)} examples, {self.cadence.total_steps} steps of "
            f"{train.batch_size} | {self.compute}" + (f" | from step {self.start_step}" if self.start_step else "")
        )

    def finished(self, step: int) -> bool:
        return step >= self.cadence.total_steps

    def step(self, step: int) -> StepReport:
        """Take optimizer step `step` on the next batch; return its row, every statistic a mean per unit."""
        train = self.config.train
        _, batch = next(self.batches)
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums, units = _backpropagate(self.trainee, batch, self.objective, train.micro_batch_size, self.name, step)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        learning_rate = self.scheduler.get_last_lr()[0]
        row = _step_row(step, self.steps_per_epoch, batch, units, sums, grad_norm, learning_rate, started)
        return StepReport(row, summary={key: row[key] for key in self.headline if key in row})

    def judge(self, step: int, metrics: dict) -> str | None:
        return None  # no divergence guard: a non-finite loss stops the run (`_backpropagate`)

    def rollback(self, step: int, reason: str) -> Any:
        raise RuntimeError(f"{self.name} does not roll back: {reason}")

    def evaluate(self, step: int) -> Evaluation | None:
        if not self.eval_examples:
            return None
        result = self.held_out_metrics()
        line = f"step {step}: held-out " + ", ".join(f"{key} {value:.4g}" for key, value in result.items())
        return Evaluation(result, {f"eval/{key}": value for key, value in result.items()}, line)

    def save(self, step: int) -> Path | None:
        trainee = self.trainee
        extra = {"eval_before": self.eval_before, **self.run_state()}
        return self.checkpointer.save(
            step, trainee.model, self.tokenizer, self.optimizer, self.scheduler, extra, trainee.masters
        )

    def latest_checkpoint(self) -> Path | None:
        return self.checkpointer.latest()

    def finish(self, ending: Ending) -> FinetuneResult:
        """Save the final model with its model card (and upload it), write summary.json; return the result."""
        model_dir = save_model(self.trainee, self.tokenizer, self.output_dir / "final")
        self.finish_model(model_dir)
        held_out = self.held_out(self.eval_before, ending.eval_after)
        publish_finetuned(self.config, model_dir, ending.last_step, self.method, held_out)
        seconds = time.perf_counter() - self.started
        before, after = self.eval_before, ending.eval_after
        write_summary(self.output_dir, model_dir=model_dir, eval_before=before, eval_after=after, seconds=seconds)
        rows = read_metrics(self.output_dir / "metrics.jsonl")
        return FinetuneResult(self.output_dir, model_dir, ending.last_step, before, after, rows, seconds)


def finetune(
    trainer: type[FitTrainer],
    config_class: type,
    recipe: Any,
    overrides: list[str] | None = None,
    callbacks: list | None = None,
    rows: PassedRows | None = None,
) -> FinetuneResult:
    """Return the result of a fine-tuning run of `trainer` through the lifecycle (`polo.runtime.lifecycle`).

    `recipe` (a path, mapping or `config_class` object) and `overrides` make the config;
    `callbacks` come after those the recipe's `output.callbacks` names (`polo.runtime.callbacks`);
    `rows` are the training and held-out rows given from Python instead of data.train_path / eval_path.
    """
    rows = rows or PassedRows()
    config = load_finetune_config(config_class, recipe, overrides, rows.passed)
    with torch_threads(config.train.threads):  # the caller's thread count comes back after the run
        return run_lifecycle(
            lambda rollback: trainer(config, rows), config.output.dir, run_callbacks(config, callbacks)
        )


def _optimizer_batches(
    examples: Sequence[Example], batch_size: int, total_steps: int, seed: int
) -> Iterator[tuple[int, list[Example]]]:
    """Yield (step, batch) for `total_steps` optimizer steps, taking batches from a fresh shuffle every epoch."""
    rng = random.Random(seed)
    step = 0
    while step < total_steps:
        order = list(examples)
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            if step >= total_steps:
                break
            step += 1
            yield step, order[start : start + batch_size]


def _backpropagate(
    trainee: Trainee,
    batch: Sequence[Example],
    objective: Objective,
    micro_batch_size: int,
    name: str,
    step: int,
) -> tuple[dict[str, float], int]:
    """Return the objective's statistics summed over `batch` and its units (at least 1), after accumulating the
    gradient of the loss per unit micro-batch by micro-batch."""
    from polo.runtime.errors import NonFiniteLossError

    units = max(sum(objective.units(example) for example in batch), 1)
    sums: dict[str, float] = {}
    for group in micro_batches(batch, micro_batch_size):
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for example in group for s in example.sequences)
        with trainee.compute.autocast(), recompute_scope(trainee.model, tokens):
            loss_sum, stats = objective.loss(trainee.model, group)
        loss = loss_sum / units
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"{name}: loss is {loss.item()} at step {step}; try a lower train.learning_rate")
        loss.backward()
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + value
    return sums, units


def _step_row(
    step: int,
    steps_per_epoch: int,
    batch: Sequence[Example],
    units: int,
    sums: dict[str, float],
    grad_norm: torch.Tensor,
    learning_rate: float,
    started: float,
) -> dict:
    """Return the metrics row of one optimizer step, every statistic a mean per unit.

    `tokens_per_second` counts the real (unpadded) prompt and response tokens of every sequence of
    the step over its wall time, as `update_tokens_per_second` does for an RL update (`polo.rl.step`).
    """
    seconds = time.perf_counter() - started
    sequences = sum(len(example.sequences) for example in batch)
    tokens = sum(len(item.prompt_ids) + len(item.response_ids) for example in batch for item in example.sequences)
    return {
        "step": step,
        "epoch": (step - 1) // steps_per_epoch + 1,
        **{key: value / units for key, value in sums.items()},
        "grad_norm": float(grad_norm),
        "learning_rate": learning_rate,
        "time/step": seconds,
        "sequences_per_second": sequences / max(seconds, 1e-9),
        "tokens_per_second": tokens / max(seconds, 1e-9),
    }


def prepare_run(config: Any) -> Compute:
    """Set threads and seeds; return the Compute of train.device and train.precision.

    The precision is decided as `polo train` decides it (`polo.runtime.device.finetune_compute`).

    Whether `output.push_to_hub` can be pushed to is asked here, before any model loads.
    """
    compute = finetune_compute(config.train.precision, config.train.device)  # first: a missing device costs nothing
    if config.output.push_to_hub:
        check_push(config.output.push_to_hub)  # before the model loads: a model that could not be pushed never trains

    seed_everything(config.train.seed)
    return compute


@dataclass(frozen=True)
class PassedRows:
    """Training and held-out rows given from Python (each a ``datasets.Dataset`` or a list of dicts, or None: the
    split comes from data.train_path / data.eval_path)."""

    train: Any = None
    eval: Any = None

    @property
    def passed(self) -> tuple[bool, bool]:
        """Return which of the two splits were given (`polo.config.finetune.check_data_source`)."""
        return self.train is not None, self.eval is not None

    def fingerprint(self) -> tuple[str, str] | None:
        """Return (how many rows of each split were given, their sha256), or None when none were given."""
        if not any(self.passed):
            return None
        splits = [
            [row for _, row in numbered_rows(data, source)] if data is not None else None
            for data, source in ((self.train, "train_dataset"), (self.eval, "eval_dataset"))
        ]
        counts = ", ".join(f"{len(rows)} {what} rows" for rows, what in zip(splits, ("train", "eval")) if rows)
        return counts, rows_sha256(*splits)

    def note(self, fingerprint: tuple[str, str] | None) -> str:
        """Return the comment lines config.yaml starts with when rows were given ("" when none were)."""
        if fingerprint is None:
            return ""
        return (
            "# data: rows passed from Python (train_dataset, eval_dataset), not read from a path (hence null): "
            f"{fingerprint[0]}, rows sha256 {fingerprint[1]}.\n"
            "# output.resume=true continues this run only with the same rows passed again.\n"
        )


def encode_splits(
    tokenizer, data: Any, from_row: Callable, to_examples: Callable, rows: PassedRows
) -> tuple[list, list]:
    """Return (training examples, held-out examples) of a `data` section: `to_examples(tokenizer, rows, ...)`.

    Each split's rows are `from_row` of each row of `data.train_path` (`data.eval_path`), or of the
    rows passed from Python, `rows.train` (`rows.eval`), cut to `data.num_train` (`num_eval`);
    `to_examples` turns them into examples with `data.system_prompt` and `data.max_length`.
    """

    def split(path: str | None, given: Any, source: str, count: int | None) -> list:
        read = read_rows(path, from_row, count) if given is None else rows_of(given, source, from_row, count)
        return to_examples(tokenizer, read, data.system_prompt, data.max_length)

    train = split(data.train_path, rows.train, "train_dataset", data.num_train)
    held_out = data.eval_path or rows.eval is not None
    return train, split(data.eval_path, rows.eval, "eval_dataset", data.num_eval) if held_out else []


def write_summary(output_dir: Path, **fields: Any) -> None:
    """Write `<output_dir>/summary.json` (the held-out figures before and after, the run time)."""
    if is_main_process():
        (output_dir / "summary.json").write_text(json.dumps(fields, indent=1, default=str) + "\n")


def publish_finetuned(config: Any, model_dir: Path, steps: int, method: str, held_out: HeldOut) -> None:
    """Write the model card into `model_dir` and push it to `output.push_to_hub` when set (the main process only).

    `method` is sft, dpo or reward model (a reward model's card loads it as a sequence classifier).
    """
    if not is_main_process():
        return
    command = {"sft": "sft", "dpo": "dpo", "reward model": "rm"}[method]
    # What the run started from, with a line per change a resume was allowed (polo.runtime.resume).
    started, changes = started_recipe(config_to_dict(config), Path(config.output.dir))
    train_path = started["data"]["train_path"]
    card = ModelCard(
        location=config.output.push_to_hub or str(model_dir),
        base_model=started["model"]["name"],
        method=method,
        trained_on=Path(train_path).name if train_path else "rows passed from Python",
        steps=steps,
        recipe=changes + yaml.safe_dump(started, sort_keys=False),
        command=command,
        held_out=held_out,
        no_eval_note="the recipe sets no data.eval_path",
        reward_model=method == "reward model",
        tags=(method.replace(" ", "-"),),
    )
    publish(model_dir, card, config.output.push_to_hub, config.output.hub_private)
