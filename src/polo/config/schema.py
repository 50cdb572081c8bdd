"""The schema of `polo train`: one dataclass per recipe section (model, task, sampling, algorithm, train, eval, output).

A recipe is a YAML mapping whose sections mirror the dataclasses below. Every key is checked:
an unknown key or a value of the wrong type is a `ConfigError` naming the key and what is
accepted, before any model is loaded. Every field is a `setting` whose help, range and choices
are the one source of its checks, of `polo config` and of docs/config.md.

`OptimizerConfig` (AdamW and its schedule) is shared: `polo train`'s, the fine-tuning commands'
and `polo control`'s `train` sections are optimizer configs with their own batch and budget keys,
built by the one `polo.runtime.optimizer.build_optimizer`. The output sections share their
tracker and Hub keys (`report_to`, `project`, `run_name`, `push_to_hub`, `hub_private`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polo import core
from polo.config.errors import ConfigError as ConfigError  # re-exported: older imports name it here
from polo.config.fields import setting
from polo.config.presets import PRESETS
from polo.core.registry import CHECKERS, ENVIRONMENTS, MODELS, REWARDS, SAMPLERS, TASKS

PRECISIONS = ("auto", "fp32", "bf16", "bf16_master")
SCHEDULES = ("constant", "linear", "cosine")

# output.report_to: every tracker polo reports to (polo.runtime.trackers has a sink for each), and
# the packages it needs beyond polo's own, which the polo extra of the same name installs.
TRACKER_PACKAGES: dict[str, tuple[str, ...]] = {
    "tensorboard": (),
    "jsonl": (),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
    "mlflow": ("mlflow", "pandas"),
}

DEVICE_HELP = "auto | cpu | cuda | cuda:N (auto: CUDA when available, one GPU per torchrun rank)"  # polo.runtime.device


# ---------------------------------------------------------------- shared sections and keys


@dataclass
class OptimizerConfig:
    """AdamW (Loshchilov & Hutter 2019, decoupled weight decay), its learning-rate schedule and gradient clipping.

    Shared by every training command's `train` section; each command sets its own defaults.
    """

    # Adam's first step moves every weight by about the learning rate, and a model's weights start near 0.02:
    # no run, of a language model or a Gymnasium network, goes near 1, so a larger rate is a typo.
    learning_rate: float = setting(1e-6, help="peak learning rate, reached after the warm-up", range="[0, 1]")
    weight_decay: float = setting(0.0, help="AdamW's decoupled weight decay (0: plain Adam)", range=">= 0")
    adam_beta1: float = setting(0.9, help="β1, the decay of Adam's first-moment (mean) estimate", range="[0, 1)")
    adam_beta2: float = setting(
        0.99,
        help="β2, the decay of Adam's second-moment estimate (0.99 adapts faster than torch's 0.999)",
        range="[0, 1)",
    )
    adam_eps: float = setting(1e-8, help="ε in Adam's denominator √v̂ + ε (torch's default 1e-8)", range="> 0")
    warmup_steps: int = setting(
        0, help="optimizer steps of linear warm-up from lr/(w+1) to the peak before the schedule", range=">= 0"
    )
    lr_schedule: str = setting(
        "constant",
        help="the learning rate after warm-up: constant, or linear or cosine decay to 0 at the last step "
        "(polo.core.lr_multiplier)",
        choices=SCHEDULES,
    )
    max_grad_norm: float = setting(
        1.0, help="clip the global L2 norm of the gradient to this before each step", range="> 0"
    )


def report_to_setting() -> Any:
    """Return the `output.report_to` field every training command shares."""
    return setting(
        ["tensorboard"],
        help="trackers the metrics go to besides metrics.jsonl, which is always written; [] for none "
        "(polo.runtime.trackers; wandb, trackio and mlflow need the polo extra of that name). "
        "Replaces output.tensorboard",
        choices=tuple(TRACKER_PACKAGES),
    )


def project_setting() -> Any:
    """Return the `output.project` field every training command shares."""
    return setting(
        None,
        help="the trackers' project (mlflow: experiment); null: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME if set, "
        "else polo",
    )


def run_name_setting() -> Any:
    """Return the `output.run_name` field every training command shares."""
    return setting(None, help="the trackers' run name; null: the output directory's name")


def tracker_dir_setting() -> Any:
    """Return the `output.tracker_dir` field every training command shares."""
    return setting(
        None,
        help="where the trackers' local stores go (wandb/, mlflow.db, mlruns/); null: output.dir. polo pipeline "
        "sets it to pipeline.dir, so every stage's runs are in one store",
    )


def push_to_hub_setting() -> Any:
    """Return the `output.push_to_hub` field of the commands that train a Hugging Face model."""
    return setting(
        None,
        help="a Hugging Face Hub repo id org/name: the final model and its model card (README.md) are uploaded "
        "there once the run ends; checked (online, token) before anything loads. null: no upload",
    )


def hub_private_setting() -> Any:
    """Return the `output.hub_private` field of the commands that train a Hugging Face model."""
    return setting(False, help="a repository push_to_hub creates is private")


def save_every_setting(default: int) -> Any:
    """Return the `output.save_every` field of the commands that checkpoint."""
    return setting(
        default, help="checkpoint every N steps (and on a stop signal); 0 disables periodic ones", range=">= 0"
    )


def keep_checkpoints_setting() -> Any:
    """Return the `output.keep_checkpoints` field of the commands that checkpoint."""
    return setting(2, help="periodic checkpoints kept (the newest)", range=">= 1")


def resume_setting() -> Any:
    """Return the `output.resume` field of the commands that checkpoint."""
    return setting(False, help="continue from the newest checkpoint in dir (docs/cluster.md)")


def allow_changes_setting(keys: tuple[str, ...]) -> Any:
    """Return the `output.allow_changes` field of a command whose runs resume, over `keys`: those that say what its run
    is (polo.runtime.resume)."""
    return setting(
        [],
        help="keys a resume may change although they define the run (any other change to them is refused); "
        "each change is recorded in dir/config_changes.jsonl and config.yaml keeps the starting value",
        choices=keys,
    )


@dataclass
class CallbackConfig:
    """A callback the run calls at its start, each step, evaluation and checkpoint, and its end (docs/callbacks.md)."""

    name: str = setting("", help="EarlyStopping (polo's own), or module:Name for a class of yours")
    options: dict[str, bool | int | float | str] = setting({}, help="keyword arguments of its constructor")


def callbacks_setting() -> Any:
    """Return the `output.callbacks` field every training command shares (polo.runtime.callbacks)."""
    return setting(
        [],
        help="callbacks of the run, each {name: EarlyStopping or module:Name, options: {...}}; "
        "polo.runtime.callbacks (docs/callbacks.md)",
    )


def device_setting() -> Any:
    """Return the `train.device` field every training command shares."""
    return setting("auto", help=DEVICE_HELP)


def gradient_checkpointing_setting(default: bool | str) -> Any:
    """Return the `train.gradient_checkpointing` field every training command shares (polo.models.loading)."""
    return setting(
        default,
        help="true | false | auto: recompute activations in backward (less memory, a third more compute); auto "
        "recomputes only a micro-batch whose activations would take over a quarter of the memory available",
        choices=(True, False, "auto"),
    )


def threads_setting(default: int | None = None) -> Any:
    """Return the `train.threads` field every training command shares."""
    return setting(default, help="torch intra-op threads; null keeps torch's default", range=">= 1")


# ---------------------------------------------------------------- polo train


@dataclass
class LoraSettings:
    """Low-rank adapters (LoRA, Hu et al. 2021, via peft) instead of full fine-tuning; `r: 0` trains every weight."""

    r: int = setting(0, help="adapter rank; 0 = full fine-tuning (the default)", range=">= 0")
    alpha: float = setting(32.0, help="the adapter's update is scaled by alpha / r (> 0 when r > 0)")
    dropout: float = setting(0.0, help="dropout on the adapter's input", range="[0, 1)")
    target_modules: list[str] = setting(
        ["all-linear"], help="module names (e.g. [q_proj, v_proj]), or all-linear: every linear layer but the LM head"
    )


# The model every command starts from unless a recipe names another (a built-in, fetched on first use).
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class ModelConfig:
    """Which causal LM to train."""

    name: str = setting(
        DEFAULT_MODEL,
        help="a built-in model (fetched and converted once), a local Hugging Face model directory, "
        "or a Hub id org/name[@revision] (polo.models.hub; docs/models.md)",
        choices=MODELS,
        others="a local model directory | org/name[@revision]",
    )
    attn_implementation: str | None = setting(
        None, help="transformers' attention: eager | sdpa; null: transformers' default (sdpa)"
    )
    lora: LoraSettings = setting(default_factory=LoraSettings, help="LoRA adapters (polo train only)")


@dataclass
class PromptExample:
    """A worked example shown before every question, as an earlier user turn and the assistant's reply."""

    question: str = setting("", help="the example's question (filled into task.instruction like a real one)")
    response: str = setting("", help="the assistant's reply to it, in the form the answers should take")


