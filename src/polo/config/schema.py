"""The schema of a run: one dataclass per recipe section (model, task, rewards, sampling, algorithm, train, eval, output).

A recipe is a YAML mapping whose sections mirror the dataclasses below. Every key is checked:
an unknown key or a value of the wrong type is a `ConfigError` naming the key and what is
accepted, before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A recipe or override that does not fit the configuration schema."""


@dataclass
class LoraSettings:
    """Low-rank adapters (peft's LoRA) instead of full fine-tuning; `r: 0` trains every weight."""

    r: int = 0  # adapter rank; 0 = full fine-tuning (the default)
    alpha: float = 32.0  # the adapter's update is scaled by alpha / r
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"]
    )  # module names, or all-linear (every linear layer but the LM head)


@dataclass
class ModelConfig:
    """Which causal LM to train."""

    name: str = "smollm2-135m-instruct"  # a built-in model name, a local HF model directory, or a Hub id org/name[@revision] (polo.models.hub)
    attn_implementation: str | None = None  # eager | sdpa | None (transformers' default: sdpa)
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class PromptExample:
    """A worked example shown before every question, as an earlier user turn and the assistant's reply."""

    question: str = ""
    response: str = ""


@dataclass
class EnvironmentConfig:
    """The LM environment episodes run in (docs/tools.md); `name: null` keeps one-turn completions."""

    name: str | None = None  # null (one turn) | python_tool | module:Name (a class your module registers)
    tools: bool = True  # false switches the environment's tools off: a call is answered "the tool is off"
    timeout_s: float = 2.0  # wall-clock limit of one tool call (the sandbox's SandboxLimits.timeout_s)
    memory_mb: int = 256  # address-space limit of one tool call
    max_output_chars: int = 200  # a tool's answer is cut to this many characters
    options: dict[str, bool | int | float | str] = field(
        default_factory=dict
    )  # passed to a module:Name environment as keyword arguments


@dataclass
class TaskConfig:
    """Which prompts to train and evaluate on, and how they are phrased."""

    name: str = "arithmetic"  # arithmetic | gsm8k | jsonl | hf | code
    instruction: str | None = None  # template with {question}; None picks the task's default
    system_prompt: str | None = None
    few_shot: list[PromptExample] = field(default_factory=list)  # worked examples before every question (docs/r1.md)
    answer_in_tags: bool = False  # the answer only counts inside <answer>...</answer>
    num_train: int | None = None
    num_eval: int | None = 200
    # arithmetic
    seed: int = 0
    operators: list[str] = field(default_factory=lambda: ["+"])
    min_digits: int = 2
    max_digits: int = 2
    # gsm8k / jsonl (hf: eval_path is the eval data file beside a task.path data file)
    train_path: str | None = None
    eval_path: str | None = None
    prompt_field: str = "question"
    answer_field: str = "answer"
    checker: str = "math_verify"  # jsonl and hf: math_verify | exact_number | exact_string (`polo train --help`)
    # hf (Hugging Face datasets; docs/tasks.md): a save_to_disk directory, a data file or directory
    # (parquet/json/jsonl/csv), or a Hub id; null with datasets passed to polo.train(train_dataset=...)
    path: str | None = None
    subset: str | None = None  # the Hub dataset's configuration (load_dataset's name), e.g. main
    split: str = "train"
    eval_split: str | None = None  # null: "test" when the dataset has one, else the last num_eval train rows
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)  # multi-turn episodes with tools


@dataclass
class SamplingConfig:
    """How completions are sampled during training."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    sampler: str = (
        "auto"  # auto | kv_cache | static: auto is the static-cache sampler on CUDA, the KV-cache one on the CPU
    )
    max_turns: int = 4  # with task.environment: the model's turns per episode (max_new_tokens is per turn)
    max_episode_tokens: int = 256  # with task.environment: tokens after the first prompt (turns and observations)


@dataclass
class AlgorithmConfig:
    """The policy-optimization estimator and loss. `name` picks a preset (see `PRESETS`); any field set
    in the recipe or on the command line wins over the preset's value."""

    name: str = "grpo"  # grpo | dr_grpo | dapo | rloo | reinforce_pp | gspo | ppo
    advantage_estimator: str = "grpo"  # grpo | rloo | reinforce_pp | gae
    policy_loss: str = "ppo_clip"  # ppo_clip (token ratio) | gspo (sequence ratio)
    group_size: int = 8  # G completions per prompt
    scale_rewards: bool = True  # divide group-centred rewards by the group std
    advantage_eps: float = 1e-4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    beta: float = 0.0  # KL coefficient; a reference model is kept only when beta > 0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False  # fold -beta*KL into per-token rewards (REINFORCE++, PPO) instead of the loss
    # seq_mean_token_mean | token_mean | seq_mean_token_sum_norm | micro_batch_token_mean (polo.core.losses)
    loss_aggregation: str = "seq_mean_token_mean"
    update_epochs: int = 1  # mu: passes over each batch; old log-probs are computed when > 1
    # DAPO
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, sample more prompts to refill
    max_sampling_rounds: int = 3  # cap on sampling rounds per step under dynamic sampling
    overlong_buffer: float = 0.0  # soft overlong penalty over the last fraction of max_new_tokens (DAPO: 0.2); 0 = off
    overlong_penalty: float = 1.0  # the penalty reached at max_new_tokens
    mask_truncated: bool = False  # leave completions cut by max_new_tokens out of the loss
    # returns and the critic (REINFORCE++, PPO)
    gamma: float = 1.0
    lam: float = 0.95  # GAE lambda
    critic: str = "separate"  # separate (own trunk) | head (value head on the policy trunk)
    critic_learning_rate: float = 1e-5
    critic_warmup_steps: int = 0  # steps that train only the critic before the policy moves
    value_clip: float | None = 0.2
    value_coef: float = 0.5  # weight of the value loss (matters when the trunk is shared)


