"""CPU linear-layer kernels for sampling: oneDNN-prepacked bf16 (or fp32) weights and a contiguous LM-head input."""

from __future__ import annotations

import contextlib
import functools

import torch

from polo.runtime.device import cpu_supports_bf16
from polo.runtime.optimizer import is_dtensor
from polo.runtime.rates import pack_linear_weight, packed_linear, packing_available


@contextlib.contextmanager
def contiguous_head_input(model):
    """Within the block, the output layer's input is made contiguous before its matmul.

    The prefill asks for the last position's logits only (`logits_to_keep=1`), so the LM head
    sees a strided (prompts, 1, hidden) view. For a weight that does not require grad (a frozen
    or LoRA base model) `torch.matmul` will not fold such a view into one mm: it expands the
    whole (hidden, vocab) weight per prompt for a bmm, a ~0.2 GB copy per prefill on SmolLM2
    (measured: 0.37 s of a 4.2 s rollout). Copying the (prompts, hidden) input instead is free.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    handle = None
    if isinstance(head, torch.nn.Module):
        handle = head.register_forward_pre_hook(
            lambda module, args: (args[0].contiguous(), *args[1:]) if args else None
        )
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _can_prepack() -> bool:
    """Return True where bf16 weights are packed: a CPU with native bf16 and a torch that can pack."""
    return packing_available() and cpu_supports_bf16()


def _pack_and_multiply(x: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Return x · weightᵀ (+ bias) through a packed copy of `weight` made for this call alone."""
    return packed_linear(x, packed=pack_linear_weight(weight.detach(), rows), bias=bias)


@contextlib.contextmanager
def prepacked_linears(
    model, batch_hint: int, fp32: bool = False, bf16: bool = True, skip: tuple = (), on_call: bool = False
):
    """Within the block, `model`'s bf16 CPU linear layers (with `bf16`) and fp32 ones (with `fp32`) multiply with
    weights packed once for oneDNN. A shard of an FSDP model (a DTensor) is left alone: its forward gathers the whole
    weight.

    A plain bf16 `F.linear` lets oneDNN repack the weight into its blocked AMX layout on every
    call; a decode step has only ~32 rows, so that repacking is most of its cost. Packing each
    weight once per rollout (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's
    CPU freezing pass uses) and calling the packed matmul gave the same outputs bit for bit and,
    for SmolLM2-135M with 32 rows, 1.5x faster layer matmuls and a 2.3x faster LM head. The
    packed copies (one model's worth) live only for the block. No-op on CPUs without native
    bf16 (for bf16 weights), for other dtypes, and where the ops are missing.

    fp32 layers too with `fp32`, which the caller sets where `polo.runtime.rates` measured packed
    fp32 faster than torch's own fp32 matmul. torch's CPU wheels multiply fp32 with MKL's sgemm,
    which on a 2-core AMD EPYC ran at ~215 GFLOP/s where oneDNN's packed kernel ran at ~490 (1,024
    rows; torch 2.13). At decode sizes: 64 rows x 576 -> 1,536 took 243 µs against 587, the LM head
    (576 -> 49,152) 9.1 ms against 30.3. The sums are taken in another order, so fp32 outputs differ
    from `F.linear`'s in the last bits (~1e-4 absolute on outputs of size ~10). The modules in `skip`
    are left as they are.

    With `on_call`, a layer packs its weight when called and drops it after: for a forward that
    calls each layer once (scoring one micro-batch) the same packing work, with one layer's packed
    copy alive at a time instead of the model's (~430 MB of fp32 copies for SmolLM2-135M).
    """
    patched = []
    dtypes = ({torch.bfloat16} if bf16 and _can_prepack() else set()) | ({torch.float32} if fp32 else set())
    try:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if (
                type(module) is torch.nn.Linear
                and not any(module is other for other in skip)
                and weight.dtype in dtypes
                and weight.device.type == "cpu"
                and not is_dtensor(weight)
            ):
                bias = module.bias.detach() if module.bias is not None else None
                if on_call:
                    if pack_linear_weight(weight.detach()[:1], batch_hint) is None:  # can this build pack it at all
                        raise RuntimeError("oneDNN cannot pack this weight")
                    forward = functools.partial(_pack_and_multiply, weight=weight, bias=bias, rows=batch_hint)
                else:
                    packed = pack_linear_weight(weight.detach(), batch_hint)
                    if packed is None:
                        raise RuntimeError("oneDNN cannot pack this weight")
                    forward = functools.partial(packed_linear, packed=packed, bias=bias)
                module.forward = forward
                patched.append(module)
    except RuntimeError:  # an op this build cannot run: sample with the plain layers
        for module in patched:
            del module.forward
        patched = []
    try:
        yield
    finally:
        for module in patched:
            del module.forward