@dataclass
class EnvironmentConfig:
    """The LM environment episodes run in (docs/tools.md); `name: null` keeps one-turn completions."""

    name: str | None = setting(
        None,
        help="null: one-turn completions; else a registered environment, or module:Name for a class your module "
        "registers (@register_environment)",
        choices=ENVIRONMENTS,
    )
    tools: bool = setting(
        True, help='false switches the environment\'s tools off: a call is answered "the tool is off"'
    )
    timeout_s: float = setting(2.0, help="wall-clock limit of one tool call in seconds", range="> 0")
    memory_mb: int = setting(256, help="address-space limit of one tool call in MiB", range=">= 16")
    max_output_chars: int = setting(200, help="a tool's answer is cut to this many characters", range=">= 1")
    options: dict[str, bool | int | float | str] = setting(
        {},
        help="the environment's own options: the keys of its settings dataclass, or keyword arguments of its class",
        options_of=ENVIRONMENTS,
    )


@dataclass
class TaskConfig:
    """Which prompts to train and evaluate on, and how they are phrased (docs/tasks.md)."""

    name: str = setting(
        "arithmetic",
        help="the task: a registered one, or module:Name for your own (a polo.data.Task subclass or a function "
        "returning a Task; docs/tasks.md)",
        choices=TASKS,
    )
    instruction: str | None = setting(
        None,
        help="the prompt template, with {question}; null: the task's default (the tagged form with answer_in_tags)",
    )
    system_prompt: str | None = setting(None, help="a system message before every prompt; null: none")
    few_shot: list[PromptExample] = setting(
        [], help="worked examples shown before every question as earlier turns (docs/r1.md)"
    )
    answer_in_tags: bool = setting(
        False, help="the answer only counts inside <answer>...</answer> (R1's format, DeepSeek-AI 2025)"
    )
    num_train: int | None = setting(
        None,
        help="training problems: the first N rows (a generated task: N generated; null: every row, or the task's "
        "own default)",
        range=">= 0",
        used_by=TASKS,
    )
    num_eval: int | None = setting(
        200, help="held-out problems: the first N rows (null: all rows)", range=">= 0", used_by=TASKS
    )
    seed: int = setting(0, help="which problems are drawn and how they split", used_by=TASKS)
    operators: list[str] = setting(["+"], help="the operators problems use (+, -, *)", used_by=TASKS)
    min_digits: int = setting(2, help="the fewest digits of an operand", range=">= 1", used_by=TASKS)
    max_digits: int = setting(2, help="the most digits of an operand", range=">= 1", used_by=TASKS)
    train_path: str | None = setting(
        None,
        help="the training data, a JSON-lines file (null: the task's own, e.g. train.jsonl in $POLO_GSM8K_DIR)",
        used_by=TASKS,
    )
    eval_path: str | None = setting(
        None,
        help="the held-out data, a JSON-lines file (null: the task's own, e.g. test.jsonl in $POLO_GSM8K_DIR; a task "
        "over a task.path data file: the held-out data file beside it)",
        used_by=TASKS,
    )
    prompt_field: str | None = setting(
        None,
        help="the row field holding the question; null: question, else TRL's prompt (text, or a list "
        "of {role, content} messages), used as it stands (docs/migrating-from-trl.md)",
        used_by=TASKS,
    )
    answer_field: str | None = setting(
        None,
        help="the row field holding the reference answer; null: answer, else TRL's solution",
        used_by=TASKS,
    )
    truncate_prompts: bool = setting(
        False,
        help="a prompt that leaves no room for max_new_tokens in the model's context is cut from its start, with a "
        "warning; false: refused at load, naming the row",
    )
    checker: str = setting(
        "math_verify",
        help="how an answer is judged",
        choices=CHECKERS,
        used_by=TASKS,
    )
    path: str | None = setting(
        None,
        help="a save_to_disk directory, a data file or directory (parquet/json/jsonl/csv) or a Hub dataset id; "
        "null with datasets passed to polo.train(train_dataset=...)",
        used_by=TASKS,
    )
    subset: str | None = setting(
        None, help="the Hub dataset's configuration (load_dataset's name), e.g. main", used_by=TASKS
    )
    split: str = setting("train", help="the training split", used_by=TASKS)
    eval_split: str | None = setting(
        None,
        help='the held-out split; null: "test" when the dataset has one, else the last num_eval train rows',
        used_by=TASKS,
    )
    options: dict[str, Any] = setting(
        {},
        help="the task's own options: the keys of its settings dataclass (@register_task(settings=...)), or "
        "keyword arguments of a module:Name task beyond the task keys above",
        options_of=TASKS,
    )
    environment: EnvironmentConfig = setting(
        default_factory=EnvironmentConfig, help="multi-turn episodes with tools (docs/tools.md)"
    )


