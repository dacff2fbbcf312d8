"""The Triton kernels as `torch.library` custom ops, with fake (meta) implementations.

torch.compile cannot trace into a Triton launcher written in Python, so each kernel entry point is
an opaque op: Dynamo records `torch.ops.minifloat.<name>` in the graph and uses the fake
implementation to learn output shapes and dtypes, without a graph break.

Ops (all outputs are new tensors):
- `minifloat::quantize(x, fmt, mode, block_r, block_c, transpose, row_mult, col_mult, clip_lo,
  clip_hi, scale, want_t) -> (values, values_t, scale)`: quantize the 2-D view `v = x.t() if
  transpose else x`. mode "row" (groups of block_c columns of v; 0 = whole rows), "tensor"
  (`scale` given: delayed scaling) or "block" (block_r x block_c blocks of v). `values` is v's
  quantized values [R, C] (contiguous), `values_t` their transposed copy [C, R] if `want_t`
  (else an empty [0] tensor), `scale` float32 as `minifloat.quantize` shapes it.
- `minifloat::dge_scale(dw, w, w_scale, k, cap) -> dw * f'(w / w_scale)` (E2M1, row scales).
- `minifloat::outlier_columns(x, lo, hi) -> int32 flags [C]` (OCC).
"""

from __future__ import annotations

import torch

from minifloat import formats
from minifloat.kernels import triton_elementwise, triton_quant

__all__ = ["quantize", "dge_scale", "outlier_columns", "quantize_shapes"]


def quantize_shapes(r: int, c: int, mode: str, block_r: int, block_c: int) -> tuple[int, int]:
    """Scale shape of quantizing an [r, c] view in `mode`."""
    if mode == "row":
        return (r, 1) if block_c == 0 else (r, -(-c // block_c))
    if mode == "tensor":
        return (1, 1)
    if mode == "block":
        return (-(-r // block_r), -(-c // block_c))
    raise ValueError(f"unknown quantize mode {mode!r}")


@torch.library.custom_op("minifloat::quantize", mutates_args=())
def quantize(
    x: torch.Tensor,
    fmt: str,
    mode: str,
    block_r: int,
    block_c: int,
    transpose: bool,
    row_mult: torch.Tensor | None,
    col_mult: torch.Tensor | None,
    clip_lo: torch.Tensor | None,
    clip_hi: torch.Tensor | None,
    scale: torch.Tensor | None,
    want_t: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    clip = None if clip_lo is None or clip_hi is None else (clip_lo, clip_hi)
    mults = {"row_mult": row_mult, "col_mult": col_mult}
    if mode == "row":
        # Whole rows or 1 x g groups of the view; a transposed view is read through its strides.
        v = x.t() if transpose else x
        out = triton_quant.quantize_rows(
            v, fmt, group=block_c or None, clip=clip, write_transposed=want_t, **mults
        )
        vals, vals_t, s = out.values, out.values_t, out.scale
    elif mode == "tensor":
        # Read x row-major and write whichever layouts are wanted.
        if transpose:
            mults = {"row_mult": col_mult, "col_mult": row_mult}
        out = triton_quant.quantize_tensor(
            x, fmt, scale=scale, clip=clip, write_values=want_t or not transpose,
            write_transposed=transpose or want_t, **mults,
        )  # fmt: skip
        vals, vals_t = (out.values_t, out.values) if transpose else (out.values, out.values_t)
        s = out.scale
    elif mode == "block":
        if row_mult is not None or col_mult is not None:
            raise ValueError("2-D block quantization takes no pre-scaling")
        blk = (block_c, block_r) if transpose else (block_r, block_c)
        out = triton_quant.quantize_blocks(
            x, fmt, blk, clip=clip, write_values=want_t or not transpose,
            write_transposed=transpose or want_t,
        )  # fmt: skip
        vals, vals_t = (out.values_t, out.values) if transpose else (out.values, out.values_t)
        s = out.scale.t().contiguous() if transpose else out.scale
    else:
        raise ValueError(f"unknown quantize mode {mode!r}")
    if not want_t:
        vals_t = x.new_empty((0,), dtype=vals.dtype)
    return vals, vals_t, s


@quantize.register_fake
def _quantize_fake(
    x, fmt, mode, block_r, block_c, transpose, row_mult, col_mult, clip_lo, clip_hi, scale, want_t
):
    r, c = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
    dtype = triton_quant.storage_dtype(formats.get(fmt))
    vals = x.new_empty((r, c), dtype=dtype)
    vals_t = x.new_empty((c, r) if want_t else (0,), dtype=dtype)
    s = x.new_empty(quantize_shapes(r, c, mode, block_r, block_c), dtype=torch.float32)
    return vals, vals_t, s


@torch.library.custom_op("minifloat::dge_scale", mutates_args=())
def dge_scale(
    dw: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, k: float, cap: float
) -> torch.Tensor:
    return triton_elementwise.dge_scale(dw, w, w_scale, k, cap)


@dge_scale.register_fake
def _dge_scale_fake(dw, w, w_scale, k, cap):
    return dw.new_empty(dw.shape, dtype=torch.float32)


@torch.library.custom_op("minifloat::outlier_columns", mutates_args=())
def outlier_columns(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return triton_elementwise.outlier_columns(x.contiguous(), lo, hi)


@outlier_columns.register_fake
def _outlier_columns_fake(x, lo, hi):
    return x.new_empty((x.shape[1],), dtype=torch.int32)
