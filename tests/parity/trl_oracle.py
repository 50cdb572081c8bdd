"""TRL's GRPOTrainer as an oracle for polo's update, with no model on either side.

Both sides train the same "policy", in fp64: the log-prob of completion i's token t is θ[i, t] + b[t], a table with
one row per completion plus a bias per position that every row shares, so that an optimizer step on some rows moves
the log-probs of the others too. Everything else is each library's own code.

- TRL: a real `GRPOTrainer` (its own `__init__`, on the tiny test model, which is never run). Its per-token
  log-prob function returns the policy's (the reference table for its reference model), its generation returns the
  given completions and its reward function the given rewards. Then TRL's `_generate_and_score_completions`
  computes advantages, old and reference log-probs, masks and token counts, and TRL's `compute_loss` the loss of
  each micro-batch. The loop around them is the one `Trainer.training_step` runs for GRPO
  (`loss_is_scaled_for_ga` is True, so the loss is backpropagated as returned): `gradient_accumulation_steps`
  micro-batches per optimizer step, `num_iterations` passes over the `steps_per_generation` micro-batches of one
  generation batch. TRL shuffles a generation batch before cutting it; the oracle cuts it in order, as polo does,
  so that the same rows share an optimizer step on both sides.
- polo: `polo.rl.step.score_before_update` (with scoring replaced by the tables), `compute_advantages` and
  `polo.rl.update.policy_update`, whose forward returns rows of θ.

An optimizer that records each step's gradient, plain SGD, applies the same steps on both sides, so steps after the
first see a policy that has moved, ratios away from 1 and clipping.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from polo.config import load_config
from polo.generation.rollouts import Rollouts
from polo.rl import step as step_module
from polo.rl.batching import Batch
from polo.rl.modules import UpdateModules
from polo.rl.update import Learner, policy_update
from polo.runtime.device import CPU

TRL_VERSION = "1.16.0"  # the pinned oracle

# TRL's loss_type -> polo's loss aggregation computing the same normaliser
AGGREGATION = {
    "grpo": "seq_mean_token_mean",
    "dapo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "bnpo": "micro_batch_token_mean",
    "cispo": "token_mean",
    "sapo": "seq_mean_token_mean",
    "luspo": "seq_mean_token_sum",
    "vespo": "token_mean",
}


@dataclass(frozen=True)
class Setting:
    """One setting both trainers have, in TRL's words; `polo_config` and `trl_config` translate it."""

    loss_type: str = "grpo"
    sequence_ratio: bool = False  # TRL importance_sampling_level="sequence"; polo policy_loss gspo
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    use_bias_correction_kl: bool = False  # TRL's default is True; polo's kl_importance_weighted, off by default
    delta: float | None = None  # two-sided clipping: TRL delta, polo clip_delta
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    vespo_kernel: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # k_pos, lambda_pos, k_neg, lambda_neg
    mask_truncated: bool = False
    scale_rewards: str = "group"  # group | batch | none
    reward_weights: tuple[float, ...] = ()  # several reward functions with these weights (none: one reward)
    multi_objective_aggregation: str = "sum_then_normalize"  # TRL's; normalize_then_sum: polo's gdpo estimator
    # the sampler's own log-probs differ from the training forward's: TRL's vllm_importance_sampling_mode (with
    # use_vllm forced on, its generation replaced), polo's sampler_correction; and the bounds of its weight
    sampler_correction: str | None = None
    sampler_correction_bounds: tuple[float | None, float | None] = (None, 3.0)
    off_policy_mask_threshold: float | None = None
    group_size: int = 4
    prompts: int = 4
    micro_batch_size: int = 4  # TRL per_device_train_batch_size
    num_minibatches: int = 1  # optimizer steps per pass over the batch
    epochs: int = 1  # TRL num_iterations, polo update_epochs
    max_completion_length: int = 6
    learning_rate: float = 3.0  # SGD on the log-prob table: large enough that later steps clip

    @property
    def batch_size(self) -> int:
        return self.group_size * self.prompts

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.batch_size // self.num_minibatches // self.micro_batch_size


@dataclass
class Data:
    """One generation batch: what was sampled and how each table scores it (all fp64)."""

    rewards: torch.Tensor  # (batch,) the total: Σ_k w_k r_k over the rewards that apply
    completion_ids: list[list[int]]  # unpadded; a truncated one has max_completion_length tokens and no EOS
    truncated: torch.Tensor  # (batch,) bool
    logprobs: torch.Tensor  # (batch, T) the sampling policy's table
    ref_logprobs: torch.Tensor  # (batch, T)
    entropies: torch.Tensor  # (batch, T)
    eos: int
    reward_columns: torch.Tensor | None = None  # (batch, K) each reward function's values, NaN where it returned None
    sampling_logprobs: torch.Tensor | None = None  # (batch, T) the sampler's own, near the sampling policy's table