@dataclass
class SamplingConfig:
    """How completions are sampled during training."""

    temperature: float = setting(
        1.0, help="softmax temperature of sampling (1: the model's own distribution)", range="> 0"
    )
    top_p: float = setting(
        1.0,
        help="nucleus sampling: keep the smallest set of tokens with this much probability (Holtzman et al. 2020)",
        range="(0, 1]",
    )
    top_k: int = setting(
        0,
        help="keep only the k likeliest tokens, before top_p (Fan et al. 2018; transformers' and TRL's top_k); 0: off",
        range=">= 0",
    )
    min_p: float = setting(
        0.0,
        help="after top_p, drop the tokens less likely than min_p times the likeliest one (Nguyen et al. 2024, "
        "'min-p sampling'; TRL's min_p); 0: off",
        range="[0, 1]",
    )
    repetition_penalty: float = setting(
        1.0,
        help="CTRL's penalty (Keskar et al. 2019) on every token already in the prompt or the completion, before the "
        "temperature: a positive logit divided by it, a negative one multiplied; > 1 discourages repeats; 1: off",
        range="> 0",
    )
    max_new_tokens: int = setting(
        64,
        help="the completion budget; a completion cut here is truncated (see algorithm.mask_truncated)",
        range=">= 1",
    )
    sampler: str = setting(
        "auto", help="which sampler draws the completions (polo.generation.grouped)", choices=SAMPLERS
    )
    max_turns: int = setting(
        4, help="with task.environment: the model's turns per episode (max_new_tokens is per turn)", range=">= 1"
    )
    max_episode_tokens: int = setting(
        256,
        help="with task.environment: the episode's token budget after the first prompt (turns and observations)",
        range=">= 1",
    )


