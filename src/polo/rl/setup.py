"""Everything an RL run holds, built once before the first step: `set_up(config) -> Run`.

The order matters and is kept exactly (the random streams depend on it): the checkpoint lookup
and its checks (files only, `polo.runtime.resume`), task and rewards, seeding, the policy, its
reference or LoRA adapters, FSDP sharding, master weights, the optimizer, the critic, the
schedule, and finally the resumed state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from polo import core
from polo.config import Config, ConfigError, config_to_dict, load_config
from polo.config.schema import RESUME_KEYS
from polo.data import instruction_for, make_task
from polo.data.base import Task
from polo.data.environments import sampler_for
from polo.data.hf import check_same_datasets, passed_datasets_note
from polo.data.prompt_lengths import PromptRoom, fit_prompts
from polo.generation.cpu_sampler import rollout
from polo.generation.rollouts import Sampler
from polo.kernels import supports_fused_logprobs, use_fast_attention, use_lean_layers, use_onednn_linears
from polo.models.family import context_length
from polo.models.hub import check_push
from polo.models.loading import frozen_copy, load_policy, resolve_model_path, setup_activation_checkpointing
from polo.models.lora import add_adapters, freeze_base_dtype, load_adapters
from polo.models.precision import MasterWeights, master_weights, trainer_optimizer
from polo.models.routing import check_router_loss
from polo.rewards import RewardSet
from polo.rl.critic import Critic, build_critic
from polo.rl.guard import RollbackState, check_guard_settings
from polo.rl.modules import UpdateModules
from polo.rl.update import Learner, optimizer_steps_per_batch, update_modules
from polo.runtime import parallel
from polo.runtime.checkpoint import Checkpointer, claim_output_dir, load_trainer_state
from polo.runtime.device import Compute, train_compute
from polo.runtime.lifecycle import ResumePoint, resume_point, snapshot_config
from polo.runtime.metrics import truncate_metrics
from polo.runtime.optimizer import build_schedule
from polo.runtime.parallel import is_main_process
from polo.runtime.resume import finished_run
from polo.runtime.seeding import restore_rng, seed_everything


@dataclass(kw_only=True)
class Run:
    """The state of one RL run: its config, data, models, optimizer and where it writes."""

    config: Config
    compute: Compute  # device and precision, resolved once (polo.runtime.device.train_compute)
    task: Task
    reward_set: RewardSet
    instruction: str
    model: torch.nn.Module
    tokenizer: object
    reference: torch.nn.Module | None  # None when beta = 0; the policy itself under LoRA (adapters off)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    critic: Critic | None
    modules: UpdateModules  # what the update runs through (DDP-wrapped under torchrun)
    masters: MasterWeights | None
    checkpointer: Checkpointer
    output_dir: Path
    start_step: int = 0
    eval_before: dict | None = None
    sampler: Sampler = rollout  # draws each step's completions (polo.generation)
    # After a rollback (polo.rl.guard) step s draws the prompts of position s - 1 + data_offset: the
    # batches seen between the checkpoint and the jump are skipped, not replayed.
    data_offset: int = 0
    rollbacks: int = 0
    beta: float = 0.0  # the next step's KL coefficient: algorithm.beta, or where the adaptive controller moved it

    @property
    def step_config(self) -> Config:
        """Return the config a step trains with: the recipe, with the adaptive controller's KL coefficient."""
        alg = self.config.algorithm
        if alg.kl_target is None:
            return self.config
        return replace(self.config, algorithm=replace(alg, beta=self.beta))

    @property
    def learner(self) -> Learner:
        """Return what the policy update changes and runs through: policy, optimizer, schedule, critic, modules."""
        return Learner(self.model, self.optimizer, self.scheduler, self.compute, self.critic, self.modules)

    def checkpoint_state(self) -> dict:
        """Return the run state a checkpoint keeps beside the weights and the optimizer."""
        critic = self.critic.state() if self.critic is not None else {}
        state = {
            "eval_before": self.eval_before,
            "data_offset": self.data_offset,
            "rollbacks": self.rollbacks,
            **critic,
        }
        if self.config.algorithm.kl_target is not None:
            state["beta"] = self.beta
        if self.config.algorithm.sync_ref_model:  # the reference has moved away from model.name
            state["reference"] = self.reference.state_dict()
        return state

    def save(self, step: int) -> Path | None:
        """Write checkpoint `step` (every rank calls it) and return its path (None off rank 0)."""
        return self.checkpointer.save(
            step, self.model, self.tokenizer, self.optimizer, self.scheduler, self.checkpoint_state(), self.masters
        )


def optimizer_steps(config: Config) -> int:
    """Return how many optimizer steps the RL run takes in all (the schedule's length)."""
    return max(config.train.steps * optimizer_steps_per_batch(config), 1)


