"""CPU linear-layer kernels: oneDNN-prepacked bf16 (or fp32) weights for sampling, a contiguous LM-head input, and fp32
training linears through oneDNN (forward and both gradients)."""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from polo.runtime.device import cpu_supports_bf16
from polo.runtime.optimizer import is_dtensor
from polo.runtime.rates import cache_key, cached_rates, pack_linear_weight, packed_linear, packing_available


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


@functools.cache
def packed_fp32_pays(key: str) -> bool:
    """Return whether this machine (`key`: `polo.runtime.rates.cache_key`) measured oneDNN's packed fp32 matmul faster
    than torch's own, asked once per process: the sampler asks every rollout, and a cache that cannot be written
    would otherwise cost a measurement each time."""
    return cached_rates().packed_fp32_faster


def onednn_fp32_pays() -> bool:
    """Return whether fp32 matmuls on this CPU go through oneDNN (`onednn_linear`): this build has its matmul op and
    this machine measured it faster than torch's own (`packed_fp32_pays`)."""
    return packing_available() and packed_fp32_pays(cache_key())


def _can_prepack() -> bool:
    """Return True where bf16 weights are packed: a CPU with native bf16 and a torch that can pack."""
    return packing_available() and cpu_supports_bf16()


@contextlib.contextmanager
def prepacked_linears(model, batch_hint: int, fp32: bool = False, bf16: bool = True):
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
    which on one AVX-512 CPU ran at ~215 GFLOP/s where oneDNN's packed kernel ran at ~490 (1,024
    rows; torch 2.13). At decode sizes: 64 rows x 576 -> 1,536 took 243 µs against 587, the LM head
    (576 -> 49,152) 9.1 ms against 30.3. The sums are taken in another order, so fp32 outputs differ
    from `F.linear`'s in the last bits (~1e-4 absolute on outputs of size ~10).

    Sibling projections that read one input (`MERGED_PROJECTIONS`: q, k, v; gate, up) are packed as
    one matrix and multiplied once; each layer still returns its own output.

    A scoring forward (the KL reference: thousands of rows, each layer called once) gains nothing
    from packing ahead; its fp32 layers go through `OneDnnLinear`, which this block takes over and
    gives back.
    """
    patched = []
    dtypes = ({torch.bfloat16} if bf16 and _can_prepack() else set()) | ({torch.float32} if fp32 else set())

    def packable(module) -> bool:
        weight = getattr(module, "weight", None)
        return (
            type(module) is torch.nn.Linear
            and weight.dtype in dtypes
            and weight.device.type == "cpu"
            and not is_dtensor(weight)
        )

    try:
        merged = set()
        for parent in model.modules():
            for names in MERGED_PROJECTIONS:
                layers = [getattr(parent, name, None) for name in names]
                if all(packable(layer) for layer in layers) and _mergeable(layers):
                    patched.extend(_merge_projections(layers, batch_hint))
                    merged.update(layers)
        for module in model.modules():
            if module not in merged and packable(module):
                bias = module.bias.detach() if module.bias is not None else None
                packed = pack_linear_weight(module.weight.detach(), batch_hint)
                if packed is None:
                    raise RuntimeError("oneDNN cannot pack this weight")
                patched.append((module, module.__dict__.get("forward")))
                module.forward = functools.partial(packed_linear, packed=packed, bias=bias)
    except RuntimeError:  # an op this build cannot run: sample with the plain layers
        _restore(patched)
        patched = []
    try:
        yield
    finally:
        _restore(patched)


# Sibling projections that read the same input, multiplied as one packed matmul while sampling (the names every
# Llama-like family in transformers uses). At 32 rows on a CPU with bf16 at ~420 GFLOP/s, 30 layers
# of SmolLM2-135M per decode step: q, k, v 5.43 ms apart against 3.79 merged; gate, up 11.09 against 10.21 (the same
# bf16 outputs bit for bit there). Alone, k and v (576 -> 192) ran at ~120 GFLOP/s, under half the wide layers' rate.
MERGED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _mergeable(layers: list) -> bool:
    """Return whether `layers` (plain linears) can be one matmul: one input width and dtype, biases on all or none."""
    first = layers[0]
    return all(
        layer.in_features == first.in_features
        and layer.weight.dtype is first.weight.dtype
        and (layer.bias is None) == (first.bias is None)
        for layer in layers
    ) and len({id(layer) for layer in layers}) == len(layers)


class _MergedOutputs:
    """The last merged product: the input it was taken for and the slices the other layers have not yet returned."""

    def __init__(self):
        self.input, self.slices = None, {}


def _merge_projections(layers: list, batch_hint: int) -> list:
    """Pack `layers`' weights as one (Σ out, in) matrix and make the first layer's call compute every layer's output.

    The first layer returns its own columns of the product and keeps the others' until they are asked
    for with the same input tensor; a call with any other input runs that layer's own weight. Returns
    the (module, previous forward) pairs for `_restore`.
    """
    weights = torch.cat([layer.weight.detach() for layer in layers])
    biases = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
    packed = pack_linear_weight(weights, batch_hint)
    if packed is None:
        raise RuntimeError("oneDNN cannot pack this weight")
    bounds = [0]
    for layer in layers:
        bounds.append(bounds[-1] + layer.out_features)
    state = _MergedOutputs()
    patched = [(layer, layer.__dict__.get("forward")) for layer in layers]

    def first(x: torch.Tensor) -> torch.Tensor:
        product = packed_linear(x, packed=packed, bias=biases)
        columns = [product[..., start:end] for start, end in zip(bounds, bounds[1:])]
        state.input, state.slices = x, dict(enumerate(columns[1:], start=1))
        return columns[0]

    def other(x: torch.Tensor, index: int, layer: torch.nn.Linear) -> torch.Tensor:
        if state.input is x and index in state.slices:
            out = state.slices.pop(index)
            if not state.slices:
                state.input = None  # let the input go once every slice is handed out
            return out
        return torch.nn.functional.linear(x, layer.weight, layer.bias)

    layers[0].forward = first
    for index, layer in enumerate(layers[1:], start=1):
        layer.forward = functools.partial(other, index=index, layer=layer)
    return patched


def _restore(patched: list) -> None:
    """Give each (module, forward it had before) back that forward: its training forward (`use_onednn_linears`), or
    the class's own where it had none of its own."""
    for module, previous in patched:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


