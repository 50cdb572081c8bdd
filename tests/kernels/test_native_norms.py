"""polo's native RMSNorm and SwiGLU product (norms.cpp) against the torch reference of polo.kernels.lean.

The native kernels round where the torch ops do and differ only in the order of a row's sums
(fp32), so bf16 results are almost all identical and the rest one bf16 ulp away (two at a binade
boundary, where w · x̂ is rounded twice); fp32 results differ by a few fp32 ulps. Where a result
comes out of a cancellation (dx = rstd · (gn − x̂ · mean), dw and dgate summed or multiplied by
terms of either sign), an element near zero may be many ulps of itself away, so those are held
to an absolute tolerance scaled by the tensor's largest element.
"""

import pytest
import torch

from polo.kernels import lean, use_lean_layers
from polo.kernels.cpu.native import native_ops
from polo.kernels.lean import LeanRMSNorm, SiluMul, torch_path
from polo.models.loading import load_policy

WIDTHS = [100, 576, 1536]  # 100: neither a multiple of 32 nor of 16, so every row ends in a partial vector
ROWS = [1, 3, 64, 1656]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture
def ops(native_kernels):
    """polo's native ops (tests/conftest.py's `native_kernels`: a failure where they should build and did not)."""
    return native_kernels


def ordered(tensor: torch.Tensor) -> torch.Tensor:
    """Map floats to integers in the same order, neighbours one apart (±0 both 0), as int64."""
    bits = tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32).to(torch.int64)
    magnitude = bits & (0x7FFF if tensor.dtype == torch.bfloat16 else 0x7FFFFFFF)
    return torch.where(bits < 0, -magnitude, magnitude)


def assert_ulps(native: torch.Tensor, reference: torch.Tensor, ulps: int, exact: float = 0.0) -> None:
    """Assert that every element is within `ulps` representable values of the reference, `exact` of them equal."""
    assert native.dtype == reference.dtype and native.shape == reference.shape
    distance = (ordered(native) - ordered(reference)).abs()
    assert distance.max().item() <= ulps, f"{distance.max().item()} ulps apart (at most {ulps})"
    assert (distance == 0).double().mean().item() >= exact, f"only {(distance == 0).double().mean():.4f} equal"


def assert_near(native: torch.Tensor, reference: torch.Tensor, scale: float = 1.0) -> None:
    """Assert closeness for results of a cancellation: 2 ulps relative plus fp32 noise of the largest element."""
    assert native.dtype == reference.dtype
    rtol = 2.0**-6 if native.dtype == torch.bfloat16 else 8 * 2.0**-23
    atol = scale * 1e-5 * reference.float().abs().max().item()
    torch.testing.assert_close(native.float(), reference.float(), rtol=rtol, atol=atol)


def run_norm(hidden, weight, grad, native: bool):
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if native:
        out = LeanRMSNorm.apply(x, w, 1e-5)
    else:
        with torch_path():
            out = LeanRMSNorm.apply(x, w, 1e-5)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def run_product(gate, up, grad, native: bool):
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    if native:
        out = SiluMul.apply(g, u)
    else:
        with torch_path():
            out = SiluMul.apply(g, u)
    out.backward(grad)
    return out.detach(), g.grad, u.grad


