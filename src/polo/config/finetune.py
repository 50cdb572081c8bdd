"""The schema of `polo sft`, `polo rm` and `polo dpo`: the sections `model`, `data`, `train`, `output` (and `dpo`).

The three commands share `data`, `train` (an `OptimizerConfig` with epochs and batches) and
`output` (with `polo train`'s trackers and Hub keys); `polo.finetune` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polo.config.errors import ConfigError
from polo.config.fields import override, setting
from polo.config.loading import build_dataclass, config_to_dict, read_recipe
from polo.config.schema import (
    PRECISIONS,
    ModelConfig,
    OptimizerConfig,
    RunOutputConfig,
    allow_changes_setting,
    device_setting,
    gradient_checkpointing_setting,
    threads_setting,
)
from polo.config.validation import check_device, check_output, check_settings


@dataclass
class DataConfig:
    """Where the examples are and how they are shaped into model inputs (formats: docs/rlhf.md)."""

    train_path: str | None = setting(
        None, help="the training jsonl (required): demonstrations to imitate, or comparisons and rankings to prefer"
    )
    eval_path: str | None = setting(
        None, help="a held-out jsonl, evaluated before, during (train.eval_every) and after training; null: none"
    )
    num_train: int | None = setting(None, help="use the first N training rows (null: all)", range=">= 1")
    num_eval: int | None = setting(None, help="use the first N held-out rows (null: all)", range=">= 1")
    system_prompt: str | None = setting(None, help="a system message for prompts without one of their own")
    max_length: int = setting(512, help="prompt + response tokens; a longer response is cut at the end", range=">= 1")


@dataclass
class FinetuneTrainConfig(OptimizerConfig):
    """The optimizer, batch shape and schedule of a fine-tuning run."""

    learning_rate: float = override(OptimizerConfig, "learning_rate", 1e-5)
    adam_beta2: float = override(
        OptimizerConfig, "adam_beta2", 0.999, help="β2, the decay of Adam's second-moment estimate (torch's default)"
    )
    lr_schedule: str = override(OptimizerConfig, "lr_schedule", "linear")
    epochs: int = setting(1, help="passes over the training rows", range=">= 1")
    max_steps: int | None = setting(None, help="stop after this many optimizer steps (null: all epochs)", range=">= 1")
    batch_size: int = setting(
        32, help="examples per optimizer step: demonstrations to imitate, or rankings to prefer", range=">= 1"
    )
    micro_batch_size: int = setting(
        32, help="sequences per forward/backward (gradient accumulation); a ranking is never split", range=">= 1"
    )
    seed: int = setting(0, help="seeds the data order and every random stream")
    precision: str = setting(
        "auto",
        help="auto | fp32 | bf16 (autocast) | bf16_master (bf16 weights, fp32 masters); auto decides as polo train "
        "does: bf16_master where bf16 was measured faster (bf16 under torchrun), else fp32 (polo.runtime.device)",
        choices=PRECISIONS,
    )
    device: str = device_setting()
    threads: int | None = threads_setting()
    gradient_checkpointing: bool | str = gradient_checkpointing_setting(False)
    eval_every: int = setting(0, help="also evaluate every N steps (0: only before and after)", range=">= 0")


# The keys that say what a `polo sft`, `rm` or `dpo` run is: a resume whose recipe changes one is refused unless
# output.allow_changes names it (polo.runtime.resume). The model is also DPO's reference; the data decides which
# example each step's data position names, and DPO's reference log-probs are kept per example.
FINETUNE_RESUME_KEYS = (
    "model.name",
    "data.train_path",
    "data.eval_path",
    "data.num_train",
    "data.num_eval",
    "dpo.beta",
    "dpo.nll_weight",
)


@dataclass
class FinetuneOutputConfig(RunOutputConfig):
    """Where a fine-tuning run writes (the trained model goes to `<dir>/final`), its trackers and the Hub."""

    dir: str = override(
        RunOutputConfig,
        "dir",
        "runs/finetune",
        help="the run directory: config.yaml, metrics.jsonl, summary.json, checkpoints/, final/",
    )
    save_every: int = override(RunOutputConfig, "save_every", 100)
    allow_changes: list[str] = allow_changes_setting(FINETUNE_RESUME_KEYS)


@dataclass
class SFTConfig:
    """`polo sft RECIPE.yaml`: supervised fine-tuning on demonstrations (the loss on the responses only)."""

    model: ModelConfig = setting(default_factory=ModelConfig, help="the model to fine-tune")
    data: DataConfig = setting(default_factory=DataConfig, help="the demonstrations")
    train: FinetuneTrainConfig = setting(default_factory=FinetuneTrainConfig, help="optimizer and batches")
    output: FinetuneOutputConfig = setting(
        default_factory=lambda: FinetuneOutputConfig(dir="runs/sft"), help="where the run writes and reports"
    )


@dataclass
class RewardModelConfig:
    """`polo rm RECIPE.yaml`: a reward model (a causal LM's trunk with a scalar head) from ranked responses."""

    model: ModelConfig = setting(default_factory=ModelConfig, help="the causal LM whose trunk carries the head")
    data: DataConfig = setting(default_factory=DataConfig, help="the comparisons or rankings")
    train: FinetuneTrainConfig = setting(default_factory=FinetuneTrainConfig, help="optimizer and batches")
    output: FinetuneOutputConfig = setting(
        default_factory=lambda: FinetuneOutputConfig(dir="runs/rm"), help="where the run writes and reports"
    )


@dataclass
class DPOSection:
    """The DPO loss (Rafailov et al. 2023)."""

    beta: float = setting(
        0.1, help="β: the strength of the implicit KL anchor to the reference (TRL's default 0.1)", range="> 0"
    )
    nll_weight: float = setting(
        0.0,
        help="α: weight of the preferred answers' per-token NLL added to the loss, as in Llama 3 (0.2) and "
        "RPO (Pang et al. 2024; TRL's rpo_alpha); 0: plain DPO",
        range=">= 0",
    )


@dataclass
class DPOConfig:
    """`polo dpo RECIPE.yaml`: Direct Preference Optimization on ranked responses, without a reward model."""

    model: ModelConfig = setting(default_factory=ModelConfig, help="the starting policy, also the frozen reference")
    data: DataConfig = setting(default_factory=DataConfig, help="the comparisons or rankings")
    dpo: DPOSection = setting(default_factory=DPOSection, help="the loss")
    train: FinetuneTrainConfig = setting(
        default_factory=lambda: FinetuneTrainConfig(learning_rate=5e-7), help="optimizer and batches"
    )
    output: FinetuneOutputConfig = setting(
        default_factory=lambda: FinetuneOutputConfig(dir="runs/dpo"), help="where the run writes and reports"
    )


# Which of the rows a command trains on were passed from Python (train_dataset, eval_dataset) instead of named by path.
NO_ROWS_PASSED = (False, False)


def check_data_source(data: DataConfig, passed: tuple[bool, bool] = NO_ROWS_PASSED) -> None:
    """Raise `ConfigError` unless each split comes from one place: its jsonl path or rows passed from Python."""
    for key, path, given, what in (
        ("data.train_path", data.train_path, passed[0], "train_dataset"),
        ("data.eval_path", data.eval_path, passed[1], "eval_dataset"),
    ):
        if path and given:
            raise ConfigError(f"{key} is {path!r} and a {what} was passed too; pass one ({key}: null with {what})")
    if not data.train_path and not passed[0]:
        raise ConfigError(
            "data.train_path is required: a jsonl file of training examples (or, from Python, train_dataset=rows)"
        )


def validate_finetune(
    config: SFTConfig | RewardModelConfig | DPOConfig, passed: tuple[bool, bool] = NO_ROWS_PASSED
) -> None:
    """Raise `ConfigError` for the first value that has the right type but makes no sense; `passed` says which of
    train_dataset and eval_dataset the caller gave."""
    check_settings(config)
    if config.model.lora.r:
        raise ConfigError(
            f"model.lora.r={config.model.lora.r}: LoRA is available for RL training (polo train) only; "
            "polo sft, dpo and rm fine-tune every weight (set model.lora.r=0)"
        )
    check_data_source(config.data, passed)
    check_output(config.output)
    check_device("train.device", config.train.device)


def load_finetune_config(
    cls: type, recipe: Any, overrides: list[str] | None = None, passed: tuple[bool, bool] = NO_ROWS_PASSED
) -> Any:
    """Return a validated `cls` (`SFTConfig`, `RewardModelConfig`, `DPOConfig`) from a recipe and overrides; `passed`
    says which of train_dataset and eval_dataset the caller gave (`check_data_source`)."""
    if isinstance(recipe, cls):
        recipe = config_to_dict(recipe)
    config = build_dataclass(cls, read_recipe(recipe, overrides))
    validate_finetune(config, passed)
    return config


def load_sft_config(
    recipe: str | Path | dict | SFTConfig | None = None, overrides: list[str] | None = None
) -> SFTConfig:
    """Return a validated `SFTConfig` from a recipe (path, mapping or config) and dotted overrides."""
    return load_finetune_config(SFTConfig, recipe, overrides)


def load_reward_model_config(
    recipe: str | Path | dict | RewardModelConfig | None = None, overrides: list[str] | None = None
) -> RewardModelConfig:
    """Return a validated `RewardModelConfig` from a recipe (path, mapping or config) and dotted overrides."""
    return load_finetune_config(RewardModelConfig, recipe, overrides)


def load_dpo_config(
    recipe: str | Path | dict | DPOConfig | None = None, overrides: list[str] | None = None
) -> DPOConfig:
    """Return a validated `DPOConfig` from a recipe (path, mapping or config) and dotted overrides."""
    return load_finetune_config(DPOConfig, recipe, overrides)