# The fewest input or output features a training linear needs to go through oneDNN: LoRA's rank-r factors (r of 4
# to 32) are left to torch, which multiplied such skinny shapes faster (2,088 rows: 576 -> 16 in 0.69 ms against
# oneDNN's 0.94 for the three products; 576 -> 64 was 2.3 against 1.9).
ONEDNN_MIN_FEATURES = 64


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Return x · weightᵀ (+ bias) through oneDNN's matmul: x (..., in), weight (out, in) -> (..., out).

    The weight is not packed ahead: oneDNN reorders it within the call, which at training sizes
    (thousands of rows) costs little against the matmul itself. A transposed view is passed as it is:
    as the weight, oneDNN reads its strides while it reorders; as a 2-d input, the op copies it
    itself. Copying both here first had cost more (2,160 rows, 576 -> 1,536: ∂x 8.5 against 10.2 ms
    with Wᵀ copied, ∂W 11.1 against 12.7 with gᵀ and xᵀ).
    """
    return torch.ops.mkldnn._linear_pointwise(x if x.dim() == 2 else x.contiguous(), weight, bias, "none", [], "")


class OneDnnLinear(torch.autograd.Function):
    """y = x · Wᵀ + b with the forward and both gradient matmuls through oneDNN (`onednn_linear`), for fp32 on the CPU.

    forward(x (..., in), weight (out, in), bias (out,) or None) -> (..., out). Backward, with
    g = ∂L/∂y as (rows, out): ∂L/∂x = g · W, ∂L/∂W = gᵀ · x, ∂L/∂b = Σ_rows g. Each gradient is
    one oneDNN call on transposed views (Wᵀ is (in, out); gᵀ and xᵀ are (out, rows) and
    (in, rows)); see `onednn_linear` for what each view costs.

    Why by hand: torch's CPU wheels multiply fp32 with MKL's sgemm, which on one AVX-512 CPU
    ran at ~190-215 GFLOP/s where oneDNN ran at 300-490 for the same products (SmolLM2-135M's
    layer shapes over 2,088 rows, torch 2.13: forward 473 against 189, ∂x 426 against 215, ∂W
    333 against 211), and no library routes a training linear's three products there.
    `use_onednn_linears` installs it only where `polo.runtime.rates` measured oneDNN faster.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad_output.reshape(-1, weight.shape[0])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad, weight.t()).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_linear(grad.t(), x.reshape(-1, weight.shape[1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _onednn_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear`'s forward through `OneDnnLinear` where its operands are plain fp32 CPU tensors, else its own."""
    if (
        x.dtype is torch.float32
        and self.weight.dtype is torch.float32
        and x.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")  # autocast would have cast F.linear's operands
    ):
        return OneDnnLinear.apply(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route `model`'s fp32 CPU `nn.Linear` layers through `OneDnnLinear`; return how many are routed.

    Left alone: a shard of an FSDP model (a DTensor, whose forward gathers the weight), layers with
    fewer than `ONEDNN_MIN_FEATURES` inputs or outputs, other dtypes, and builds without oneDNN's
    matmul op. Already routed layers are counted again, not wrapped twice. The sampler's
    `prepacked_linears` takes a layer over for its block and gives this forward back after.
    """
    if not packing_available():
        return 0
    routed = 0
    for module in model.modules():
        if getattr(module, "_polo_onednn", False):
            routed += 1
            continue
        weight = getattr(module, "weight", None)
        if (
            type(module) is torch.nn.Linear
            and weight.dtype is torch.float32
            and weight.device.type == "cpu"
            and not is_dtensor(weight)
            and min(module.in_features, module.out_features) >= ONEDNN_MIN_FEATURES
        ):
            module.forward = types.MethodType(_onednn_linear_forward, module)
            module._polo_onednn = True
            routed += 1
    return routed
