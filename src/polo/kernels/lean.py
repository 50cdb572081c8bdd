"""Lean layers: RMSNorm and the SwiGLU product with the same forward, keeping a fraction of the activations.

transformers' RMSNorm (Llama, Qwen2, Mistral, SmolLM) upcasts its input to fp32 and runs six
element-wise ops, and autograd keeps what each of them needs: 5.8 KB per token for SmolLM2's
576-wide bf16 hidden states, five times the input itself. `LeanRMSNorm` keeps the input and one
fp32 scale per token (1.2 KB) and recomputes the rest in backward; the forward is the same
sequence of roundings, so its output is bit for bit transformers'. `SiluMul`, the `act(gate) * up`
of a SwiGLU MLP, keeps gate and up and recomputes the activation (3 KB less per token at SmolLM2's
1,536-wide MLP). Together they cut the activations a decoder layer keeps for backward from
~28.7 KB to ~16.5 KB per token (measured on SmolLM2-135M under bf16_master), and the norm's
forward + backward runs ~20 % faster (2.4 against 3.0 ms for 2,176 tokens, bf16 on an AVX-512 BF16 CPU).

No library ships these for the CPU (fused kernels such as Liger's are Triton, for GPUs), hence
the hand-written backward; `use_lean_layers` swaps them in only where a probe shows the module
computes exactly what the lean version does.

On CPU float32 / bfloat16 tensors, the forwards and backwards run polo's native kernels
(polo.kernels.cpu.native, norms.cpp) where they build: the same roundings in one or two passes
over each row, where torch's ops take one pass per op. Only the order of a row's sums differs, so a
result may move by an ulp; the torch code below stays the reference, which `torch_path()` selects
and the probe of `use_lean_layers` compares modules with (bit for bit), while tests hold the native
kernels to the reference within an ulp or two. On an AVX-512 BF16 CPU, bf16, best of 50 (torch → native):
the norm of 1,656 x 576 0.30 → 0.10 ms forward, 2.4 → 0.35 ms forward + backward; the SwiGLU
product of 1,656 x 1,536 0.61 → 0.58 ms forward (silu's exp costs the same in both) and 3.2 → 2.0
ms forward + backward; a 64-row decode step's norm 31 → 11 us, its product about even.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
import weakref

import torch

from polo.kernels.cpu.native import native_ops

__all__ = ["LeanRMSNorm", "Rotary", "SiluMul", "SwiGLUDown", "norm_outputs_recomputed", "torch_path", "use_lean_layers"]

# An attention module's parts that `_lean_attention_forward` calls: Llama's and Qwen2's (no q/k norms).
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "config", "attention_dropout")
_TORCH_ONLY = contextvars.ContextVar("polo_lean_torch_only", default=False)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@contextlib.contextmanager
def torch_path():
    """Run the lean layers on torch's ops (the reference), not polo's native kernels, within this block.

    An autograd Function whose forward ran here runs its backward on torch's ops too, wherever that happens.
    """
    token = _TORCH_ONLY.set(True)
    try:
        yield
    finally:
        _TORCH_ONLY.reset(token)


def _native(*tensors: torch.Tensor):
    """Return polo's native ops for CPU float32 / bfloat16 `tensors` outside `torch_path()`, else None.

    None inside a `torch.compile` region (the static sampler's captured decode step): the native ops
    are opaque to the compiler, and Dynamo cannot read the context variable. The device is looked at
    before the context variable for the same reason.
    """
    if torch.compiler.is_compiling():
        return None
    if any(t.device.type != "cpu" or t.dtype not in _NATIVE_DTYPES for t in tensors) or _TORCH_ONLY.get():
        return None
    return native_ops()  # built or loaded on first use, cached; None where it cannot build or POLO_NATIVE=0


def _native_norm(hidden: torch.Tensor, weight: torch.Tensor):
    """Return the native ops where they take this norm: a (..., d) input and a (d,) weight on the CPU."""
    if weight.dim() != 1 or hidden.dim() == 0 or hidden.shape[-1] != weight.shape[0]:
        return None
    return _native(hidden, weight)


def _native_product(gate: torch.Tensor, up: torch.Tensor):
    """Return the native ops where they take this product: gate and up of one shape and dtype on the CPU."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    return _native(gate, up)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (weight · dtype(x · rstd), rstd), rstd = rsqrt(mean(x², -1) + eps) in fp32; x (..., d), rstd (..., 1)."""
    upcast = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
    rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (upcast * rstd).to(hidden.dtype), rstd


class LeanRMSNorm(torch.autograd.Function):
    """y = weight · dtype(x · rsqrt(mean(x², -1) + eps)), the statistics in fp32; x (..., d), weight (d,).

    Saves x and rstd (..., 1) fp32 only. Backward, with x̂ = x · rstd and g = dy · weight:
        dx = rstd · (g − x̂ · mean(g · x̂, -1))        dweight = Σ dy · dtype(x̂)
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ops = _native_norm(hidden, weight)
        out, rstd = rms_norm(hidden, weight, eps) if ops is None else ops.rms_norm(hidden, weight, eps)
        ctx.save_for_backward(hidden, rstd, weight)
        ctx.native = ops is not None
        recipes = _RECIPES.get()
        if recipes is not None:
            recipes.register(out, _NormRecipe(hidden, rstd, weight, eps, ops is not None, out._version))
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden, rstd, weight = ctx.saved_tensors
        if ctx.native and grad_output.dtype == torch.result_type(hidden, weight):
            grad_hidden, grad_weight = native_ops().rms_norm_backward(
                grad_output, hidden, rstd, weight, ctx.needs_input_grad[1]
            )
            return grad_hidden, grad_weight, None
        normed = hidden.to(rstd.dtype) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rows = (grad_output * normed.to(hidden.dtype)).reshape(-1, hidden.shape[-1])
            grad_weight = rows.sum(0, dtype=torch.float32).to(weight.dtype)
        grad_normed = (grad_output * weight).to(rstd.dtype)
        grad_hidden = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_hidden.to(hidden.dtype), grad_weight, None


class SiluMul(torch.autograd.Function):
    """silu(gate) · up, (..., m) each; saves gate and up, recomputing silu(gate) in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ops = _native_product(gate, up)
        ctx.native = ops is not None
        return torch.nn.functional.silu(gate) * up if ops is None else ops.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.native and grad_output.dtype == gate.dtype:
            return native_ops().silu_mul_backward(grad_output, gate, up, list(ctx.needs_input_grad))
        return silu_mul_grads(grad_output, gate, up, ctx.needs_input_grad)


def silu_mul_grads(grad_output: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, needs) -> tuple:
    """Return (dgate, dup) of silu(gate) · up on torch's ops, None where `needs` (two bools) says no; all (..., m)."""
    grad_gate = grad_up = None
    if needs[0]:
        # aten's silu_backward: dy · σ(x)·(1 + x·(1 − σ(x))) in one pass, in fp32 for bf16 inputs (the
        # same formula as separate ops took seven passes over the (tokens, m) tensors: 7.1 ms a layer
        # of the demo's update, 1,808 tokens x 1,536)
        grad_gate = torch.ops.aten.silu_backward(grad_output * up, gate)
    if needs[1]:
        grad_up = grad_output * torch.nn.functional.silu(gate)
    return grad_gate, grad_up


class SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) · up) for a bias-free down projection, weight (out, m); gate, up (..., m); out (..., out).

    The down projection's own backward would keep its input, the product h = silu(gate) · up (3 KB a
    token per layer at SmolLM2's 1,536-wide bf16 MLP, a sixth of what a layer keeps). This saves gate
    and up alone, which the product's backward needs anyway, and recomputes h in backward: natively
    in the same pass as dgate and du, where h costs one more store. Backward, as torch's linear and
    `SiluMul` compute it, product by product:
        dh = dy · weight        dweight = (hᵀ · dy)ᵀ        dgate, dup = SiluMul's backward of dh
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ops = _native_product(gate, up)
        product = torch.nn.functional.silu(gate) * up if ops is None else ops.silu_mul(gate, up)
        ctx.save_for_backward(gate, up, weight)
        ctx.native = ops is not None
        return torch.nn.functional.linear(product, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_product = rows.mm(weight).view(gate.shape)
        needs = list(ctx.needs_input_grad[:2])
        if ctx.native and grad_product.dtype == gate.dtype:
            grad_gate, grad_up, product = native_ops().silu_mul_backward_with_product(grad_product, gate, up, needs)
        else:
            product = torch.nn.functional.silu(gate) * up
            grad_gate, grad_up = silu_mul_grads(grad_product, gate, up, needs)
        grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = product.reshape(-1, product.shape[-1]).t().mm(rows).t()
        return grad_gate, grad_up, grad_weight


def _fuses_down(down: torch.nn.Module, gate: torch.Tensor) -> bool:
    """Return whether `SwiGLUDown` computes what `down(product)` would: a plain bias-free `nn.Linear` (no LoRA
    wrapper, no replaced forward, no hooks) in the product's dtype, outside autocast."""
    return (
        type(down) is torch.nn.Linear
        and down.bias is None
        and type(down.weight.detach()) is torch.Tensor  # not a sharded (DTensor) weight
        and "forward" not in vars(down)
        and not (down._forward_hooks or down._forward_pre_hooks)
        and down.weight.dtype == gate.dtype
        and not torch.is_autocast_enabled(gate.device.type)
    )


class _NormRecipe:
    """What recomputes a lean RMSNorm's output: its input, per-token rstd and weight (all kept by the norm itself)."""

    __slots__ = ("hidden", "rstd", "weight", "eps", "native", "version", "geometry")

    def __init__(self, hidden, rstd, weight, eps: float, native: bool, version: int = 0, geometry=None):
        self.hidden, self.rstd, self.weight, self.eps, self.native = hidden, rstd, weight, eps, native
        self.version, self.geometry = version, geometry

    def output(self) -> torch.Tensor:
        """Return the norm's output again, bit for bit (the same kernel on the same operands)."""
        ops = native_ops() if self.native else None
        if ops is None:
            return rms_norm(self.hidden, self.weight, self.eps)[0]
        return ops.rms_norm(self.hidden, self.weight, self.eps)[0]


class _NormOutputs:
    """The saved-tensor hooks of `norm_outputs_recomputed`: a registry of the scope's norm outputs, by storage."""

    def __init__(self):
        self.outputs: dict[int, tuple[weakref.ref, _NormRecipe]] = {}
        self.last: tuple[_NormRecipe, torch.Tensor] | None = None  # the latest recomputed output (q, k and v share it)

    def register(self, out: torch.Tensor, recipe: _NormRecipe) -> None:
        if out.is_contiguous() and out.storage_offset() == 0:
            self.outputs[out.untyped_storage().data_ptr()] = (weakref.ref(out), recipe)

    def pack(self, tensor: torch.Tensor):
        if not self.outputs or tensor.layout != torch.strided:
            return tensor
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional or fake tensor)
            return tensor
        entry = self.outputs.get(storage.data_ptr())
        if entry is None:
            return tensor
        out = entry[0]()
        recipe = entry[1]
        if out is None or out.untyped_storage().nbytes() != storage.nbytes() or out.dtype != tensor.dtype:
            return tensor  # a norm output that is gone, its memory now someone else's
        if tensor._version != recipe.version:
            return tensor  # changed in place since the norm wrote it: keep what is there now
        geometry = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), out.shape)
        return _NormRecipe(
            recipe.hidden, recipe.rstd, recipe.weight, recipe.eps, recipe.native, recipe.version, geometry
        )

    def unpack(self, packed):
        if not isinstance(packed, _NormRecipe):
            return packed
        size, stride, offset, shape = packed.geometry
        if self.last is None or self.last[0].hidden is not packed.hidden or self.last[0].weight is not packed.weight:
            self.last = (packed, packed.output().reshape(shape))
        return self.last[1].as_strided(size, stride, offset)


