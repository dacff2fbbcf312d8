"""RoPE's backward in Triton, the CUDA body of `models/rope.py`'s compiled op.

The gradient g is contiguous rows of D entries (one token of one head each: [B, T, H, D], the
attention block's layout before its transpose, or [B, H, T, D]); row r's position is
t = (r // inner) % seq (inner: H, or 1). One program takes BLOCK_R rows as two half-row tiles,
each loaded once, and writes dx in g's dtype. The arithmetic is eager autograd's, each product
and the sum rounded once (`mul_rn` and `add_rn` are never contracted into an FMA), so the result
equals `rope.rope_grad`'s bits, except where Triton flushes a float32 subnormal (an operand or
a result) to zero:

    dx_lo = g_lo·cos_lo + g_hi·sin_hi          (the first D/2 entries of a row)
    dx_hi = g_hi·cos_hi + -(g_lo·sin_lo)       (the last D/2)

Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["rope_grad_rows"]

# rows a program, warps: 8 KiB of a bf16 gradient a program at D = 128 (untuned)
BLOCK_R, WARPS = 32, 4


@triton.jit
def _rope_grad_kernel(
    g_ptr, cos_ptr, sin_ptr, dx_ptr, rows, seq, inner,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_H)
    mask = (r[:, None] < rows) & (j[None, :] < HALF)
    lo = r[:, None].to(tl.int64) * (2 * HALF) + j[None, :]  # the first half of each row
    table = ((r // inner) % seq)[:, None].to(tl.int64) * (2 * HALF) + j[None, :]
    g_lo = tl.load(g_ptr + lo, mask=mask, other=0.0).to(tl.float32)
    g_hi = tl.load(g_ptr + lo + HALF, mask=mask, other=0.0).to(tl.float32)
    cos_lo = tl.load(cos_ptr + table, mask=mask, other=0.0)
    cos_hi = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0)
    sin_lo = tl.load(sin_ptr + table, mask=mask, other=0.0)
    sin_hi = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0)
    dx_lo = libdevice.add_rn(libdevice.mul_rn(g_lo, cos_lo), libdevice.mul_rn(g_hi, sin_hi))
    dx_hi = libdevice.add_rn(libdevice.mul_rn(g_hi, cos_hi), -libdevice.mul_rn(g_lo, sin_lo))
    out = dx_ptr.dtype.element_ty
    tl.store(dx_ptr + lo, dx_lo.to(out), mask=mask)
    tl.store(dx_ptr + lo + HALF, dx_hi.to(out), mask=mask)


def rope_grad_rows(
    g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inner: int, *, traced: bool = False
) -> torch.Tensor:  # pragma: no cover - runs on the GPU
    """RoPE's dx for the contiguous gradient g (rows of D = g.shape[-1] entries, row r at
    position (r // inner) % T) and the contiguous float32 tables cos, sin [T, D]: contiguous,
    in g's dtype. `traced`: launched through `torch.library.wrap_triton`, the body of a
    `triton_op` (models/rope.py)."""
    seq, dim = cos.shape
    if dim % 2 or g.shape[-1] != dim or sin.shape != cos.shape:
        raise ValueError(f"rope_grad_rows: tables {tuple(cos.shape)} for rows of {g.shape[-1]}")
    g, cos, sin = g.contiguous(), cos.contiguous(), sin.contiguous()  # no-ops where they are
    dx = torch.empty_like(g)
    rows = g.numel() // dim
    grid = (triton.cdiv(rows, BLOCK_R),)
    kernel = torch.library.wrap_triton(_rope_grad_kernel) if traced else _rope_grad_kernel
    kernel[grid](
        g, cos, sin, dx, rows, seq, inner, HALF=dim // 2, BLOCK_R=BLOCK_R,
        BLOCK_H=triton.next_power_of_2(dim // 2), num_warps=WARPS,
    )  # fmt: skip
    return dx
