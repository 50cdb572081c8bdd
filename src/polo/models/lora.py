"""LoRA for RL training: low-rank adapters (peft) instead of full fine-tuning.

With `model.lora.r > 0` every targeted linear layer W (out, in) of the policy gains an adapter,

    h = W x + (alpha / r) · B A x,     A: (r, in),  B: (out, r),  B = 0 at the start,

and only A and B are trained: the first step's policy is exactly the base model, and Adam's state
and the gradients cover ~1% of the weights instead of all of them. Three things follow:

- The KL reference π_ref is the base model, which the policy already holds: it is scored with the
  adapters switched off (`reference_scope`), so no second copy of the model is kept.
- The base weights never change, so under `train.precision=bf16_master` they are simply kept in
  bf16 (no master copy); the adapters get fp32 masters like every trained weight.
- Sampling runs on merged weights W + (alpha / r) B A (`merged_for_sampling`): one matmul per
  layer and no adapter code in the decode loop (the adapter layers step aside for its duration).
  The merge is written into the base weights' own storage and the saved base copied back after,
  bit for bit: the base (and the reference) stay exact, and every parameter keeps its address
  (a captured CUDA graph of the decode step stays valid).
- A checkpoint holds the adapter (`adapter_config.json` + `adapter_model.safetensors`, fp32) and
  the tokenizer. `polo.models.loading.load_policy` on such a directory loads the base model it names
  and merges the adapter in, so `polo eval` and resuming work on it like on a full model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

from polo.config import ConfigError, LoraSettings

ADAPTER_CONFIG = "adapter_config.json"
ALL_LINEAR = "all-linear"


def is_adapter_dir(path: str | Path) -> bool:
    """Return whether `path` is a saved LoRA adapter (it has an adapter_config.json)."""
    return (Path(path) / ADAPTER_CONFIG).exists()


def adapter_base(path: str | Path) -> str:
    """Return the base model a saved adapter was trained on (its `base_model_name_or_path`)."""
    config_path = Path(path) / ADAPTER_CONFIG
    try:
        base = json.loads(config_path.read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path} is not a readable adapter config: {error}") from error
    if not base:
        raise ValueError(f"{config_path} does not name its base model (base_model_name_or_path)")
    return base


def add_adapters(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Return `model` wrapped as a peft model with fresh, trainable LoRA adapters (base weights frozen)."""
    from peft import LoraConfig, get_peft_model

    targets = ALL_LINEAR if list(settings.target_modules) == [ALL_LINEAR] else list(settings.target_modules)
    lora_config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora_config)
    except ValueError as error:  # peft: "Target modules {...} not found in the base model"
        names = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.target_modules={settings.target_modules}: {error}; this model's linear layers are {names} "
            f"(or use [{ALL_LINEAR}])"
        ) from error


def load_adapters(model: torch.nn.Module, path: str | Path, trainable: bool = True) -> torch.nn.Module:
    """Return `model` with the adapter saved in `path` attached (trainable, for resuming)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)


def merged(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Return `model` with the adapter in `path` merged into its weights: an ordinary model again."""
    return load_adapters(model, path, trainable=False).merge_and_unload()


def has_adapters(model: torch.nn.Module) -> bool:
    """Return whether `model` is a peft model (its trained weights are adapters)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def reference_scope(model: torch.nn.Module, reference: torch.nn.Module) -> AbstractContextManager:
    """Return the context `reference` is scored in: the adapters switched off when the reference is the LoRA policy
    itself."""
    if reference is model and has_adapters(model):
        return model.disable_adapter()
    return nullcontext()


@contextmanager
@torch.no_grad()
def merged_for_sampling(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Yield the model to sample from: for a LoRA policy, its base transformers model whose adapted
    layers are, for the block's duration, plain linear layers with merged weights W + (alpha / r) B A.

    For sampling and evaluation (no gradient): the decode loop then costs what the base model
    costs, with no adapter or peft wrapper code in it. Each adapter layer is replaced in its
    parent by its base layer, whose weight holds the merged values (in the base's dtype, written
    in place); afterwards the saved base values are copied back, bit for bit, and the adapter
    layers put back. No parameter changes its storage. A model without adapters is yielded as it is.
    """
    if not has_adapters(model):
        yield model
        return
    from peft.tuners.lora import LoraLayer

    swapped = []  # (parent, attribute, adapter layer, base layer, saved base weight or None)
    try:
        for name, module in list(model.named_modules()):
            if not isinstance(module, LoraLayer) or module.merged or module.disable_adapters:
                continue
            adapters = [adapter for adapter in module.active_adapters if adapter in module.lora_A]
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            base = module.get_base_layer()
            saved = base.weight.detach().clone() if adapters else None
            swapped.append((parent, attribute, module, base, saved))
            if adapters:
                merge_into(module, base.weight.detach(), adapters)
            setattr(parent, attribute, base)
        yield model.get_base_model()
    finally:
        for parent, attribute, module, base, saved in reversed(swapped):
            if saved is not None:
                base.weight.detach().copy_(saved)
            setattr(parent, attribute, module)


def merge_into(layer, weight: torch.Tensor, adapters: list[str]) -> None:
    """Add Σ scaling · B A over `adapters` of a peft LoRA layer into `weight` (its base weight), in place, in its
    dtype."""
    plain = not layer.fan_in_fan_out and not any(layer.use_dora.get(adapter, False) for adapter in adapters)
    if not plain:  # peft's own delta handles transposed and DoRA layers
        weight.copy_(weight.float() + sum(layer.get_delta_weight(adapter).float() for adapter in adapters))
        return
    for adapter in adapters:  # (out, in) + scaling * (out, r) @ (r, in), accumulated in fp32 by the matmul
        up, down = layer.lora_B[adapter].weight, layer.lora_A[adapter].weight
        weight.addmm_(up.to(weight.dtype), down.to(weight.dtype), alpha=layer.scaling[adapter])


def freeze_base_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the frozen (base) parameters of `model` to `dtype` in place; trained ones are left to `MasterWeights`."""
    for parameter in model.parameters():
        if not parameter.requires_grad:
            parameter.data = parameter.data.to(dtype)


def trainable_summary(model: torch.nn.Module) -> str:
    """Return e.g. "1,843,200 of 136,358,400 parameters trained (1.35%)"."""
    seen, total, trained = set(), 0, 0
    for parameter in model.parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        total += parameter.numel()
        trained += parameter.numel() if parameter.requires_grad else 0
    return f"{trained:,} of {total:,} parameters trained ({100 * trained / max(total, 1):.2f}%)"