def make_data(setting: Setting, eos: int, seed: int = 0) -> Data:
    """Return a random generation batch for `setting`: varied lengths, some completions cut at the length limit."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = setting.batch_size, setting.max_completion_length
    lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    truncated = (lengths == width) & (torch.rand(batch, generator=generator) < 0.7)
    completion_ids = []
    for length, cut in zip(lengths.tolist(), truncated.tolist()):
        tokens = torch.randint(eos + 1, eos + 60, (length,), generator=generator).tolist()
        if not cut:
            tokens[-1] = eos
        completion_ids.append(tokens)
    logprobs = -0.1 - 2.5 * torch.rand(batch, width, generator=generator, dtype=torch.float64)
    rewards, reward_columns = torch.rand(batch, generator=generator, dtype=torch.float64), None
    if setting.reward_weights:
        # rewards of different scales, each with a few None: row 0 has none that applies at all
        scales = 10.0 ** torch.arange(len(setting.reward_weights), dtype=torch.float64)
        reward_columns = torch.rand(batch, len(scales), generator=generator, dtype=torch.float64) * scales
        reward_columns[torch.rand(batch, len(scales), generator=generator) < 0.1] = torch.nan
        reward_columns[0] = torch.nan
        weights = torch.tensor(setting.reward_weights, dtype=torch.float64)
        rewards = torch.nan_to_num(reward_columns * weights, nan=0.0).sum(-1)
    data = Data(
        rewards=rewards,
        reward_columns=reward_columns,
        completion_ids=completion_ids,
        truncated=truncated,
        logprobs=logprobs,
        ref_logprobs=logprobs + 0.3 * torch.randn(batch, width, generator=generator, dtype=torch.float64),
        entropies=2.0 * torch.rand(batch, width, generator=generator, dtype=torch.float64),
        eos=eos,
    )
    # drawn last, so that the batch of a setting without them is what it always was
    data.sampling_logprobs = logprobs + 0.4 * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    return data


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of every step's gradient."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.gradients: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.gradients.append(torch.cat([p.grad.flatten() for p in self.param_groups[0]["params"]]))
        return super().step(closure)


@dataclass
class Trajectory:
    """What one side computed: the advantages, each optimizer step's gradient on θ and the losses it reported."""

    advantages: torch.Tensor  # (batch,)
    gradients: list[torch.Tensor] = field(default_factory=list)  # per optimizer step: θ's then b's, flattened
    metrics: dict = field(default_factory=dict)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Return max |actual − expected| / max |expected| (0 when both are 0)."""
    scale = expected.abs().max()
    return float((actual - expected).abs().max() / scale) if scale > 0 else float((actual - expected).abs().max())


# ---------------------------------------------------------------------------------------------------- polo's side


class TablePolicy(torch.nn.Module):
    """The policy both sides train: log π(token t of completion i) = θ[i, t] + b[t] (b starts at 0)."""

    def __init__(self, table: torch.Tensor, entropies: torch.Tensor, trainable: bool = True):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone(), requires_grad=trainable)
        self.shared = torch.nn.Parameter(torch.zeros(table.shape[1], dtype=table.dtype), requires_grad=trainable)
        self.entropies = entropies

    def logprobs(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Return the log-probs `(len(rows), width)` of completions `rows`."""
        return self.table[rows, :width] + self.shared[:width]

    def entropy(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Return the entropies `(len(rows), width)`: the given ones moved by half the log-probs, so that an entropy
        bonus has a gradient on the table too."""
        return self.entropies[rows, :width] + 0.5 * self.logprobs(rows, width)

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, **_):
        """polo's training forward: row i's prompt is the single token i."""
        rows, width = prompt_ids[:, -1], completion_ids.shape[1]
        return self.logprobs(rows, width), self.entropy(rows, width), None

    def scores(self, rollouts: Rollouts) -> torch.Tensor:
        """Return what `polo.rl.step.score_completions` returns for a model: the log-probs, without gradient."""
        with torch.no_grad():
            return self.logprobs(rollouts.prompt_ids[:, -1], rollouts.completion_ids.shape[1])


def polo_policy_loss(setting: Setting) -> str:
    """Return polo's policy loss for `setting`."""
    if setting.loss_type in ("cispo", "sapo", "vespo"):
        return setting.loss_type
    return "gspo" if setting.sequence_ratio else "ppo_clip"


def polo_loss_options(setting: Setting) -> dict:
    """Return polo's `algorithm.policy_loss_options` for `setting` (VESPO's kernel; no other loss has options)."""
    if setting.loss_type != "vespo":
        return {}
    return dict(zip(("k_pos", "lambda_pos", "k_neg", "lambda_neg"), setting.vespo_kernel))


def polo_config(setting: Setting, **algorithm):
    """Return polo's `Config` for `setting`; `algorithm` sets further `algorithm` fields."""
    return load_config(
        {
            "algorithm": {
                "name": "gspo" if setting.sequence_ratio else "grpo",
                "advantage_estimator": "gdpo"
                if setting.multi_objective_aggregation == "normalize_then_sum"
                else "grpo",
                "policy_loss": polo_policy_loss(setting),
                "policy_loss_options": polo_loss_options(setting),
                "loss_aggregation": AGGREGATION[setting.loss_type],
                "clip_eps_low": setting.epsilon_low,
                "clip_eps_high": setting.epsilon_high,
                "beta": setting.beta,
                "kl_estimator": "k3",
                "kl_importance_weighted": setting.use_bias_correction_kl,
                "clip_delta": setting.delta,
                "top_entropy_quantile": setting.top_entropy_quantile,
                "entropy_coef": setting.entropy_coef,
                "mask_truncated": setting.mask_truncated,
                "scale_rewards": {"group": True, "none": False, "batch": "batch"}[setting.scale_rewards],
                "group_size": setting.group_size,
                "sampler_correction": setting.sampler_correction,
                "sampler_correction_min": setting.sampler_correction_bounds[0],
                "sampler_correction_max": setting.sampler_correction_bounds[1],
                "off_policy_mask_threshold": setting.off_policy_mask_threshold,
                "update_epochs": setting.epochs,
                **algorithm,
            },
            "train": {
                "prompts_per_step": setting.prompts,
                "num_minibatches": setting.num_minibatches,
                "micro_batch_size": setting.micro_batch_size,
                "max_grad_norm": 1e30,  # no clipping: TRL's loss, not Trainer's clipping, is compared
                "precision": "fp32",
            },
            "sampling": {"max_new_tokens": setting.max_completion_length, "temperature": 1.0},
        }
    )


def polo_rollouts(data: Data, setting: Setting) -> Rollouts:
    """Return the batch as polo's `Rollouts`: row i's prompt is token i, completions right-padded with EOS."""
    batch, width = setting.batch_size, setting.max_completion_length
    completion_ids = torch.full((batch, width), data.eos, dtype=torch.long)
    completion_mask = torch.zeros(batch, width, dtype=torch.long)
    for row, tokens in enumerate(data.completion_ids):
        completion_ids[row, : len(tokens)] = torch.tensor(tokens)
        completion_mask[row, : len(tokens)] = 1
    sampled = setting.sampler_correction is not None
    return Rollouts(
        prompt_ids=torch.arange(batch).unsqueeze(1),
        prompt_mask=torch.ones(batch, 1, dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=data.truncated.clone(),
        texts=[""] * batch,
        group_size=setting.group_size,
        sampling_logprobs=data.sampling_logprobs.clone() if sampled else None,
    )


def polo_train(setting: Setting, data: Data, config=None) -> Trajectory:
    """Return polo's advantages and optimizer-step gradients for `setting` on `data` (`config`: instead of its own)."""
    config = config if config is not None else polo_config(setting)
    policy = TablePolicy(data.logprobs, data.entropies)
    reference = TablePolicy(data.ref_logprobs, data.entropies, trainable=False) if setting.beta > 0 else None
    rollouts = polo_rollouts(data, setting)
    run = SimpleNamespace(config=config, model=policy, reference=reference, critic=None, compute=CPU)
    with mock.patch.object(step_module, "score_completions", lambda model, rollouts, *_, **__: model.scores(rollouts)):
        scores = step_module.score_before_update(run, rollouts)
    columns, weights = None, None
    if data.reward_columns is not None:
        columns = {f"reward{k}": column.clone() for k, column in enumerate(data.reward_columns.T)}
        weights = dict(zip(columns, setting.reward_weights))
    update_batch = step_module.compute_advantages(
        Batch(rollouts, data.rewards.clone(), ["p"] * setting.prompts, columns), scores, config, weights
    )
    optimizer = RecordingSGD(policy.parameters(), setting.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(policy, optimizer, scheduler, CPU, None, UpdateModules(policy))
    metrics = policy_update(learner, update_batch, config)
    advantages = update_batch.advantages[:, 0]  # one per sequence, on every token (every row has a first token)
    return Trajectory(advantages, optimizer.gradients, metrics)


# ----------------------------------------------------------------------------------------------------- TRL's side


def trl_config(setting: Setting, output_dir: Path, **overrides):
    """Return TRL's `GRPOConfig` for `setting`; `overrides` sets further GRPOConfig fields."""
    from trl import GRPOConfig

    steps_per_generation = setting.batch_size // setting.micro_batch_size
    fields = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": setting.micro_batch_size,
        "gradient_accumulation_steps": setting.accumulation_steps,
        "steps_per_generation": steps_per_generation,
        "num_generations": setting.group_size,
        "num_iterations": setting.epochs,
        "max_completion_length": setting.max_completion_length,
        "loss_type": setting.loss_type,
        "importance_sampling_level": "sequence" if setting.sequence_ratio else "token",
        "epsilon": setting.epsilon_low,
        # TRL's CISPO reads epsilon_high as the weight's cap (ScaleRL's ε_max), polo's as 1 + clip_eps_high
        "epsilon_high": 1.0 + setting.epsilon_high if setting.loss_type == "cispo" else setting.epsilon_high,
        "delta": setting.delta,
        "top_entropy_quantile": setting.top_entropy_quantile,
        "entropy_coef": setting.entropy_coef,
        **dict(zip(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), setting.vespo_kernel)),
        "beta": setting.beta,
        "use_bias_correction_kl": setting.use_bias_correction_kl,
        "mask_truncated_completions": setting.mask_truncated,
        "scale_rewards": setting.scale_rewards,
        "multi_objective_aggregation": setting.multi_objective_aggregation,
        "reward_weights": list(setting.reward_weights) or None,
        "off_policy_mask_threshold": setting.off_policy_mask_threshold,
        "learning_rate": setting.learning_rate,
        "report_to": "none",
        "use_cpu": True,
        "activation_checkpointing": False,  # the model never runs; and its old name warns (a FutureWarning)
        "logging_steps": 1,
        **overrides,
    }
    return GRPOConfig(**fields)


def trl_trainer(model_dir: Path, args, data: Data, policy: TablePolicy, setting: Setting):
    """Return a real `GRPOTrainer` whose log-probs are `policy`'s (its reference's: `data.ref_logprobs`), whose
    generation returns `data`'s completions and whose reward is `data.rewards`."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from datasets import Dataset
    from trl import GRPOTrainer

    batch = len(data.completion_ids)

    def unused_reward(completions, **kwargs):
        raise AssertionError("the oracle's rewards are given")

    columns = data.rewards.unsqueeze(1) if data.reward_columns is None else data.reward_columns
    reward_funcs = [unused_reward] * columns.shape[1]
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * batch}),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps

    sampled = None
    if setting.sampler_correction is not None:  # as TRL's vLLM generation would: the sampler's log-probs
        sampled = [data.sampling_logprobs[row, : len(ids)].tolist() for row, ids in enumerate(data.completion_ids)]
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = setting.sampler_correction
        trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = (
            setting.sampler_correction_bounds
        )

    def generate(prompts):
        completions = [""] * len(prompts)
        return [[row] for row in range(batch)], data.completion_ids, None, completions, sampled, None, None, None

    def rewards(inputs, prompts, completions, completion_ids_list):
        return columns.clone()

    def logprobs_and_entropies(model, input_ids, attention_mask, logits_to_keep, *_, compute_entropy=False, **__):
        rows = input_ids[:, 0]  # every prompt is one token: the row's index
        entropies = policy.entropy(rows, logits_to_keep) if compute_entropy else None
        if model is trainer.ref_model and model is not None:
            return data.ref_logprobs[rows, :logits_to_keep], entropies, None
        return policy.logprobs(rows, logits_to_keep), entropies, None

    trainer._generate = generate
    trainer._calculate_rewards = rewards
    trainer._get_per_token_logps_and_entropies = logprobs_and_entropies
    return trainer


def trl_train(setting: Setting, data: Data, model_dir: Path, output_dir: Path, **overrides) -> Trajectory:
    """Return TRL's advantages and optimizer-step gradients for `setting` on `data` (`overrides`: GRPOConfig fields)."""
    from trl.trainer.utils import split_tensor_dict

    args = trl_config(setting, output_dir, **overrides)
    policy = TablePolicy(data.logprobs, data.entropies)
    trainer = trl_trainer(model_dir, args, data, policy, setting)
    generation = trainer._generate_and_score_completions([{"prompt": "p"} for _ in data.completion_ids])
    micro_batches = split_tensor_dict(generation, args.steps_per_generation)
    optimizer = RecordingSGD(policy.parameters(), setting.learning_rate)
    accumulation = args.gradient_accumulation_steps
    for _ in range(args.num_iterations):
        for first in range(0, len(micro_batches), accumulation):
            optimizer.zero_grad()
            for inputs in micro_batches[first : first + accumulation]:
                trainer.compute_loss(trainer.model, inputs).backward()
            optimizer.step()
    metrics = {key: list(values) for key, values in trainer._metrics["train"].items()}
    return Trajectory(generation["advantages"].detach().clone(), optimizer.gradients, metrics)