@dataclass
class AlgorithmConfig:
    """The policy-optimization estimator and loss. `name` picks a preset (`polo.config.presets`); any field set
    in the recipe or on the command line wins over the preset's value."""

    name: str = setting(
        "grpo",
        help="the preset: a named set of the fields below (grpo: Shao et al. 2024; dr_grpo: Liu et al. 2025; "
        "dapo: Yu et al. 2025; rloo: Ahmadian et al. 2024; reinforce_pp: Hu 2025; gspo: Zheng et al. 2025; "
        "cispo: MiniMax 2025; sapo: Qwen 2025; luspo: Liu et al. 2026; vespo: arXiv 2602.10693; "
        "ppo: Schulman et al. 2017, Ouyang et al. 2022)",
        choices=tuple(PRESETS),
    )
    advantage_estimator: str = setting(
        "grpo", help="how rewards become per-token advantages", choices=core.ADVANTAGE_ESTIMATORS
    )
    policy_loss: str = setting("ppo_clip", help="the per-token policy loss", choices=core.POLICY_LOSSES)
    policy_loss_options: dict[str, Any] = setting(
        {},
        help="the policy loss's own options: the keys of its settings dataclass (@register_policy_loss(settings=...)), "
        "or keyword arguments of its function",
        options_of=core.POLICY_LOSSES,
    )
    group_size: int = setting(
        8, help="G completions sampled per prompt (the group the baseline is taken over)", range=">= 1"
    )
    scale_rewards: bool | str = setting(
        True,
        help="true: divide group-centred rewards by the group's std (GRPO); false: centre only, which removes the "
        "difficulty bias Dr. GRPO (Liu et al. 2025) found; batch: divide by the whole batch's std (Lite PPO, "
        "'Tricks or Traps?', Liu et al. 2025)",
        choices=(True, False, "batch"),
    )
    advantage_eps: float = setting(
        1e-4, help="ε in (r − mean) / (std + ε): a group whose rewards are all equal gets advantage 0", range=">= 0"
    )
    clip_eps_low: float = setting(
        0.2,
        help="ε_low: the ratio is clipped below at 1 − ε_low (PPO's ε, Schulman et al. 2017); below 1, since a "
        "ratio is always above 0 and a bound of 0 or less never binds",
        range="[0, 1)",
    )
    clip_eps_high: float = setting(
        0.2,
        help="ε_high: the ratio is clipped above at 1 + ε_high; raising it (DAPO's clip-higher, 0.28, "
        "Yu et al. 2025) lets unlikely tokens grow and keeps entropy up",
        range=">= 0",
    )
    clip_delta: float | None = setting(
        None,
        help="two-sided clipping (INTELLECT-2, Prime Intellect 2025): the unclipped ratio is capped at δ too, so a "
        "negative advantage's loss stays bounded; set it above 1 + clip_eps_high (4, say); null: off",
        range="> 1",
    )
    sapo_temperature_pos: float = setting(
        1.0, help="sapo: τ of the soft gate for positive advantages (SAPO, Qwen 2025)", range="> 0"
    )
    sapo_temperature_neg: float = setting(
        1.05, help="sapo: τ for negative advantages; above τ_pos, their off-policy tokens fade faster", range="> 0"
    )
    top_entropy_quantile: float = setting(
        1.0,
        help="train the policy on the micro-batch's top fraction of tokens by entropy only (0.2: Wang et al. 2025, "
        "'Beyond the 80/20 Rule'); the KL and the normalisers still count every token; 1: all",
        range="(0, 1]",
    )
    entropy_coef: float = setting(
        0.0,
        help="the entropy bonus: the loss subtracts entropy_coef x the policy's mean per-token entropy, whatever "
        "the loss's aggregation (Mnih et al. 2016; PPO's c2; TRL's entropy_coef; polo.core.losses); 0: off",
        range=">= 0",
    )
    sampler_correction: str | None = setting(
        None,
        help="weight every token's policy loss by π_old/μ, μ the sampler's own log-prob of the token, to correct for "
        "the sampler's numerics (TIS, Yao et al. 2025; TRL's vllm_importance_sampling_mode): token_* per token, "
        "sequence_* one product per completion; *_truncate clips the weight to [sampler_correction_min, "
        "sampler_correction_max], *_mask zeroes it outside; null: off",
        choices=core.SAMPLER_CORRECTIONS,
    )
    sampler_correction_min: float | None = setting(
        None, help="the lower bound of sampler_correction's weight (null: none)", range=">= 0"
    )
    sampler_correction_max: float | None = setting(
        3.0, help="the upper bound of sampler_correction's weight (null: none; TRL's default 3)", range="> 0"
    )
    off_policy_mask_threshold: float | None = setting(
        None,
        help="leave out of the policy loss a completion with a negative advantage whose mean log μ − log π per token "
        "exceeds this (DeepSeek-V3.2's off-policy sequence masking, its δ; μ the sampler's own log-probs where "
        "sampler_correction records them, else the sampling policy's); null: off",
        range=">= 0",
    )
    beta: float = setting(
        0.0, help="KL coefficient to the starting model; a reference model is kept only when beta > 0", range=">= 0"
    )
    kl_target: float | None = setting(
        None,
        help="the adaptive KL controller (Ziegler et al. 2019; verl's kl_ctrl.type adaptive): beta starts at "
        "algorithm.beta and moves each step toward keeping the step's kl near this target (polo.core.reference); "
        "null: beta stays fixed",
        range="> 0",
    )
    kl_horizon: int = setting(
        10000,
        help="the adaptive KL controller's horizon in completions: one step moves beta by at most "
        "20 % x its completions / kl_horizon",
        range=">= 1",
    )
    sync_ref_model: bool = setting(
        False,
        help="move the reference toward the policy every ref_model_sync_steps steps (TR-DPO, Gorbatovski et al. "
        "2024; TRL's sync_ref_model): ref <- alpha * policy + (1 - alpha) * ref",
    )
    ref_model_mixup_alpha: float = setting(
        0.6, help="with sync_ref_model: alpha, the policy's share in the new reference (1: a copy)", range="[0, 1]"
    )
    ref_model_sync_steps: int = setting(
        512, help="with sync_ref_model: steps (sampled batches) between two reference updates", range=">= 1"
    )
    kl_estimator: str = setting(
        "k3",
        help="the per-token KL estimate (Schulman 2020, 'Approximating KL Divergence')",
        choices=core.KL_ESTIMATORS,
    )
    kl_importance_weighted: bool = setting(
        False,
        help="weight the KL in the loss by the token ratio π/π_old, which makes its gradient unbiased off-policy "
        "(DeepSeek-V3.2, DeepSeek-AI 2025; TRL's use_bias_correction_kl, its default); polo.core.kl",
    )
    kl_in_reward: bool = setting(
        False,
        help="fold −beta·KL into the per-token rewards (REINFORCE++, PPO for LMs) instead of adding it to the loss; "
        "needs a token-level estimator",
    )
    loss_aggregation: str = setting(
        "seq_mean_token_mean",
        help="how per-token losses become one number (polo.core.losses)",
        choices=core.LOSS_AGGREGATIONS,
    )
    update_epochs: int = setting(
        1,
        help="μ: passes over each batch; the ratio to the sampling policy (and so the clipping) matters when "
        "update_epochs × train.num_minibatches > 1",
        range=">= 1",
    )
    dynamic_sampling: bool = setting(
        False,
        help="DAPO's dynamic sampling: drop groups whose rewards are all equal (zero advantage) and sample "
        "more prompts to refill the batch",
    )
    max_sampling_rounds: int = setting(3, help="cap on sampling rounds per step under dynamic sampling", range=">= 1")
    overlong_buffer: float = setting(
        0.0,
        help="DAPO's soft overlong punishment: a penalty rising linearly over the last fraction of "
        "max_new_tokens (DAPO: 0.2); 0 = off",
        range="[0, 1)",
    )
    overlong_penalty: float = setting(1.0, help="the overlong penalty reached at max_new_tokens", range=">= 0")
    mask_truncated: bool = setting(
        False, help="leave completions cut by max_new_tokens out of the loss (DAPO's overlong filtering)"
    )
    gamma: float = setting(1.0, help="γ, the discount of per-token rewards (REINFORCE++, PPO)", range="[0, 1]")
    lam: float = setting(
        0.95,
        help="λ of GAE, the bias-variance trade-off of the critic's advantages (Schulman et al. 2016)",
        range="[0, 1]",
    )
    critic: str = setting(
        "separate",
        help="PPO's critic: separate (its own trunk) | head (a value head on the policy trunk)",
        choices=("separate", "head"),
    )
    critic_learning_rate: float = setting(1e-5, help="the critic's AdamW learning rate", range="[0, 1]")
    critic_warmup_steps: int = setting(0, help="steps that train only the critic before the policy moves", range=">= 0")
    value_clip: float | None = setting(
        0.2, help="clip the value prediction within this of the old value (PPO2); null: unclipped", range="> 0"
    )
    value_coef: float = setting(0.5, help="weight of the value loss (matters when the trunk is shared)", range=">= 0")
    router_aux_loss_coef: float = setting(
        0.0,
        help="weight of a mixture-of-experts router's load-balancing loss (Switch Transformer's, as transformers "
        "computes it; TRL's router_aux_loss_coef) added to the update's loss; 0: off. The routers' expert load "
        "is logged either way (polo.models.routing)",
        range=">= 0",
    )