def inputs(rows: int, width: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=generator) * scale).to(dtype) for scale in (3.0, 1.0, 1.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_native_rms_norm_forward_and_backward_match_the_torch_path(ops, dtype, width, rows):
    hidden, weight, grad = inputs(rows, width, dtype, seed=rows * width)
    weight = (weight[0].float() * 0.25 + 1).to(dtype)
    out, dx, dw = run_norm(hidden, weight, grad, native=True)
    ref_out, ref_dx, ref_dw = run_norm(hidden, weight, grad, native=False)
    native_out, native_rstd = ops.rms_norm(hidden, weight, 1e-5)
    assert torch.equal(out, native_out)  # LeanRMSNorm ran the native kernels (fp32: a fifth of elements differ)
    assert torch.equal(dx, ops.rms_norm_backward(grad, hidden, native_rstd, weight, False)[0])
    ref_rstd = lean.rms_norm(hidden, weight, 1e-5)[1]
    assert native_rstd.dtype == torch.float32 and native_rstd.shape == (rows, 1)
    # fp32 sums of 100 to 1,536 squares added in another order: a few ulps apart, carried into fp32 outputs
    assert_ulps(native_rstd, ref_rstd, ulps=8)
    if dtype == torch.bfloat16:  # torch's roundings: nearly every element identical
        assert_ulps(out, ref_out, ulps=2, exact=0.99)
        assert (dx == ref_dx).double().mean().item() >= 0.99
    else:
        assert_ulps(out, ref_out, ulps=8)
    assert_near(dx, ref_dx)
    assert_near(dw, ref_dw)  # summed over all rows: chunks of rows, then the chunks
    assert dw.dtype == weight.dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_native_silu_mul_forward_and_backward_match_the_torch_path(ops, dtype, width, rows):
    gate, up, grad = inputs(rows, width, dtype, seed=rows + width)
    native = run_product(gate / 3, up, grad, native=True)
    assert torch.equal(native[0], ops.silu_mul(gate / 3, up))
    assert all(map(torch.equal, native[1:], ops.silu_mul_backward(grad, gate / 3, up, [True, True])))
    reference = run_product(gate / 3, up, grad, native=False)
    # torch computes silu(x) as x / (1 + exp(-x)) with the same vector exp, but the last partial vector
    # of a tensor with the scalar exp: an fp32 ulp apart there, hence not all identical
    for name, result, expected in zip(("out", "dgate", "dup"), native, reference, strict=True):
        assert result.dtype == dtype, name
        assert (result == expected).double().mean().item() >= 0.99, name
    assert_ulps(native[0], reference[0], ulps=2)
    assert_ulps(native[2], reference[2], ulps=2)
    assert_near(native[1], reference[1])  # σ · (1 + g · (1 − σ)) cancels near g ≈ −1.28


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_reads_the_rows_of_a_merged_product_in_place(ops, dtype, width, rows):
    """gate and up as the two halves of one (rows, 2·width) product, as a decode step's packed gate/up projection
    leaves them: the same values as on contiguous copies, bit for bit, in a contiguous result."""
    merged, _, _ = inputs(rows, 2 * width, dtype, seed=rows * width)
    gate, up = merged[:, :width], merged[:, width:]
    got = ops.silu_mul(gate, up)
    assert got.is_contiguous() and got.shape == (rows, width) and got.dtype == dtype
    assert torch.equal(got, ops.silu_mul(gate.contiguous(), up.contiguous()))


@pytest.mark.parametrize("width", WIDTHS)
def test_native_kernels_match_fp64_autograd_of_the_reference_formulas(ops, width):
    hidden, gate, grad = inputs(37, width, torch.float32, seed=width)
    weight = torch.linspace(0.5, 1.5, width)
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    (LeanRMSNorm.apply(x, w, 1e-6) * grad).sum().backward()
    x64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    out64 = lean.rms_norm(x64, w64, 1e-6)[0]
    (out64 * grad.double()).sum().backward()
    torch.testing.assert_close(ops.rms_norm(hidden, weight, 1e-6)[0].double(), out64.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5 * x64.grad.abs().max().item())
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5 * w64.grad.abs().max().item())

    g, u = gate.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    (SiluMul.apply(g, u) * grad).sum().backward()
    g64, u64 = gate.double().requires_grad_(True), hidden.double().requires_grad_(True)
    (torch.nn.functional.silu(g64) * u64 * grad.double()).sum().backward()
    torch.testing.assert_close(g.grad.double(), g64.grad, rtol=1e-5, atol=1e-6 * g64.grad.abs().max().item())
    torch.testing.assert_close(u.grad.double(), u64.grad, rtol=1e-6, atol=1e-7)


def test_the_norms_weight_gradient_is_the_same_to_the_bit_whatever_the_thread_count(ops):
    """dw is summed over row chunks that the rows fill, not one per thread: 1 and 2 threads give the same bits (a
    count set by one run and left for the next changed the next run's weights)."""
    generator = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(4096, 32, generator=generator) for _ in range(2))
    weight = torch.randn(32, generator=generator)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    before, grads = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            grads.append(ops.rms_norm_backward(dy, x, rstd, weight, True)[1])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(grads[0], grads[1])


