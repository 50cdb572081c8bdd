"""KL estimators k1, k2, k3 against hand-computed values and their defining properties."""

import math

import pytest
import torch

from polo.core import kl_estimate, kl_k1, kl_k2, kl_k3


def test_estimators_by_hand():
    logprobs = torch.tensor([[math.log(0.5)]])
    ref_logprobs = torch.tensor([[math.log(0.25)]])
    # log π − log π_ref = log 2 = 0.693147; d = −log 2, exp(d) = 0.5.
    torch.testing.assert_close(kl_k1(logprobs, ref_logprobs), torch.tensor([[math.log(2)]]))
    torch.testing.assert_close(kl_k2(logprobs, ref_logprobs), torch.tensor([[0.5 * math.log(2) ** 2]]))
    # k3 = 0.5 − (−log 2) − 1 = log 2 − 0.5 = 0.193147.
    torch.testing.assert_close(kl_k3(logprobs, ref_logprobs), torch.tensor([[math.log(2) - 0.5]]))


def test_k3_nonnegative_and_zero_when_equal():
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(8, 16, generator=generator) * 10
    ref_logprobs = -torch.rand(8, 16, generator=generator) * 10
    assert (kl_k3(logprobs, ref_logprobs) >= 0).all()
    assert torch.equal(kl_k3(logprobs, logprobs), torch.zeros(8, 16))


def test_k3_stays_finite_far_from_reference():
    logprobs = torch.tensor([[-1000.0, 0.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[0.0, -1000.0]])
    kl = kl_k3(logprobs, ref_logprobs)
    # d = +1000 is clamped to +20: exp(20) − 20 − 1. d = −1000 is not clamped: exp(−1000) − (−1000) − 1 = 999.
    torch.testing.assert_close(kl, torch.tensor([[math.exp(20) - 21, 999.0]]))
    kl.sum().backward()
    assert torch.isfinite(logprobs.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_below_the_reference_keeps_its_value_and_gradient(dtype):
    # d = log π_ref − log π = −30: the policy finds the token e³⁰ times likelier than the reference.
    # k3 = e^d − d − 1 = 29 + e^−30 ≈ 29, and ∂k3/∂log π = −(e^d − 1) = 1 − e^−30 ≈ +1 on each token,
    # so the KL term pushes log π back down. A clamp at d = −20 gave 19 and a zero gradient.
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=dtype, requires_grad=True)
    ref_logprobs = logprobs.detach() - 30.0
    kl = kl_k3(logprobs, ref_logprobs)
    torch.testing.assert_close(kl, torch.full((1, 2), 29.0 + math.exp(-30.0), dtype=dtype))
    kl.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.full((1, 2), 1.0 - math.exp(-30.0), dtype=dtype))


def test_k3_is_clamped_above_at_the_overflow_guard():
    # d = +30 would give e³⁰ ≈ 1e13 (and overflow fp16 at d ≈ 11): it is read as d = +20, with no gradient.
    logprobs = torch.tensor([[-31.0]], requires_grad=True)
    kl = kl_k3(logprobs, torch.tensor([[-1.0]]))
    torch.testing.assert_close(kl, torch.tensor([[math.exp(20.0) - 21.0]]))
    kl.sum().backward()
    assert logprobs.grad.item() == 0.0


def test_k1_and_k3_are_unbiased_on_samples():
    policy = torch.tensor([0.5, 0.3, 0.2])
    reference = torch.tensor([0.2, 0.3, 0.5])
    exact_kl = (policy * (policy / reference).log()).sum()  # 0.5·ln2.5 + 0.2·ln0.4 = 0.274891
    samples = torch.multinomial(policy, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logprobs, ref_logprobs = policy.log()[samples], reference.log()[samples]
    for kind in ("k1", "k3"):
        assert kl_estimate(logprobs, ref_logprobs, kind).mean().item() == pytest.approx(exact_kl.item(), abs=5e-3)


def test_dispatch_and_unknown_kind():
    logprobs, ref_logprobs = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert torch.equal(kl_estimate(logprobs, ref_logprobs, "k2"), kl_k2(logprobs, ref_logprobs))
    with pytest.raises(ValueError, match=r"'k4'.*registered: k1, k2, k3"):
        kl_estimate(logprobs, ref_logprobs, "k4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_is_never_negative_on_random_inputs(dtype):
    # exp(d) − d − 1 cancelled to −6e-8 (fp32) and −1e-16 (fp64) at small |d|; every scale of d
    # from 1e-8 to 10 is tried, since the cancellation lives at the small end.
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-8, 1e-6, 1e-4, 1e-2, 1.0, 10.0):
        logprobs = -torch.rand(256, 256, generator=generator, dtype=torch.float64) * 5
        ref_logprobs = logprobs + torch.randn(256, 256, generator=generator, dtype=torch.float64) * scale
        kl = kl_k3(logprobs.to(dtype), ref_logprobs.to(dtype))
        assert kl.dtype == dtype
        assert (kl >= 0).all(), f"min {kl.min().item()} at scale {scale}"


def test_k3_keeps_the_second_order_term_at_small_differences():
    # For |d| ≪ 1, k3 ≈ d²/2; the cancelling form returned 0 or a negative number here in fp32.
    d = torch.tensor([[1e-3, -1e-3, 1e-4]], dtype=torch.float32)
    kl = kl_k3(torch.zeros_like(d), d)
    torch.testing.assert_close(kl, d**2 / 2 + d**3 / 6, rtol=1e-3, atol=0.0)
