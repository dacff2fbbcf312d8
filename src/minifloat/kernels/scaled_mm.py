"""FP8 tensor-core GEMM dispatch through `torch._scaled_mm`: tensor-wise, row-wise and block-wise
scales, in the backend's `out = a @ bᵀ` convention (a: [R, Kc], b: [C, Kc], both row-major FP8).

`torch._scaled_mm(a, b.t(), scale_a, scale_b)` wants a row-major and mat2 column-major, which is
exactly a row-major b passed transposed. Scale layouts it accepts on sm_90 (torch 2.11):
- tensor-wise: two 1-element fp32 tensors;
- row-wise: scale_a [R, 1], scale_b [1, C], both contiguous fp32;
- 1x128 lhs: scale_a [R, Kc/128] stored column-major (stride (1, R));
- 128x128 rhs: scale_b [Kc/128, C/128] = (b's [C/128, Kc/128] row-major scale)ᵀ;
- 1x128 rhs: scale_b [Kc/128, C] row-major.
The contraction dim Kc and C must be multiples of 16 (R need not be): callers check
`supported()`; a ragged contraction dim is zero-padded here, which leaves every sum unchanged.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_DTYPES",
    "supported",
    "pad_contraction",
    "scaled_mm_rowish",
    "scaled_mm_blocks",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Can `_scaled_mm` run a @ bᵀ for these FP8 operands (C % 16 == 0; Kc may be padded)?"""
    return (
        a.is_cuda
        and a.dtype in FP8_DTYPES
        and b.dtype in FP8_DTYPES
        and a.dim() == 2
        and b.dim() == 2
        and b.shape[0] % 16 == 0
        and a.shape[1] == b.shape[1]
    )


def pad_contraction(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero-pad the last dim of a 2-D tensor to a multiple (zeros add nothing to a GEMM)."""
    k = t.shape[1]
    pad = (-k) % multiple
    if pad == 0:
        # No stride queries here (`is_contiguous()`): this runs in QuantLinear's backward, where
        # dynamo cannot evaluate them on the saved tensors (torch 2.11); the failed attempt made
        # it retrace the backward and leave autocast disabled for the rest of the graph (seen on
        # an H200: key/value projections in fp32 beside a bf16 query). contiguous() is a no-op
        # on a contiguous tensor and copies FP8 values bit for bit.
        return t.contiguous()
    # A pad, not zeros written into: under torch.compile a `torch.zeros` buffer of the padded
    # shape was one graph node that forward and backward shared, and the partitioner saved it
    # for backward (an all-zero [M, K + pad] per padded operand: ~0.2 GiB a layer for
    # fp8-blockwise at 7B width, where K = 11008 pads to 11264; docs/hopper_sessions.md,
    # session 29).
    return torch.nn.functional.pad(t.contiguous().view(torch.uint8), (0, pad)).view(t.dtype)


def _rowish_scale(scale: torch.Tensor, n: int, as_row: bool) -> torch.Tensor:
    """A [n,1]/[1,1] scale as what `_scaled_mm` wants next to the other operand's kind."""
    s = scale.float().reshape(-1)
    if s.numel() == 1 and n != 1:
        s = s.expand(n)
    return s.reshape(1, n).contiguous() if as_row else s.reshape(n, 1).contiguous()


def scaled_mm_rowish(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """a @ bᵀ with tensor ([1,1]) or row ([R,1] / [C,1]) scales: acc * a_scale * b_scaleᵀ.

    Two tensor scales run the tensor-wise kernel; any row scale runs the row-wise kernel (a tensor
    scale is broadcast to a vector for it).
    """
    a, b = pad_contraction(a), pad_contraction(b)
    r, c = a.shape[0], b.shape[0]
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        sa, sb = a_scale.float().reshape(()), b_scale.float().reshape(())
    else:
        sa, sb = _rowish_scale(a_scale, r, False), _rowish_scale(b_scale, c, True)
    return torch._scaled_mm(
        a,
        b.t(),
        scale_a=sa,
        scale_b=sb,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )


def _pad_cols(s: torch.Tensor, n: int) -> torch.Tensor:
    """Scales [rows, k] padded with ones to [rows, n] columns (for zero-padded blocks)."""
    if s.shape[1] == n:
        return s
    ones = torch.ones((s.shape[0], n - s.shape[1]), dtype=s.dtype, device=s.device)
    return torch.cat([s, ones], dim=1)


def _col_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous().t()


def scaled_mm_blocks(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_block: tuple[int, int],
    *,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a @ bᵀ with a 1x128-scaled lhs and a 128x128- or 1x128-scaled rhs (DeepSeek-V3 style).

    a_scale [R, ceil(Kc/128)]; b_scale [ceil(C/128), ceil(Kc/128)] for (128, 128) or
    [C, ceil(Kc/128)] for (1, 128), both as quantize() returns them (row-major).
    """
    # cuBLAS's block-scaled kernels want rows in multiples of 16 (seen: CUBLAS_STATUS_NOT_SUPPORTED
    # at M = 77) and, for a 128x128 rhs, a contraction of a multiple of 4 blocks (seen on an H200
    # with torch 2.11: 3 or 9 blocks give wrong results, a padded scale stride is rejected).
    # Zero rows / zero contraction blocks with unit scales change no output: pad, then slice.
    rows = a.shape[0]
    kmult = 512 if b_block == (128, 128) else 128
    a, b = pad_contraction(a, kmult), pad_contraction(b, kmult)
    kb = a.shape[1] // 128
    a_scale = _pad_cols(a_scale.float(), kb)
    b_scale = _pad_cols(b_scale.float(), kb)
    pad_r = (-rows) % 16
    sa = a_scale
    if pad_r:
        a = torch.cat([a, torch.zeros((pad_r, a.shape[1]), dtype=a.dtype, device=a.device)])
        sa = torch.cat([sa, torch.ones((pad_r, sa.shape[1]), dtype=sa.dtype, device=sa.device)])
    sa = _col_major(sa)
    if b_block == (128, 128):
        sb = b_scale.contiguous().t()
    elif b_block == (1, 128):
        sb = b_scale.float().t().contiguous()
    else:
        raise ValueError(f"unsupported rhs block {b_block}")
    out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return out[:rows] if pad_r else out
