"""minifloat/hadamard.py: the random Hadamard transform is orthogonal, equals its matrix, and
leaves a GEMM over the rotated dim unchanged up to rounding (the wgrad use). Compiled == eager
is checked with the quantizer that uses it (tests/test_microscale.py)."""

from __future__ import annotations

import math

import pytest
import torch

from minifloat import counter_rng
from minifloat.hadamard import check_size, hadamard_matrix, rotate


def _signs(n: int, seed: int = 7) -> torch.Tensor:
    return counter_rng.random_signs(torch.tensor(seed), n, torch.device("cpu"))


@pytest.mark.parametrize("n", [2, 4, 16, 32, 64])
def test_matrix_is_orthogonal_up_to_n(n):
    h = hadamard_matrix(n)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))
    assert torch.equal(h, h.t())  # Sylvester: symmetric


@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("dim", [0, 1])
def test_rotate_is_the_block_matrix_and_orthogonal(n, dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen)
    s = _signs(n)
    t = (hadamard_matrix(n) @ torch.diag(s.double())) / math.sqrt(n)  # T = H diag(s) / sqrt(n)
    assert torch.allclose(t @ t.t(), torch.eye(n, dtype=torch.float64), atol=1e-15)
    out = rotate(x, s, dim)
    xb = x.double().movedim(dim, -1)
    want = (xb.reshape(*xb.shape[:-1], -1, n) @ t.t()).reshape(xb.shape).movedim(-1, dim)
    assert torch.allclose(out.double(), want, rtol=0, atol=1e-5)
    # orthogonal: norms kept, and the inverse undoes it
    assert torch.allclose(out.norm(), x.norm(), rtol=1e-6)
    assert torch.allclose(rotate(out, s, dim, inverse=True), x, atol=1e-5)


def test_ragged_length_is_zero_padded():
    x = torch.randn(5, 21)
    out = rotate(x, _signs(16), dim=1)
    assert out.shape == (5, 32)
    back = rotate(out, _signs(16), dim=1, inverse=True)
    assert torch.allclose(back[:, :21], x, atol=1e-6) and back[:, 21:].abs().max() < 1e-6


@pytest.mark.parametrize("m", [64, 50])
def test_wgrad_with_rotation_equals_unrotated_gemm(m):
    """dw = dyᵀx is unchanged when both operands are rotated along M by the same R (R Rᵀ = I)."""
    gen = torch.Generator().manual_seed(1)
    dy, x = torch.randn(m, 24, generator=gen), torch.randn(m, 40, generator=gen)
    s = _signs(16, seed=3)
    dy_r, x_r = rotate(dy, s, dim=0), rotate(x, s, dim=0)  # [M', N], [M', K]
    got = dy_r.double().t() @ x_r.double()
    want = dy.double().t() @ x.double()
    bound = 8 * 2.0**-24 * (dy.double().abs().t() @ x.double().abs())  # fp32 rounding of R
    assert ((got - want).abs() <= bound).all()


def test_sizes_are_checked():
    assert check_size(16) == 16
    for bad in (0, 1, 12, True, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            check_size(bad)


@pytest.mark.parametrize("dim", [2, -3, 1.0, True])
def test_rotate_refuses_dim_out_of_range(dim):
    # dim % x.dim() rotated another dim silently (2 -> 0 for a 2-D x)
    with pytest.raises(ValueError, match="dim must be an int in"):
        rotate(torch.randn(4, 8), torch.ones(4), dim)


@pytest.mark.parametrize(
    "signs", [torch.ones(4, dtype=torch.bool), torch.ones(2, 2)], ids=["bool", "2-D"]
)
def test_rotate_refuses_signs_not_a_float_vector(signs):
    # bool (0/1) signs made the transform singular
    with pytest.raises(ValueError, match="signs must be a 1-D tensor"):
        rotate(torch.randn(4, 8), signs, 1)


def test_rotate_refuses_complex_and_0dim_x():
    with pytest.raises(TypeError, match="real tensor"):
        rotate(torch.randn(4, 8, dtype=torch.complex64), torch.ones(4), 1)
    with pytest.raises(ValueError, match="dim must be an int"):
        rotate(torch.tensor(1.0), torch.ones(4), 0)