def checked_config(config, overrides: list[str] | None) -> Config:
    """Return the run's `Config` from a Config, recipe path or mapping plus overrides, checked against the process
    count."""
    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config_to_dict(config), overrides)
    if config.train.prompts_per_step % parallel.world_size():
        raise ConfigError(
            f"train.prompts_per_step={config.train.prompts_per_step} is not divisible by the "
            f"{parallel.world_size()} processes; pick a multiple of {parallel.world_size()} "
            "(each process samples whole groups)"
        )
    if config.output.push_to_hub:
        check_push(
            config.output.push_to_hub
        )  # before anything loads: a run whose model could not be pushed never starts
    return config


def find_resume_point(config: Config, checkpointer: Checkpointer) -> ResumePoint:
    """Return where the run starts (`polo.runtime.lifecycle.resume_point`), over the keys that define an RL run
    (`RESUME_KEYS`); a finished run raises `RunFinishedError`."""
    return resume_point(
        checkpointer,
        "polo train",
        config.output,
        config_to_dict(config),
        RESUME_KEYS,
        lambda checkpoint: finished_run(checkpoint, config.train.steps, Path(config.output.dir)),
    )


def load_models(config: Config, compute: Compute, resume_from: Path | None) -> tuple:
    """Return (policy, tokenizer, reference or None) on `compute.device`: LoRA adapters attached, FSDP-sharded under
    torchrun."""
    lora, beta = config.model.lora, config.algorithm.beta
    if parallel.rank() == 0:
        resolve_model_path(config.model.name)  # one process fetches/converts a built-in model, the others wait
    parallel.barrier()
    # A LoRA checkpoint holds only the adapter: the base model comes from model.name again.
    start_from = str(resume_from) if resume_from is not None and not lora.r else config.model.name
    model, tokenizer = load_policy(start_from, attn_implementation=config.model.attn_implementation)
    check_router_loss(model, config.algorithm.router_aux_loss_coef)
    check_entropy_bonus(model, config.algorithm.entropy_coef)
    model = model.to(compute.device)
    model.train()
    setup_activation_checkpointing(model, config.train.gradient_checkpointing, compute.available_memory())
    reference = None
    if lora.r:
        model = load_adapters(model, resume_from) if resume_from is not None else add_adapters(model, lora)
        if compute.master_weights:
            freeze_base_dtype(model, compute.param_dtype)  # the base never changes: no master copy needed
        reference = model if beta > 0 else None  # scored with the adapters off (polo.models.lora)
    elif beta > 0:
        # The reference is never trained: under bf16 it is kept in bf16 (half the memory, no casts).
        source = (
            model
            if resume_from is None
            else load_policy(config.model.name, attn_implementation=config.model.attn_implementation)[0]
        )
        reference = frozen_copy(source, dtype=compute.frozen_dtype).to(compute.device)
    if config.train.data_parallel == "fsdp" and parallel.is_distributed():
        if core.ADVANTAGE_ESTIMATORS.entry(config.algorithm.advantage_estimator).needs_critic:
            raise ConfigError("train.data_parallel=fsdp does not support PPO's critic yet; use train.data_parallel=ddp")
        parallel.shard_model(model)  # after the reference copy, which stays whole (it is never trained)
    for module in {
        id(m): m for m in (model, reference) if m is not None
    }.values():  # faster attention, leaner layers, same maths (polo.kernels)
        use_fast_attention(module, compute)
        use_lean_layers(module)
        use_onednn_linears(module, compute)
    return model, tokenizer, reference


def check_entropy_bonus(model, entropy_coef: float) -> None:
    """Refuse an entropy bonus for a model whose entropy has no gradient: only the chunked lm_head path
    (`polo.kernels.logprobs`, a plain decoder whose logits are lm_head(hidden)) differentiates it for free."""
    if entropy_coef > 0 and not supports_fused_logprobs(model):
        raise ConfigError(
            f"algorithm.entropy_coef={entropy_coef} needs a model whose logits are lm_head(hidden), which polo "
            f"differentiates the entropy of; {type(model).__name__} changes its logits after the head"
        )


