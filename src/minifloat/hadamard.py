"""Random Hadamard transforms (RHT) along a GEMM's contraction dim, in blocks of n (a power of 2).

wgrad `dw = dyᵀ·x` contracts over the tokens M. Rotating both operands along M by the same
orthogonal matrix R leaves the product unchanged, `(dyᵀR)(xᵀR)ᵀ = dyᵀ R Rᵀ x = dyᵀx`, but spreads
an outlier over its block of n tokens, so a 1x16 block scale fits the rest of the block better
(NVFP4, arXiv 2509.25149, section 4.2: a 16x16 RHT on both wgrad inputs; Quartet, arXiv
2505.14669). Here R is block diagonal with blocks `T = H_n·diag(s)/sqrt(n)`: H_n the Sylvester
Hadamard matrix (entries ±1, `H_n H_nᵀ = n I`) and s a random sign vector shared by all blocks
and by both operands of one GEMM (`counter_rng.random_signs`).

The transform is a fast Walsh-Hadamard transform: log2(n) stages of sums and differences, then
one multiplication by 1/sqrt(n) (exact for n = 4^j, e.g. 16). Its operations are element-wise
and their order is fixed, so it gives the same bits eager, compiled and on any device. A length
that is not a multiple of n is zero-padded (zeros rotate into the block, so the padded operand is
longer: both operands of the GEMM are padded alike and the product is unchanged).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["hadamard_matrix", "rotate", "check_size"]


def check_size(n: int) -> int:
    """`n` if it is a valid transform size (a power of two >= 2), else ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1):
        raise ValueError(f"a Hadamard transform size must be a power of two >= 2, got {n!r}")
    return n


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries ±1, unnormalized; `H Hᵀ = n I`)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < check_size(n):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _fwht(v: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform along `axis` (of length n) of v: v·H_n there."""
    pre, post = v.shape[:axis], v.shape[axis + 1 :]
    h = 1
    while h < n:
        v = v.reshape(*pre, n // (2 * h), 2, h, *post)
        a, b = v.select(axis + 1, 0), v.select(axis + 1, 1)
        v = torch.stack([a + b, a - b], dim=axis + 1)
        h *= 2
    return v.reshape(*pre, n, *post)


def _check_rotate_args(x: torch.Tensor, signs: torch.Tensor, dim: int) -> None:
    """Shapes and dtypes only (no pass over the values): a `dim` out of range would wrap around
    to another dim, and bool signs (0/1) would make the transform singular, both silently."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, "
            f"got {dim!r}"
        )
    if x.is_complex():
        raise TypeError(f"rotate takes a real tensor, got {x.dtype}")
    if signs.dim() != 1 or signs.dtype == torch.bool or signs.is_complex():
        raise ValueError(
            f"signs must be a 1-D tensor of ±1 (float), got {signs.dtype} of shape "
            f"{tuple(signs.shape)}"
        )


def rotate(
    x: torch.Tensor, signs: torch.Tensor, dim: int, *, inverse: bool = False
) -> torch.Tensor:
    """x rotated along `dim` in blocks of n = signs.numel(): each block v -> H·diag(s)·v/sqrt(n)
    (`inverse`: v -> diag(s)·H·v/sqrt(n)). float32; `dim` zero-padded to a multiple of n.

    Args:
        x: a tensor of any float dtype (computed in float32).
        signs: [n] ±1 (float), n a power of two.
        dim: the dim to rotate along (the GEMM's contraction dim of this operand).
        inverse: apply the transposed (inverse) rotation.
    """
    n = check_size(signs.numel())
    _check_rotate_args(x, signs, dim)
    dim = dim % x.dim()
    v = x.float()
    pad = -v.shape[dim] % n
    if pad:
        widths = [0, 0] * (v.dim() - 1 - dim) + [0, pad]
        v = F.pad(v, widths)
    length = v.shape[dim]
    shape = (*v.shape[:dim], length // n, n, *v.shape[dim + 1 :])
    s = signs.float().reshape((n,) + (1,) * (v.dim() - dim - 1))
    v = v.reshape(shape)
    if not inverse:
        v = v * s
    v = _fwht(v, dim + 1, n)
    v = v * (1.0 / math.sqrt(n))
    if inverse:
        v = v * s
    return v.reshape(*v.shape[:dim], length, *v.shape[dim + 2 :])