_RECIPES: contextvars.ContextVar[_NormOutputs | None] = contextvars.ContextVar("polo_norm_outputs", default=None)


@contextlib.contextmanager
def norm_outputs_recomputed():
    """Within: the output of a lean RMSNorm that a later op keeps for backward is kept as the norm's own saved
    tensors instead, and recomputed in backward.

    The projections after a norm (q, k and v after the attention's; gate and up after the MLP's) keep
    its output for their weight gradients: 1.2 KB a token each at SmolLM2's 576-wide bf16 hidden
    states, 2.3 KB of the ~17 KB a decoder layer keeps. The norm keeps its input and an fp32 rstd
    per token anyway, from which the output comes back bit for bit in one pass (~0.1 ms for 2,000
    tokens). torch's saved-tensor hooks do the swap; a tensor saved inside an activation-checkpointed
    layer goes to the checkpoint's own hooks, which are innermost, and never reaches these.
    """
    outputs = _NormOutputs()
    token = _RECIPES.set(outputs)
    try:
        with torch.autograd.graph.saved_tensors_hooks(outputs.pack, outputs.unpack):
            yield
    finally:
        _RECIPES.reset(token)
        outputs.outputs.clear()  # packing is over: the graph holds what it packed; let the norms' tensors go with it


class Rotary(torch.autograd.Function):
    """The rotary position embedding of queries or keys in one native call each way; states (rows, heads, d), cos and
    sin (rows, 1, d).

    forward: x(x(q · cos) + x(rot(q) · sin)), rot(q) = [−q₂, q₁] over the halves of d, the roundings of
    the five ops transformers runs (decode_step.cpp). The map is linear in q, and its transpose is the
    same kernel with sin′ = [−sin₂, −sin₁]:
        dq₁ = g₁ · cos₁ + g₂ · sin₂        dq₂ = g₂ · cos₂ − g₁ · sin₁
    one rounding per product and one for their sum, as torch's backward of those ops rounds. Saves cos and
    sin only (shared by every layer), where the ops keep nothing more either.
    """

    @staticmethod
    def forward(ctx, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return native_ops().rotary(states, cos, sin)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        cos, sin = ctx.saved_tensors
        half = sin.shape[-1] // 2
        turned = torch.cat((sin[..., half:], sin[..., :half]), dim=-1).neg()
        return native_ops().rotary(grad_output, cos, turned), None, None


def rotary_embedding(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return states · cos + rot(states) · sin, states (rows, heads, d), cos and sin (rows, 1, d): `Rotary` where the
    native kernel takes the dtypes, else torch's ops in transformers' order (a LoRA projection may return fp32)."""
    if states.dtype == cos.dtype == sin.dtype and _native(states, cos, sin) is not None:
        return Rotary.apply(states, cos, sin)
    half = states.shape[-1] // 2
    return states * cos + torch.cat((-states[..., half:], states[..., :half]), dim=-1) * sin


def _lean_attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    """A Llama / Qwen2 attention's forward with the rotary embedding in `Rotary`; the module's own forward wherever
    polo's native kernels do not run, and for any call with a cache (sampling, where polo's decode step has its own)."""
    own = type(self).forward
    if position_embeddings is None or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return own(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    cos, sin = position_embeddings
    if cos.dtype != hidden_states.dtype or _native(hidden_states, cos, sin) is None:
        return own(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kwargs = {key: value for key, value in kwargs.items() if key not in ("cache", "past_key_values")}  # both None
    lead = hidden_states.shape[:-1]  # (batch, length)
    rows = lead.numel()
    cos = cos.expand(*lead, -1).reshape(rows, 1, -1)
    sin = sin.expand(*lead, -1).reshape(rows, 1, -1)

    def heads(projection, rotate: bool) -> torch.Tensor:  # (batch, heads, length, head_dim), as the module lays them
        states = projection(hidden_states).view(rows, -1, self.head_dim)
        if rotate:
            states = rotary_embedding(states, cos, sin)
        return states.view(*lead, -1, self.head_dim).transpose(1, 2)

    eager = getattr(sys.modules[type(self).__module__], "eager_attention_forward", None)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    window = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
    out, weights = attend(
        self,
        heads(self.q_proj, True),
        heads(self.k_proj, True),
        heads(self.v_proj, False),
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **window,
        **kwargs,
    )
    return self.o_proj(out.reshape(*lead, -1).contiguous()), weights


def _attention_computes_the_same(module: torch.nn.Module) -> bool:
    """Return whether `_lean_attention_forward` gives `module`'s own output bit for bit on a random (2, 5, hidden)
    input with random angles, polo's native kernels running (they round as torch's ops do)."""
    parameter = next(module.parameters(), None)
    width = getattr(module.q_proj, "in_features", None)
    if parameter is None or width is None or parameter.device.type != "cpu" or native_ops() is None:
        return False
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(2, 5, width, generator=generator, device="cpu").to(parameter.dtype)
    angles = torch.rand(2, 5, module.head_dim, generator=generator, device="cpu") * 6.0
    embeddings = (angles.cos().to(parameter.dtype), angles.sin().to(parameter.dtype))
    try:
        with torch.no_grad():
            own = type(module).forward(module, probe, embeddings, None)[0]
            return torch.equal(own, _lean_attention_forward(module, probe, embeddings, None)[0])
    except (RuntimeError, TypeError, AttributeError, ValueError):
        return False


def _lean_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # sampling and scoring: the same maths, without an autograd node per call
        ops = _native_norm(hidden_states, self.weight)
        if ops is not None:
            return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
    return LeanRMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _lean_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled():  # nothing to keep for a backward: the product alone
        ops = _native_product(gate, up)
        return self.down_proj(torch.nn.functional.silu(gate) * up if ops is None else ops.silu_mul(gate, up))
    if _fuses_down(self.down_proj, gate):
        return SwiGLUDown.apply(gate, up, self.down_proj.weight)
    return self.down_proj(SiluMul.apply(gate, up))


def _computes_the_same(module: torch.nn.Module, lean_forward, width: int) -> bool:
    """Return whether `lean_forward` gives `module`'s own output bit for bit on a random (2, 3, width) input."""
    parameter = next(module.parameters(), None)
    if parameter is None or width is None:
        return False
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(2, 3, width, generator=generator, device="cpu").to(parameter.device, parameter.dtype)
    try:
        with torch.no_grad(), torch_path():  # the torch reference: the native kernels may differ by an ulp
            return torch.equal(module(probe), lean_forward(module, probe))
    except (RuntimeError, TypeError, AttributeError):
        return False


