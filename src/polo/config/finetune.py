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
        32, help="examples per optimizer step: demonstrations (sft) or rankings (rm, dpo)", range=">= 1"
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


def validate_finetune(config: SFTConfig | RewardModelConfig | DPOConfig) -> None:
    """Raise `ConfigError` for the first value that has the right type but makes no sense."""
    check_settings(config)
    if config.model.lora.r:
        raise ConfigError(
            f"model.lora.r={config.model.lora.r}: LoRA is available for RL training (polo train) only; "
            "polo sft, dpo and rm fine-tune every weight (set model.lora.r=0)"
        )
    if not config.data.train_path:
        raise ConfigError("data.train_path is required: a jsonl file of training examples")
    check_output(config.output)
    check_device("train.device", config.train.device)


def load_finetune_config(cls: type, recipe: Any, overrides: list[str] | None = None) -> Any:
    """Return a validated `cls` (`SFTConfig`, `RewardModelConfig`, `DPOConfig`) from a recipe and overrides."""
    if isinstance(recipe, cls):
        recipe = config_to_dict(recipe)
    config = build_dataclass(cls, read_recipe(recipe, overrides))
    validate_finetune(config)
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