@dataclass
class TrainConfig(OptimizerConfig):
    """Batch shape, the optimizer and its schedule, precision, and what stops or rolls back a run."""

    steps: int = setting(50, help="training steps (each samples a batch and updates on it)", range=">= 0")
    prompts_per_step: int = setting(8, help="P prompts per step, each sampled group_size times", range=">= 1")
    num_minibatches: int = setting(
        1,
        help="optimizer steps per pass over the batch (divides prompts_per_step; a group is never split)",
        range=">= 1",
    )
    micro_batch_size: int = setting(32, help="sequences per forward/backward (gradient accumulation)", range=">= 1")
    seed: int = setting(0, help="seeds sampling, the data order and every random stream")
    precision: str = setting(
        "auto",
        help="auto | fp32 | bf16 (autocast) | bf16_master (bf16 weights, fp32 masters); auto picks bf16 only "
        "where it was measured faster (polo.runtime.device)",
        choices=PRECISIONS,
    )
    device: str = device_setting()
    threads: int | None = threads_setting()
    # auto: an RL step's micro-batches are short (a few thousand tokens), and recomputing them cost 10-15 % of a
    # step where memory was plentiful (benchmarks/grpo_vs_trl.py); a micro-batch too large for memory still recomputes
    gradient_checkpointing: bool | str = gradient_checkpointing_setting("auto")
    on_reward_error: str = setting(
        "raise",
        help="a reward function that raises: raise (stop, naming the function and the sample) | zero (score 0, "
        "count, go on)",
        choices=("raise", "zero"),
    )
    max_nonfinite_steps: int = setting(
        3, help="a NaN/inf loss skips its step; this many in a row stop the run", range=">= 1"
    )
    divergence_factor: float = setting(
        10.0,
        help="the divergence guard (polo.rl.guard): a step whose judged value is more than this many times its "
        "reference, or whose weights are not finite, is never saved; 0 = jumps off (non-finite weights still count)",
    )
    divergence_checks: list[str] = setting(
        ["weight_norm"], help="what the divergence guard judges: any of weight_norm | grad_norm | loss"
    )
    on_divergence: str = setting(
        "rollback",
        help="rollback: reload the last checkpoint before the jump (or the starting model) and go on, skipping "
        "the batches drawn since | stop: stop the run naming that checkpoint",
        choices=("rollback", "stop"),
    )
    max_rollbacks: int = setting(3, help="rollbacks in one run before it stops instead", range=">= 0")
    data_parallel: str = setting(
        "ddp",
        help="under torchrun: ddp (every rank holds the whole model) | fsdp (parameters, gradients and Adam "
        "state sharded; weights gathered whole for generation). Ignored in one process",
        choices=("ddp", "fsdp"),
    )


