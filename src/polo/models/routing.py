"""The routers of a mixture-of-experts model, recorded over a forward: their load and load-balancing loss.

transformers names a model's router in `_can_record_outputs["router_logits"]` (the module class whose
output, at an index, is the (tokens, experts) logits); polo finds the routers that way, whatever the
family, and hooks them for the length of one scoring forward (`recorded_routing`). Any scoring layout
works: the plain [prompt | completion] rows, the shared-prompt layout, the unpadded row of real tokens.
The decoder's own input says which tokens are padding (its 2-D attention mask; the unpadded row's filler
tokens at its end), so that they count in neither the load nor the loss. The hooks are gone before
backward, so a layer recomputed there (gradient checkpointing) is not counted twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from polo.config.errors import ConfigError
from polo.core.routing import RouterLoad, router_load
from polo.runtime.parallel import sum_over_ranks


def router_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Return (module, index) for each module of `model` whose output at `index` is router logits; [] for a dense
    model."""
    targets: dict[type, int] = {}
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            targets[getattr(recorder, "target_class", recorder)] = getattr(recorder, "index", 0)
    return [(module, targets[type(module)]) for module in model.modules() if type(module) in targets]


def experts_per_token(model: torch.nn.Module) -> int | None:
    """Return how many experts each token is routed to (`num_experts_per_tok`, or its older names), None if unknown."""
    config = getattr(model, "config", None)  # a bare module (a test's policy) has none, and no routers
    if config is None:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class RoutingRecord:
    """The logits of every router call and the real-token mask of every decoder call within `recorded_routing`."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.logits: list[torch.Tensor] = []
        self.masks: list[torch.Tensor | None] = []  # one per decoder call, for the router calls after it
        self.owner: list[int] = []  # the decoder call each router call belongs to

    def load(self) -> RouterLoad | None:
        """Return the load over every recorded router call (`polo.core.routing.router_load`), None when none ran."""
        if not self.logits:
            return None
        calls: dict[int, list[torch.Tensor]] = {}
        for owner, logits in zip(self.owner, self.logits):
            calls.setdefault(owner, []).append(logits)
        loads = [
            router_load(logits, self.top_k, self.masks[owner] if owner >= 0 else None)
            for owner, logits in calls.items()
        ]
        if len(loads) == 1:
            return loads[0]
        return RouterLoad(
            sum(load.assigned for load in loads) / len(loads),
            sum(load.probability for load in loads) / len(loads),
            self.top_k,
        )


def _real_tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Return the flat (batch·len,) real-token mask of a decoder call's input, or None where every token is real."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None:
        return None
    batch, length = input_ids.shape
    mask = kwargs.get("attention_mask")
    layout = kwargs.get("shared_layout")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # a prompt cached before these tokens adds leading columns
        return mask[:, -length:].reshape(-1)
    if layout is not None and getattr(layout, "block_position", None) is not None:
        real = torch.zeros(batch * length, device=input_ids.device)
        real[: layout.block_position.numel()] = 1.0  # the unpadded row's filler tokens come last
        return real
    return None


@contextlib.contextmanager
def recorded_routing(model: torch.nn.Module) -> Iterator[RoutingRecord | None]:
    """Record `model`'s router logits over the forwards within that build a graph (a training forward, not a probe
    or a scoring without gradient); yield the record, or None for a model without routers."""
    routers = router_modules(model)
    top_k = experts_per_token(model) if routers else None
    if not routers or top_k is None:
        yield None
        return
    record = RoutingRecord(top_k)

    def on_decoder(module, args, kwargs):
        if torch.is_grad_enabled():
            record.masks.append(_real_tokens(args, kwargs))

    def on_router(index: int):
        def hook(module, args, output):
            if not torch.is_grad_enabled():  # a probe's or a scoring forward's: not the update's
                return
            record.logits.append(output[index] if isinstance(output, tuple) else output)
            record.owner.append(len(record.masks) - 1)  # -1: no decoder call seen, every token real

        return hook

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    handles = [decoder.register_forward_pre_hook(on_decoder, with_kwargs=True)]
    handles += [router.register_forward_hook(on_router(index)) for router, index in routers]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


class RoutingSums:
    """An MoE policy's routing over an update's micro-batches (every rank's): balancing loss and expert load."""

    def __init__(self):
        self.loss, self.assigned, self.calls = 0.0, None, 0

    def add(self, record, coef: float, micro_batches: float) -> torch.Tensor | float:
        """Return coef · the micro-batch's load-balancing loss / micro-batches (each micro-batch weighs the same, as
        TRL's gradient accumulation weighs it), and count its expert load; 0 for a model without routers."""
        load = None if record is None else record.load()
        if load is None:
            return 0.0
        balancing = load.balancing_loss()
        self.loss += float(balancing.detach())
        fractions = load.expert_fractions()
        self.assigned = fractions if self.assigned is None else self.assigned + fractions
        self.calls += 1
        return coef * balancing / micro_batches if coef else 0.0

    def metrics(self) -> dict:
        """Return `router/aux_loss` (the unweighted loss, averaged over micro-batches and ranks) and the expert load:
        `router/expert_load/max` and `min` (fractions of the routed token slots, averaged over layers), and each
        expert's as `router/expert_load/NNN` for up to 64 experts; {} for a dense policy."""
        if not self.calls:
            return {}
        load = self.assigned.cpu()
        sums = {"loss": self.loss, "calls": float(self.calls), **{str(e): float(v) for e, v in enumerate(load)}}
        totals = sum_over_ranks(sums)
        load = torch.tensor([totals[str(e)] for e in range(load.numel())]) / totals["calls"]
        metrics = {"router/aux_loss": totals["loss"] / totals["calls"]}
        metrics["router/expert_load/max"], metrics["router/expert_load/min"] = float(load.max()), float(load.min())
        if load.numel() <= 64:
            metrics.update({f"router/expert_load/{index:03d}": float(value) for index, value in enumerate(load)})
        return metrics


def check_router_loss(model: torch.nn.Module, coef: float, key: str = "algorithm.router_aux_loss_coef") -> None:
    """Raise ConfigError when `coef` asks for a load-balancing loss and `model` has no router polo can record."""
    if coef and (not router_modules(model) or experts_per_token(model) is None):
        raise ConfigError(
            f"{key}={coef} weights a mixture-of-experts router's load-balancing loss, but "
            f"{type(model).__name__} has no router (a dense model); set it to 0"
        )
