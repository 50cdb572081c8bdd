"""polo: policy optimization from REINFORCE to GRPO.

Every command is a Python function, and the command line is a thin layer over them:

    polo.train(recipe, overrides)       polo train      RL of a causal LM (GRPO and its relatives)
    polo.sft(recipe, overrides)         polo sft        supervised fine-tuning on demonstrations
    polo.rm(recipe, overrides)          polo rm         a reward model on comparisons
    polo.dpo(recipe, overrides)         polo dpo        Direct Preference Optimization
    polo.evaluate(recipe, overrides)    polo eval       pass@k / cons@k of a model on a recipe's task
    polo.pipeline(recipe, overrides)    polo pipeline   multi-stage runs (R1: SFT, GRPO, rejection sampling)
    polo.control(recipe, overrides)     polo control    Gymnasium control tasks

`recipe` is a YAML path, a mapping or the command's config object; `overrides` are
`dotted.key=value` strings. Each returns a result dataclass. Examples: docs/api.md.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> (module, attribute). Imported on first use, so `import polo` loads neither torch nor transformers.
# `pipeline` and `control` are the subpackages themselves, which are callable (their __init__ says why).
_API = {
    "train": ("polo.rl.train", "train"),
    "sft": ("polo.finetune.sft", "sft"),
    "rm": ("polo.finetune.reward_model", "train_reward_model"),
    "dpo": ("polo.finetune.dpo", "dpo"),
    "evaluate": ("polo.evaluation.evaluate", "evaluate"),
    "pipeline": ("polo.pipeline", None),
    "control": ("polo.control", None),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'polo' has no attribute {name!r}")
    module_name, attribute = _API[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