@dataclass
class EvalConfig:
    """Greedy held-out evaluation during training."""

    before: bool = setting(True, help="evaluate the starting model")
    after: bool = setting(True, help="evaluate the final model")
    every: int = setting(0, help="also every N steps (0: never)", range=">= 0")
    max_new_tokens: int | None = setting(None, help="completion budget; null: sampling.max_new_tokens", range=">= 1")
    batch_size: int = setting(64, help="prompts decoded together", range=">= 1")


# The keys that say what a `polo train` run is: a resume whose recipe changes one is refused unless
# output.allow_changes names it (polo.runtime.resume). The model is also the KL reference (beta > 0).
RESUME_KEYS = (
    "model.name",
    "algorithm.name",
    "algorithm.advantage_estimator",
    "algorithm.policy_loss",
    "algorithm.loss_aggregation",
    "algorithm.kl_estimator",
    "algorithm.group_size",
    "task.name",
    "task.path",
    "task.subset",
    "task.train_path",
    "task.eval_path",
)


@dataclass
class RunOutputConfig:
    """Where a run of a causal LM writes, how often it checkpoints, resuming, trackers and the Hub.

    The keys `polo train`, `sft`, `rm` and `dpo` share; each command's `output` section is one,
    with its own defaults and keys of its own.
    """

    dir: str = setting("runs/grpo", help="the run directory: config.yaml, metrics.jsonl, checkpoints/, plots")
    save_every: int = save_every_setting(10)
    keep_checkpoints: int = keep_checkpoints_setting()
    resume: bool = resume_setting()
    overwrite: bool = setting(False, help="a fresh run into a directory holding an earlier run removes that run first")
    report_to: list[str] = report_to_setting()
    project: str | None = project_setting()
    run_name: str | None = run_name_setting()
    tracker_dir: str | None = tracker_dir_setting()
    progress: bool = setting(True, help="show a progress bar")
    push_to_hub: str | None = push_to_hub_setting()
    hub_private: bool = hub_private_setting()
    callbacks: list[CallbackConfig] = callbacks_setting()


