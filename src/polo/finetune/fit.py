"""Fine-tuning from fixed data: what SFT, reward-model training and DPO share.

- `encode` and `collate`: a (prompt text, response) pair as token ids, the response followed by
  EOS, and a batch of them in polo's rollout layout `[left-padded prompt | right-padded response]`
  (`polo.generation.cpu_sampler`), so the response positions are always the last columns.
- `sequence_logprobs`: log π(y|x) summed over the response tokens (never the prompt's), and
  `sequence_rewards`: a sequence-classification model's scalar for each whole sequence.
- `fit`: the small loop. AdamW, warm-up then a schedule, gradient accumulation over
  micro-batches, gradient clipping, one metrics row per optimizer step (metrics.jsonl, the
  `output.report_to` trackers, progress bar through `polo.runtime.metrics.MetricsLogger`), held-out
  evaluation before, every `train.eval_every` steps and after.
- `publish_finetuned`: the model card in `<output.dir>/final` and the `output.push_to_hub` upload.

The recipe sections the three commands share (`data`, `train`, `output`) are in
`polo.config.finetune`.

An *objective* tells `fit` what to learn: `units(example)` is how many things an example's loss
is averaged over (response tokens for SFT, pairs for a ranking), and `loss(model, examples)`
returns the loss *summed* over those units plus summed statistics. `fit` divides both by the
units of the whole optimizer batch, so accumulating micro-batches gives exactly the gradient of
the full batch, and every logged statistic is a mean per unit.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from polo import core
from polo.config import config_to_dict
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
from polo.runtime.checkpoint import claim_output_dir, mark_float32, staged_directory
from polo.runtime.device import CPU, Compute, finetune_compute, torch_threads
from polo.runtime.interrupt import RunStopped, StopRequest
from polo.runtime.metrics import MetricsLogger, read_metrics
from polo.runtime.optimizer import build_schedule
from polo.runtime.parallel import is_main_process
from polo.runtime.run_lock import owned_run_dir
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
    """What `fit` optimises (see the module docstring)."""

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


def fit(
    trainee: Trainee,
    train_examples: Sequence[Example],
    objective: Objective,
    config: Any,
    *,
    evaluate: Callable[[], dict[str, float]] | None = None,
    name: str = "polo",
    headline: tuple[str, ...] = ("loss",),
) -> tuple[list[dict], dict | None, dict | None]:
    """Train `trainee.model` in place on `train_examples`; return (metrics rows, held-out metrics before, after).

    `config` is a recipe config with `train` (`polo.config.finetune.FinetuneTrainConfig`) and
    `output` (`FinetuneOutputConfig`) sections. Each optimizer step takes `train.batch_size` examples of a
    per-epoch shuffle and backpropagates `objective.loss / units(batch)` micro-batch by
    micro-batch. `evaluate()` returns held-out metrics (logged with an `eval/` prefix). The
    `headline` metrics go to the progress bar.
    """
    train, output = config.train, config.output
    output_dir = Path(output.dir)
    if not train_examples:
        raise ValueError("there are no training examples")
    steps_per_epoch = math.ceil(len(train_examples) / train.batch_size)
    total_steps = (
        steps_per_epoch * train.epochs
        if train.max_steps is None
        else min(train.max_steps, steps_per_epoch * train.epochs)
    )
    model, compute = trainee.model, trainee.compute
    optimizer = trainer_optimizer(
        [parameter for parameter in model.parameters() if parameter.requires_grad], train, trainee.masters
    )
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]  # the masters'
    scheduler = build_schedule(optimizer, train, total_steps)
    if is_main_process():
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run must not mix with an old run's rows
    logger = MetricsLogger(output_dir, total_steps, 0, output.progress, trackers=Trackers.of(config))
    logger.write(f"{name}: {len(train_examples)} examples, {total_steps} steps of {train.batch_size} | {compute}")

    eval_before = _held_out(evaluate, logger, 0)
    model.train()
    with StopRequest(logger.write, FIT_STOP_PLAN) as stop:
        for step, batch in _optimizer_batches(train_examples, train.batch_size, total_steps, train.seed):
            if (
                stop.requested
            ):  # one process, no ranks to agree with; a fine-tuning run keeps no checkpoints to resume from
                logger.close()
                raise RunStopped(stop.signum, step - 1, None, resumable=False)
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            sums, units = _backpropagate(trainee, batch, objective, train.micro_batch_size, logger, name, step)
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, train.max_grad_norm)
            optimizer.step()
            scheduler.step()
            row = _step_row(step, steps_per_epoch, batch, units, sums, grad_norm, scheduler.get_last_lr()[0], started)
            logger.log(row)
            logger.advance(step, {key: row[key] for key in headline if key in row})
            if train.eval_every and step % train.eval_every == 0 and step != total_steps:
                _held_out(evaluate, logger, step)
    eval_after = _held_out(evaluate, logger, total_steps)
    logger.close()
    return read_metrics(output_dir / "metrics.jsonl"), eval_before, eval_after


def _held_out(evaluate: Callable[[], dict[str, float]] | None, logger: MetricsLogger, step: int) -> dict | None:
    """Return the held-out metrics at `step` after logging them (None without an `evaluate`)."""
    if evaluate is None:
        return None
    result = evaluate()
    logger.log({"step": step, **{f"eval/{key}": value for key, value in result.items()}})
    logger.write(f"step {step}: held-out " + ", ".join(f"{key} {value:.4g}" for key, value in result.items()))
    return result


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
    logger: MetricsLogger,
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
            logger.close()
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


FIT_STOP_PLAN = "stopping after this step (polo sft, rm and dpo keep no checkpoint: the run starts again)"


@contextmanager
def finetune_run(config: Any) -> Iterator[None]:
    """Yield while holding `output.dir` (`polo.runtime.run_lock`), stop signals turned into requests
    (`polo.runtime.interrupt`).

    Entered before anything looks at the directory; a signal that arrives before the first
    step stops the run there.
    """
    with owned_run_dir(config.output.dir), StopRequest(plan=FIT_STOP_PLAN), torch_threads(config.train.threads):
        yield


def prepare_run(config: Any, config_dict: dict) -> Compute:
    """Set threads and seeds, write `<output.dir>/config.yaml`; return the Compute of train.device and train.precision.

    The precision is decided as `polo train` decides it (`polo.runtime.device.finetune_compute`).

    Whether `output.push_to_hub` can be pushed to is asked here, before any model loads.
    """
    import yaml

    from polo.runtime.seeding import seed_everything

    compute = finetune_compute(config.train.precision, config.train.device)  # first: a missing device costs nothing
    if config.output.push_to_hub:
        check_push(config.output.push_to_hub)  # before the model loads: a model that could not be pushed never trains

    seed_everything(config.train.seed)
    output_dir = Path(config.output.dir)
    claim_output_dir(output_dir, config.output.overwrite)  # before the model loads: a refusal costs nothing
    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config_dict, sort_keys=False))
    return compute


def encode_splits(tokenizer, data: Any, read: Callable, to_examples: Callable) -> tuple[list, list]:
    """Return (training examples, held-out examples) of a `data` section: `to_examples(tokenizer, read(path, n), ...)`.

    `read` reads `data.train_path` (and `data.eval_path` when set) cut to `data.num_train`/`num_eval`
    rows; `to_examples` turns them into examples with `data.system_prompt` and `data.max_length`.
    """

    def split(path: str, count: int | None) -> list:
        return to_examples(tokenizer, read(path, count), data.system_prompt, data.max_length)

    return split(data.train_path, data.num_train), split(data.eval_path, data.num_eval) if data.eval_path else []


def write_summary(output_dir: Path, **fields: Any) -> None:
    """Write `<output_dir>/summary.json` (the held-out figures before and after, the run time)."""
    if is_main_process():
        (output_dir / "summary.json").write_text(json.dumps(fields, indent=1, default=str) + "\n")


def finish_run(
    config: Any, model_dir: Path, rows: list[dict], method: str, held_out: HeldOut, started: float
) -> FinetuneResult:
    """Write the model card (and push it), then `summary.json`; return the run's `FinetuneResult`.

    `method` is sft, dpo or reward model; `held_out` holds the held-out figures before and after.
    """
    steps = len([row for row in rows if "loss" in row])
    publish_finetuned(config, model_dir, steps, method, held_out)
    seconds = time.perf_counter() - started
    before, after = held_out.before, held_out.after
    output_dir = Path(config.output.dir)
    write_summary(output_dir, model_dir=model_dir, eval_before=before, eval_after=after, seconds=seconds)
    return FinetuneResult(output_dir, model_dir, steps, before, after, rows, seconds)


def publish_finetuned(config: Any, model_dir: Path, steps: int, method: str, held_out: HeldOut) -> None:
    """Write the model card into `model_dir` and push it to `output.push_to_hub` when set (the main process only).

    `method` is sft, dpo or reward model (a reward model's card loads it as a sequence classifier).
    """
    if not is_main_process():
        return
    import yaml

    command = {"sft": "sft", "dpo": "dpo", "reward model": "rm"}[method]
    card = ModelCard(
        location=config.output.push_to_hub or str(model_dir),
        base_model=config.model.name,
        method=method,
        trained_on=Path(config.data.train_path).name,
        steps=steps,
        recipe=yaml.safe_dump(config_to_dict(config), sort_keys=False),
        command=command,
        held_out=held_out,
        no_eval_note="the recipe sets no data.eval_path",
        reward_model=method == "reward model",
        tags=(method.replace(" ", "-"),),
    )
    publish(model_dir, card, config.output.push_to_hub, config.output.hub_private)