@dataclass
class TrainConfig:
    """Batch shape, optimizer and schedule."""

    steps: int = 50
    prompts_per_step: int = 8  # P prompts, each sampled group_size times
    num_minibatches: int = 1  # optimizer steps per pass over the batch
    micro_batch_size: int = 32  # sequences per forward/backward (gradient accumulation)
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine (after warm-up)
    max_grad_norm: float = 1.0
    seed: int = 0
    precision: str = (
        "auto"  # auto | fp32 | bf16 (autocast) | bf16_master (bf16 weights, fp32 masters); see polo.models.precision
    )
    device: str = "auto"  # auto | cpu | cuda | cuda:N; auto is CUDA when available (polo.runtime.device)
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # Recompute activations in backward: with micro-batches of 32 as fast as 16 without it, at 60% of the memory.
    gradient_checkpointing: bool = True
    on_reward_error: str = "raise"  # raise: stop naming the function and sample | zero: score 0, count, go on
    max_nonfinite_steps: int = 3  # a NaN/inf loss skips its step; this many in a row stop the run
    # The divergence guard (polo.rl.guard): a step whose judged value is more than this many times its
    # reference, or whose weights are not finite, is never saved. 0 = jumps off (non-finite weights still count).
    divergence_factor: float = 10.0
    divergence_checks: list[str] = field(default_factory=lambda: ["weight_norm"])  # of weight_norm | grad_norm | loss
    # rollback: reload the last checkpoint written before the jump (or the starting model) and go on,
    # skipping the batches drawn since it | stop: stop the run naming that checkpoint.
    on_divergence: str = "rollback"
    max_rollbacks: int = 3  # rollbacks in one run before it stops instead
    # Under torchrun: ddp (every rank holds the whole model) | fsdp (parameters, gradients and Adam
    # state sharded across ranks; weights gathered whole for generation). Ignored in one process.
    data_parallel: str = "ddp"


@dataclass
class EvalConfig:
    """Greedy held-out evaluation."""

    before: bool = True  # evaluate the starting model
    after: bool = True
    every: int = 0  # also every N steps (0: never)
    max_new_tokens: int | None = None  # None: sampling.max_new_tokens
    batch_size: int = 64


@dataclass
class OutputConfig:
    """Where a run writes, how often it checkpoints, and resuming."""

    dir: str = "runs/grpo"
    save_every: int = 10  # 0 disables periodic checkpoints
    keep_checkpoints: int = 2
    resume: bool = False
    overwrite: bool = False  # a fresh run into a directory holding an earlier run removes that run first
    tensorboard: bool = True  # false leaves tensorboard out of report_to (the older spelling)
    # Trackers the metrics go to, besides metrics.jsonl (always written): any of tensorboard, jsonl,
    # wandb, trackio, mlflow (polo.runtime.trackers; wandb, trackio and mlflow need polo's extras).
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str | None = (
        None  # the trackers' project (mlflow: experiment); null: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME if set, else polo
    )
    run_name: str | None = None  # the trackers' run name; null: the output directory's name
    plots: bool = True
    progress: bool = True
    # A Hugging Face Hub repo id (org/name): the final model and its model card (README.md) are
    # uploaded there once the run ends; checked (online, token) before anything loads. null: no upload.
    push_to_hub: str | None = None
    hub_private: bool = False  # a repository push_to_hub creates is private


@dataclass
class Config:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rewards: dict[str, float] = field(default_factory=lambda: {"correct": 1.0})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