@dataclass
class OutputConfig(RunOutputConfig):
    """Where a run writes, how often it checkpoints, resuming, trackers and the Hub."""

    allow_changes: list[str] = allow_changes_setting(RESUME_KEYS)
    plots: bool = setting(True, help="draw reward, accuracy and length curves into dir at the end")


@dataclass
class Config:
    """`polo train RECIPE.yaml`: reinforcement learning of a causal LM from verifiable rewards."""

    model: ModelConfig = setting(default_factory=ModelConfig, help="the policy")
    task: TaskConfig = setting(default_factory=TaskConfig, help="the prompts")
    rewards: dict[str, float] = setting(
        {"correct": 1.0},
        help="reward functions and their weights: registered ones, package.module:function for your own, "
        "model:PATH for a reward model (polo.rewards)",
        choices=REWARDS,
        others="model:PATH",
    )
    sampling: SamplingConfig = setting(default_factory=SamplingConfig, help="sampling during training")
    algorithm: AlgorithmConfig = setting(default_factory=AlgorithmConfig, help="the estimator and the loss")
    train: TrainConfig = setting(default_factory=TrainConfig, help="batch shape, optimizer and run control")
    eval: EvalConfig = setting(default_factory=EvalConfig, help="held-out evaluation")
    output: OutputConfig = setting(default_factory=OutputConfig, help="where the run writes and reports")

    @property
    def eval_max_new_tokens(self) -> int:
        """Return the held-out evaluation's completion budget: eval.max_new_tokens, else sampling.max_new_tokens."""
        return self.eval.max_new_tokens or self.sampling.max_new_tokens