def use_lean_layers(model: torch.nn.Module) -> int:
    """Give `model`'s RMSNorms and SwiGLU MLPs the lean forwards where they compute the same; return how many.

    A module qualifies by shape (an RMSNorm: `weight` and `variance_epsilon`; an MLP: `gate_proj`,
    `up_proj`, `down_proj` and `act_fn`) and then by a probe: its own forward and the lean
    one must agree bit for bit on a random input, on torch's ops (polo's native CPU kernels, which
    the lean forwards then run, agree with those within an ulp or two). Gemma's RMSNorm (scaled by
    1 + weight) and GELU MLPs fail the probe and keep their forward. Already lean modules are
    counted again, not wrapped twice.
    """
    swapped = 0
    for module in model.modules():
        if getattr(module, "_polo_lean", False):
            swapped += 1
            continue
        if hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), torch.Tensor):
            lean, width = _lean_norm_forward, module.weight.shape[-1]
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            lean, width = _lean_mlp_forward, getattr(module.gate_proj, "in_features", None)
        elif all(hasattr(module, name) for name in _ATTENTION_PARTS) and not hasattr(module, "q_norm"):
            if _attention_computes_the_same(module):
                module.forward = types.MethodType(_lean_attention_forward, module)
                module._polo_lean = True
                swapped += 1
            continue
        else:
            continue
        if _computes_the_same(module, lean, width):
            module.forward = types.MethodType(lean, module)
            module._polo_lean = True
            swapped += 1
    return swapped
