"""polo's native decode-step kernels (decode_step.cpp): the torch ops they replace, bit for bit."""

import pytest
import torch

from polo.kernels.cpu.decode import rotate
from polo.kernels.lean import torch_path

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture
def ops(native_kernels):
    """polo's native ops (tests/conftest.py's `native_kernels`: a failure where they should build and did not)."""
    return native_kernels


def torch_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as transformers' apply_rotary_pos_emb computes it (rotate_half, two products, a sum)."""
    half = states.shape[-1] // 2
    return states * cos + torch.cat((-states[..., half:], states[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "heads", "dim"), [(1, 1, 64), (32, 9, 64), (5, 3, 96), (7, 2, 20)])
def test_rotary_is_transformers_rotary_bit_for_bit(ops, dtype, rows, heads, dim):
    generator = torch.Generator().manual_seed(rows * heads + dim)
    # the queries as the decode step gives them: a slice of a packed q/k/v product, rows at a stride
    packed = (torch.randn(rows, heads * dim + 48, generator=generator) * 3).to(dtype)
    states = packed[:, : heads * dim].view(rows, heads, dim)
    angles = torch.randn(rows, 1, dim // 2, generator=generator) * 40
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    expected = torch_rotary(states, cos, sin)
    got = ops.rotary(states, cos, sin)
    assert got.dtype == dtype and got.shape == (rows, heads, dim) and got.is_contiguous()
    assert torch.equal(got, expected)
    assert torch.equal(rotate(states, cos, sin), expected)  # the decode step's entry, native here
    with torch_path():
        assert torch.equal(rotate(states, cos, sin), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (32, 576), (64, 100), (3, 1536)])
def test_add_rms_norm_is_the_add_then_the_native_norm(ops, dtype, rows, width):
    generator = torch.Generator().manual_seed(rows + width)
    hidden = (torch.randn(rows, width, generator=generator) * 4).to(dtype)
    residual = (torch.randn(rows, width, generator=generator) * 4).to(dtype)
    weight = (1 + torch.randn(width, generator=generator) / 4).to(dtype)
    out, summed = ops.add_rms_norm(hidden, residual, weight, 1e-5)
    expected_sum = residual + hidden
    assert summed.dtype == dtype and torch.equal(summed, expected_sum)
    assert torch.equal(out, ops.rms_norm(expected_sum, weight, 1e-5)[0])
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.add_rms_norm(hidden, residual.double(), weight, 1e-5)