def test_native_backward_takes_only_the_gradients_asked_for_and_non_contiguous_inputs(ops):
    hidden, weight, grad = inputs(8, 2 * 96, torch.bfloat16, seed=1)
    strided = hidden[:, ::2]  # (8, 96), every other column
    rstd = lean.rms_norm(strided, weight[0, :96], 1e-5)[1]
    dx, dw = ops.rms_norm_backward(grad[:, :96], strided, rstd, weight[0, :96], False)
    assert dw is None and dx.shape == (8, 96)
    contiguous = ops.rms_norm_backward(grad[:, :96].contiguous(), strided.contiguous(), rstd, weight[0, :96], True)
    assert torch.equal(dx, contiguous[0]) and contiguous[1].shape == (96,)
    assert_ulps(ops.rms_norm(strided, weight[0, :96], 1e-5)[0], lean.rms_norm(strided, weight[0, :96], 1e-5)[0], ulps=2)
    dgate, dup = ops.silu_mul_backward(grad, hidden, weight, [False, True])
    assert dgate is None and dup.shape == hidden.shape
    assert ops.silu_mul_backward(grad, hidden, weight, [False, False]) == (None, None)


def test_the_norm_of_a_bf16_input_and_an_fp32_weight_gives_fp32_like_torch(ops):
    hidden, weight, grad = inputs(5, 100, torch.bfloat16, seed=2)
    weight = weight[0].float() * 0.25 + 1
    out, dx, dw = run_norm(hidden, weight, grad.float(), native=True)
    ref_out, ref_dx, ref_dw = run_norm(hidden, weight, grad.float(), native=False)
    assert out.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert_ulps(out, ref_out, ulps=8)
    assert_near(dx, ref_dx)
    assert_near(dw, ref_dw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_layers_still_swap_in_and_the_native_model_matches_the_torch_path(ops, tiny_model_dir, dtype, monkeypatch):
    model, _ = load_policy(str(tiny_model_dir))
    model.to(dtype)
    layers = model.config.num_hidden_layers
    # two norms, an MLP and an attention a layer, and the final norm; the probes compare with the torch path
    assert use_lean_layers(model) == 4 * layers + 1
    calls = []
    monkeypatch.setattr(lean, "native_ops", lambda: calls.append(1) or native_ops())
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, context in (("native", lambda: torch.enable_grad()), ("torch", torch_path)):
        model.zero_grad()
        with context():
            logits = model(input_ids=ids).logits
            logits.float().pow(2).mean().backward()
            with torch.no_grad():  # sampling's forwards, without autograd nodes
                sampled = model(input_ids=ids).logits
        results[name] = (logits.detach(), sampled, {n: p.grad.clone() for n, p in model.named_parameters()})
        results[name + " calls"] = len(calls)
    assert results["native calls"] >= 2 * (3 * layers + 1)  # forward with grad, backward and no-grad forward
    assert results["torch calls"] == results["native calls"]  # torch_path never asks for the native ops
    (logits, sampled, grads), (ref_logits, ref_sampled, ref_grads) = results["native"], results["torch"]
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(logits, ref_logits, **tolerance)
    torch.testing.assert_close(sampled, ref_sampled, **tolerance)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **tolerance, msg=name)


def test_without_native_ops_the_lean_layers_run_the_torch_path_bit_for_bit(monkeypatch):
    torch.manual_seed(0)
    hidden, weight, grad = inputs(3, 100, torch.bfloat16, seed=3)
    with torch_path():
        reference = run_norm(hidden, weight[0], grad, native=True) + run_product(hidden, weight, grad, native=True)
    monkeypatch.setattr(lean, "native_ops", lambda: None)  # what POLO_NATIVE=0 or a failed build gives
    results = run_norm(hidden, weight[0], grad, native=True) + run_product(hidden, weight, grad, native=True)
    for result, expected in zip(results, reference, strict=True):
        assert torch.equal(result, expected)