def resume(run: Run, checkpoint: Path) -> None:
    """Restore optimizer, schedule, random streams, critic and step from `checkpoint` into `run`."""
    state = load_trainer_state(checkpoint)  # onto the CPU: the optimizer and critic place it on the run's device
    parallel.load_optimizer_state(run.model, run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    rng_per_rank = state.get("rng_per_rank", [state["rng"]])
    if len(rng_per_rank) == parallel.world_size():
        restore_rng(rng_per_rank[parallel.rank()])
    else:  # the data position comes from the step, so only the sampling streams change
        if is_main_process():
            print(
                f"polo: warning: {checkpoint} was written by {len(rng_per_rank)} processes, resuming with "
                f"{parallel.world_size()}: the run goes on, but samples differ from an uninterrupted run"
            )
        seed_everything(run.config.train.seed + parallel.rank() + 1_000_003 * state["step"])
    if run.critic is not None:
        run.critic.load(state)
    run.start_step, run.eval_before = state["step"], state.get("eval_before")
    run.data_offset, run.rollbacks = state.get("data_offset", 0), state.get("rollbacks", 0)
    if run.config.algorithm.kl_target is not None:
        run.beta = state.get("beta", run.beta)
    if run.config.algorithm.sync_ref_model and "reference" in state:
        run.reference.load_state_dict(state["reference"])
    if is_main_process():  # the one writer; a second rank rewriting the same file could empty it
        truncate_metrics(run.output_dir / "metrics.jsonl", run.start_step)
        truncate_metrics(run.output_dir / "samples.jsonl", run.start_step)


def check_prompts(config: Config, task: Task, tokenizer, model) -> None:
    """Refuse (or, with task.truncate_prompts, cut) prompts that leave no room for their completion budget in the
    model's context (`polo.data.prompt_lengths`), before anything is sampled."""
    context = context_length(model)
    if context is None:
        return
    sampling = config.sampling.max_new_tokens
    room = PromptRoom(
        context,
        ("sampling.max_new_tokens", sampling),
        ("eval.max_new_tokens", config.eval.max_new_tokens)
        if config.eval.max_new_tokens
        else ("sampling.max_new_tokens", sampling),
        instruction_for(config, task),
        config.task.system_prompt,
    )
    for warning in fit_prompts(task, tokenizer, room, config.task.truncate_prompts):
        if is_main_process():
            print(warning, flush=True)


def set_up(
    config,
    overrides: list[str] | None = None,
    reward_functions: dict | None = None,
    rollback: RollbackState | None = None,
    train_dataset: object = None,
    eval_dataset: object = None,
) -> Run:
    """Return a ready `Run`: config checked, task and rewards built, models loaded, state resumed, config.yaml written.

    `train_dataset` / `eval_dataset` (a `datasets.Dataset` or a list of dicts) are the rows of the
    hf task (`polo.data.hf`): config.yaml records task.name hf, task.path null and the rows' sha256,
    and a resume goes on only with the same rows passed again.

    With `rollback` (from the divergence guard) the run is rebuilt from `rollback.checkpoint`, or
    from the starting model when it is None, as a resume would, then skips the batches it names.
    """
    config = checked_config(config, overrides)
    # What config.yaml records: passed datasets make the hf task (make_task refuses them with another task.name).
    recorded = config if train_dataset is None else replace(config, task=replace(config.task, name="hf"))
    output_dir = Path(config.output.dir)
    checkpointer = Checkpointer(
        output_dir,
        config.output.keep_checkpoints,
        yaml.safe_dump(config_to_dict(recorded), sort_keys=False),
        "polo train",
    )
    # Before anything loads: a refused resume or a damaged checkpoint costs nothing.
    point = find_resume_point(recorded, checkpointer) if rollback is None else None
    resume_from = point.checkpoint if point is not None else rollback.checkpoint
    compute = train_compute(config)
    task = make_task(config, train_dataset, eval_dataset)
    config = recorded
    reward_set = RewardSet({**config.rewards, **(reward_functions or {})}, task, on_error=config.train.on_reward_error)
    check_guard_settings(config)
    if resume_from is None and rollback is None:
        claim_output_dir(output_dir, config.output.overwrite, config.output.resume)
    if train_dataset is not None and resume_from is not None:
        check_same_datasets(output_dir / "config.yaml", task)
    note = passed_datasets_note(task) if train_dataset is not None else ""  # the rows as given, before any cut
    # Ranks sample different completions (seed + rank); they all start from the same weights.
    seed_everything(config.train.seed + parallel.rank())
    model, tokenizer, reference = load_models(config, compute, resume_from)
    check_prompts(config, task, tokenizer, model)
    masters = master_weights(model, compute)  # after the reference copy, which stays as it was made
    optimizer = trainer_optimizer(model.parameters(), config.train, masters)
    critic = build_critic(config, model, optimizer, optimizer_steps(config))  # before the scheduler: a head joins it
    run = Run(
        config=config,
        compute=compute,
        task=task,
        reward_set=reward_set,
        instruction=instruction_for(config, task),
        model=model,
        tokenizer=tokenizer,
        reference=reference,
        optimizer=optimizer,
        scheduler=build_schedule(optimizer, config.train, optimizer_steps(config)),
        critic=critic,
        modules=update_modules(model, critic),
        masters=masters,
        checkpointer=checkpointer,
        output_dir=output_dir,
        sampler=sampler_for(config, task, compute),
        beta=config.algorithm.beta,
    )
    if resume_from is not None:
        resume(run, resume_from)
    if rollback is not None:
        run.data_offset, run.rollbacks, run.eval_before = rollback.data_offset, rollback.rollbacks, rollback.eval_before
        if resume_from is None and is_main_process():  # back to the starting model: the rows logged since go
            truncate_metrics(output_dir / "metrics.jsonl", 0)
            truncate_metrics(output_dir / "samples.jsonl", 0)
    snapshot_config(output_dir, config_to_dict(config), note, point)
    return run
