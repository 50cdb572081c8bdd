"""Trust-region maths: conjugate gradient, Fisher-vector products, the step size and line search."""

import pytest
import torch

from polo.core.trpo import (
    backtracking_line_search,
    conjugate_gradient,
    fisher_vector_product,
    flat_grad,
    trust_region_step,
)


def random_spd(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    factor = torch.randn(n, n, generator=generator, dtype=torch.float64)
    return factor @ factor.T + n * torch.eye(n, dtype=torch.float64)


def test_conjugate_gradient_matches_a_direct_solve():
    matrix = random_spd(8)
    b = torch.arange(1.0, 9.0, dtype=torch.float64)
    # n iterations are exact in exact arithmetic; a few more absorb rounding.
    x = conjugate_gradient(lambda v: matrix @ v, b, max_iterations=20)
    torch.testing.assert_close(x, torch.linalg.solve(matrix, b))


def test_conjugate_gradient_by_hand_on_a_diagonal_system():
    # A = diag(2, 4), b = (2, 4): r0 = p0 = b, α0 = (4+16)/(8+64) = 20/72; one step is not exact,
    # the second is (two distinct eigenvalues).
    matrix = torch.diag(torch.tensor([2.0, 4.0], dtype=torch.float64))
    b = torch.tensor([2.0, 4.0], dtype=torch.float64)
    one_step = conjugate_gradient(lambda v: matrix @ v, b, max_iterations=1)
    torch.testing.assert_close(one_step, 20.0 / 72.0 * b)
    torch.testing.assert_close(
        conjugate_gradient(lambda v: matrix @ v, b, max_iterations=2), torch.ones(2, dtype=torch.float64)
    )


def test_conjugate_gradient_stops_on_a_zero_right_hand_side():
    calls = []
    x = conjugate_gradient(lambda v: calls.append(1) or v, torch.zeros(3), max_iterations=5)
    assert torch.equal(x, torch.zeros(3)) and not calls
    with pytest.raises(ValueError, match="max_iterations"):
        conjugate_gradient(lambda v: v, torch.ones(3), max_iterations=0)


def categorical_kl_setup(seed: int = 0):
    """A linear softmax policy over 3 actions; returns (weights, observations, old_logits)."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(4, 3, generator=generator, dtype=torch.float64).requires_grad_()
    observations = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    return weights, observations, (observations @ weights).detach()


def mean_kl(weights, observations, old_logits):
    old_log_probs = torch.log_softmax(old_logits, -1)
    log_probs = torch.log_softmax(observations @ weights, -1)
    return (old_log_probs.exp() * (old_log_probs - log_probs)).sum(-1).mean()


def test_fisher_vector_product_is_the_kl_hessian_times_v():
    weights, observations, old_logits = categorical_kl_setup()
    vector = torch.linspace(-1.0, 1.0, weights.numel(), dtype=torch.float64)
    kl_grad = flat_grad(mean_kl(weights, observations, old_logits), [weights], create_graph=True)
    product = fisher_vector_product(kl_grad, [weights], vector, damping=0.1)
    hessian = torch.autograd.functional.hessian(
        lambda w: mean_kl(w.reshape(4, 3), observations, old_logits), weights.detach().reshape(-1)
    )
    torch.testing.assert_close(product, hessian @ vector + 0.1 * vector)
    # At θ_old the KL's gradient is zero: the constraint is flat to first order.
    torch.testing.assert_close(kl_grad.detach(), torch.zeros_like(kl_grad))


def test_trust_region_step_lands_on_the_kl_boundary_of_the_quadratic_model():
    fisher = random_spd(5, seed=1)
    direction = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0], dtype=torch.float64)
    step = trust_region_step(direction, fisher @ direction, max_kl=0.01)
    torch.testing.assert_close(0.5 * step @ fisher @ step, torch.tensor(0.01, dtype=torch.float64))
    assert torch.allclose(step / step.norm(), direction / direction.norm())  # same direction, rescaled


def test_line_search_shrinks_until_kl_and_improvement_hold():
    tried = []

    def evaluate(step):
        tried.append(float(step[0]))
        # KL grows with the step squared; the surrogate improves linearly.
        return float(step[0]), float(step[0]) ** 2

    step, backtracks = backtracking_line_search(evaluate, torch.tensor([1.0]), expected_improvement=1.0, max_kl=0.1)
    assert tried == [1.0, 0.5, 0.25]  # 1 and 0.25 violate KL ≤ 0.1; 0.0625 ≤ 0.1 passes
    assert backtracks == 2 and float(step[0]) == 0.25


def test_line_search_rejects_steps_that_do_not_improve():
    step, backtracks = backtracking_line_search(
        lambda step: (-1.0, 0.0), torch.tensor([1.0, 2.0]), expected_improvement=1.0, max_kl=0.1, max_backtracks=4
    )
    assert backtracks == -1 and torch.equal(step, torch.zeros(2))
