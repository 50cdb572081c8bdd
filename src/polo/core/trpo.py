"""Trust-region maths for TRPO: flat gradients, Fisher-vector products, conjugate gradient,
the step to the KL radius, and the backtracking line search.

TRPO solves, around the current parameters θ_old,

    maximise_s  gᵀs      subject to  ½ sᵀ F s ≤ δ

where g = ∇_θ L(θ_old) is the gradient of the surrogate L(θ) = E[π_θ(a|s)/π_old(a|s) · A] and
F = ∇²_θ KL(π_old ‖ π_θ) at θ_old is the Fisher information matrix. The solution is
s = sqrt(2δ / xᵀFx) · x with x = F⁻¹g; x is found by conjugate gradient, which only needs
products F·v (never F itself), and the step is then shrunk until the *exact* KL is within δ
and the surrogate improves. Parameters are handled as one flat vector of n numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def flat_grad(
    output: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    create_graph: bool = False,
    retain_graph: bool | None = None,
) -> torch.Tensor:
    """Return ∂output/∂params flattened into one vector `(n,)` (zeros for unused parameters).

    Shapes: output scalar; params a list of tensors with n numbers in all → (n,).
    """
    grads = torch.autograd.grad(
        output, list(params), create_graph=create_graph, retain_graph=retain_graph, allow_unused=True
    )
    return torch.cat(
        [(torch.zeros_like(param) if grad is None else grad).reshape(-1) for grad, param in zip(grads, params)]
    )


def fisher_vector_product(
    kl_grad: torch.Tensor, params: Sequence[torch.Tensor], vector: torch.Tensor, damping: float = 0.0
) -> torch.Tensor:
    """Return the damped Fisher-vector product (F + damping·I) v, shape `(n,)`.

        F v = ∇_θ ( (∇_θ KL(π_old ‖ π_θ))ᵀ v )        at θ = θ_old

    The Hessian of the KL at θ_old is the Fisher information matrix, so two backward passes
    give F v without forming F (n × n). `kl_grad` must be the flat gradient of the mean KL
    built with `create_graph=True` (see `flat_grad`); it is reused for every product, so the
    graph is retained. Damping keeps conjugate gradient stable where F is near singular.

    Shapes: kl_grad (n,), vector (n,) → (n,).
    """
    if kl_grad.shape != vector.shape:
        raise ValueError(
            f"kl_grad {tuple(kl_grad.shape)} and vector {tuple(vector.shape)} must have the same shape (n,)"
        )
    directional = (kl_grad * vector.detach()).sum()
    return flat_grad(directional, params, retain_graph=True) + damping * vector


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    b: torch.Tensor,
    max_iterations: int = 10,
    residual_tolerance: float = 1e-10,
) -> torch.Tensor:
    """Return x `(n,)` that approximately solves A x = b for a symmetric positive-definite A.

    Only the product v ↦ A v (`matvec`) is needed. Starting from x₀ = 0, r₀ = p₀ = b:

        α_k = r_kᵀr_k / p_kᵀ A p_k
        x_{k+1} = x_k + α_k p_k,      r_{k+1} = r_k − α_k A p_k
        β_k = r_{k+1}ᵀr_{k+1} / r_kᵀr_k,   p_{k+1} = r_{k+1} + β_k p_k

    stopping after `max_iterations` or once rᵀr < residual_tolerance. In exact arithmetic
    it is exact after n iterations; TRPO uses about 10, which is enough for a good direction.

    Shapes: b (n,) → x (n,).
    """
    if max_iterations < 1:
        raise ValueError(f"max_iterations must be at least 1, got {max_iterations}")
    x = torch.zeros_like(b)
    residual = b.clone()
    direction = b.clone()
    residual_norm = residual @ residual
    for _ in range(max_iterations):
        if residual_norm < residual_tolerance:
            break
        a_direction = matvec(direction)
        alpha = residual_norm / (direction @ a_direction)
        x = x + alpha * direction
        residual = residual - alpha * a_direction
        new_residual_norm = residual @ residual
        direction = residual + (new_residual_norm / residual_norm) * direction
        residual_norm = new_residual_norm
    return x


def trust_region_step(direction: torch.Tensor, fisher_direction: torch.Tensor, max_kl: float) -> torch.Tensor:
    """Return the step s = sqrt(2δ / xᵀFx) · x `(n,)`, the largest along x with ½ sᵀFs = δ.

    `direction` is x ≈ F⁻¹g and `fisher_direction` is F x. Under the quadratic model of the
    KL, the returned step lands exactly on the trust-region boundary KL = δ (`max_kl`).

    Shapes: direction (n,), fisher_direction (n,) → (n,).
    """
    if max_kl <= 0:
        raise ValueError(f"max_kl must be > 0, got {max_kl}")
    curvature = direction @ fisher_direction
    if not curvature > 0:
        raise ValueError(f"xᵀFx must be positive for a trust-region step, got {float(curvature)}")
    return torch.sqrt(2.0 * max_kl / curvature) * direction


def backtracking_line_search(
    evaluate: Callable[[torch.Tensor], tuple[float, float]],
    full_step: torch.Tensor,
    expected_improvement: float,
    max_kl: float,
    *,
    shrink: float = 0.5,
    max_backtracks: int = 10,
    accept_ratio: float = 0.1,
) -> tuple[torch.Tensor, int]:
    """Return (accepted step `(n,)`, backtracks taken); a zero step and -1 when none passes.

    Tries s_k = shrink^k · full_step for k = 0, 1, ..., max_backtracks − 1 and accepts the
    first one for which, with (improvement, kl) = evaluate(s_k),

        kl ≤ δ                                                   (the exact trust region)
        improvement > 0  and  improvement ≥ accept_ratio · shrink^k · expected_improvement

    where improvement = L(θ_old + s_k) − L(θ_old) and expected_improvement = gᵀ full_step
    is the first-order prediction. `evaluate` must leave the parameters as it found them.

    Shapes: full_step (n,) → (n,).
    """
    if not 0.0 < shrink < 1.0:
        raise ValueError(f"shrink must be in (0, 1), got {shrink}")
    fraction = 1.0
    for backtrack in range(max_backtracks):
        step = fraction * full_step
        improvement, kl = evaluate(step)
        if kl <= max_kl and improvement > 0 and improvement >= accept_ratio * fraction * expected_improvement:
            return step, backtrack
        fraction *= shrink
    return torch.zeros_like(full_step), -1
