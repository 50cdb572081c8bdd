"""Lean layers: RMSNorm and the SwiGLU product with the same forward, keeping a fraction of the activations.

transformers' RMSNorm (Llama, Qwen2, Mistral, SmolLM) upcasts its input to fp32 and runs six
element-wise ops, and autograd keeps what each of them needs: 5.8 KB per token for SmolLM2's
576-wide bf16 hidden states, five times the input itself. `LeanRMSNorm` keeps the input and one
fp32 scale per token (1.2 KB) and recomputes the rest in backward; the forward is the same
sequence of roundings, so its output is bit for bit transformers'. `SiluMul`, the `act(gate) * up`
of a SwiGLU MLP, keeps gate and up and recomputes the activation (3 KB less per token at SmolLM2's
1,536-wide MLP). Together they cut the activations a decoder layer keeps for backward from
~28.7 KB to ~16.5 KB per token (measured on SmolLM2-135M under bf16_master), and the norm's
forward + backward runs ~20 % faster (2.4 against 3.0 ms for 2,176 tokens on a 2-core EPYC).

No library ships these for the CPU (fused kernels such as Liger's are Triton, for GPUs), hence
the hand-written backward; `use_lean_layers` swaps them in only where a probe shows the module
computes exactly what the lean version does.
"""

from __future__ import annotations

import types

import torch

__all__ = ["LeanRMSNorm", "SiluMul", "use_lean_layers"]


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
        out, rstd = rms_norm(hidden, weight, eps)
        ctx.save_for_backward(hidden, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden, rstd, weight = ctx.saved_tensors
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
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            # aten's silu_backward: dy · σ(x)·(1 + x·(1 − σ(x))) in one pass, in fp32 for bf16 inputs (the
            # same formula as separate ops took seven passes over the (tokens, m) tensors: 7.1 ms a layer
            # of the demo's update, 1,808 tokens x 1,536)
            grad_gate = torch.ops.aten.silu_backward(grad_output * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad_output * torch.nn.functional.silu(gate)
        return grad_gate, grad_up


def _lean_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # sampling and scoring: the same ops, without an autograd node per call
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
    return LeanRMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _lean_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled():  # nothing to keep for a backward: the product alone
        return self.down_proj(torch.nn.functional.silu(gate) * up)
    return self.down_proj(SiluMul.apply(gate, up))


def _computes_the_same(module: torch.nn.Module, lean_forward, width: int) -> bool:
    """Return whether `lean_forward` gives `module`'s own output bit for bit on a random (2, 3, width) input."""
    parameter = next(module.parameters(), None)
    if parameter is None or width is None:
        return False
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(2, 3, width, generator=generator, device="cpu").to(parameter.device, parameter.dtype)
    try:
        with torch.no_grad():
            return torch.equal(module(probe), lean_forward(module, probe))
    except (RuntimeError, TypeError, AttributeError):
        return False


def use_lean_layers(model: torch.nn.Module) -> int:
    """Give `model`'s RMSNorms and SwiGLU MLPs the lean forwards where they compute the same; return how many.

    A module qualifies by shape (an RMSNorm: `weight` and `variance_epsilon`; an MLP: `gate_proj`,
    `up_proj`, `down_proj` and `act_fn`) and then by a probe: its own forward and the lean
    one must agree bit for bit on a random input. Gemma's RMSNorm (scaled by 1 + weight) and GELU
    MLPs fail the probe and keep their forward. Already lean modules are counted again, not wrapped twice.
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
        else:
            continue
        if _computes_the_same(module, lean, width):
            module.forward = types.MethodType(lean, module)
            module._polo_lean = True
            swapped += 1
    return swapped
