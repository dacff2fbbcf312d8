"""Triton quantizer kernels: one read of a BF16/FP16/FP32 matrix, quantized values plus scales out.

Every kernel computes exactly what `minifloat.quantize.quantize` computes, in the same float32
steps, so the results are bit-identical:

- group amax of |x| (NaN counted as +inf, so a group holding NaN or inf is "non-finite"),
- `scale = amax / fmt.max` with a correctly rounded division (`tl.math.div_rn`: Triton's plain
  `/` on float32 may lower to an approximate division); all-zero group -> 1; non-finite -> NaN,
- `v = x / scale` (correctly rounded), then rounding onto the grid *arithmetically*:
  `mag = min(|v|, max)`, `quantum = 2^(max(floor(log2 mag), emin) - mbits)` read off the float32
  exponent bits, `round_half_even(mag / quantum) * quantum` (division by a power of two is exact),
  sign copied from v. Grid values are then exactly representable in the storage dtype (E2M1 and
  INT4 in E4M3, E4M3 in E4M3, E5M2 in E5M2, INT8 in int8, or float32), so the final conversion is
  exact whatever rounding mode the hardware conversion uses.

Round-half-to-even of a non-negative float32 `y < 2^22` is `(y + 2^23) - 2^23` (the addition
rounds to an integer ulp); it needs no libdevice call, so the kernels also run under Triton's CPU
interpreter (used by the CPU tests for indexing and masking).

Optional pre-scaling multiplies x by a per-row and/or per-column float32 vector before anything
else (`(x * row_mult) * col_mult`, each a float32 multiply), which is how the backward folds the
fprop scales into the gradient (DESIGN.md "FP4 on Hopper"). Optional transposed output writes a
contiguous transposed copy of the values in the same pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minifloat import formats
from minifloat.formats import ElementFormat

__all__ = [
    "QuantOut",
    "storage_dtype",
    "fmt_constants",
    "quantize_rows",
    "quantize_blocks",
    "quantize_tensor",
]

_MAX_PARTIALS = 1024
# Whole-row quantization splits long rows into slices when the row bands alone give fewer
# programs than this (e.g. a wgrad operand x.t() of 768 rows x 32768 tokens: 48 bands).
_ROW_PROGRAMS = 1024


def _row_slices(bands: int, chunks: int) -> int:
    """How many column slices whole-row quantization uses for `bands` row bands of `chunks`
    column tiles: 1 when the bands alone fill the GPU, else enough slices to reach
    _ROW_PROGRAMS programs, each at least two tiles wide."""
    if bands >= _ROW_PROGRAMS or chunks < 4:
        return 1
    return min(triton.cdiv(_ROW_PROGRAMS, bands), chunks // 2)


@dataclass(frozen=True, kw_only=True)
class FmtConstants:
    """Compile-time constants describing an element format to the kernels."""

    fmax: float
    emin: int
    mbits: int
    is_int: bool


@dataclass
class QuantOut:
    """Kernel results: `values` [R, C] and/or `values_t` [C, R] (storage dtype), float32 `scale`;
    for tensor granularity also per-band amaxes (`amax` reduces them: NaN counted as inf)."""

    values: torch.Tensor | None
    values_t: torch.Tensor | None
    scale: torch.Tensor
    amax_parts: torch.Tensor | None = None

    @property
    def amax(self) -> torch.Tensor | None:
        """The tensor's current amax (0-d float32), for an amax history."""
        return None if self.amax_parts is None else self.amax_parts.amax()


def fmt_constants(fmt: ElementFormat) -> FmtConstants:
    """The constants a kernel needs to round onto `fmt`'s grid."""
    if isinstance(fmt, formats.FloatFormat):
        return FmtConstants(fmax=fmt.max, emin=fmt.emin, mbits=fmt.mbits, is_int=False)
    if isinstance(fmt, formats.IntFormat):
        return FmtConstants(fmax=fmt.max, emin=0, mbits=0, is_int=True)
    raise ValueError(f"no Triton rounding for format {fmt.name!r}")


def storage_dtype(fmt: ElementFormat) -> torch.dtype:
    """The 8-bit dtype that holds `fmt`'s values exactly (what the FP8 GEMMs consume)."""
    if fmt.name == "e5m2":
        return torch.float8_e5m2
    if fmt.name == "int8":
        return torch.int8
    if fmt.name in ("e4m3", "e2m1", "int4") or (fmt.bits == 4 and _fits_e4m3(fmt)):
        return torch.float8_e4m3fn
    raise ValueError(f"no 8-bit storage for format {fmt.name!r}")


def _fits_e4m3(fmt: ElementFormat) -> bool:
    e4m3 = formats.get("e4m3")
    grid = fmt.grid.float()
    return bool(torch.equal(e4m3.round(grid), grid))


# ---------------------------------------------------------------------------------------------
# Device functions
# ---------------------------------------------------------------------------------------------


@triton.jit
def _abs_inf_nan(x):
    """|x| with NaN replaced by +inf, so that max() marks non-finite groups (Triton's max drops
    NaN)."""
    a = tl.abs(x)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _scale_of(amax, FMAX: tl.constexpr):
    """Dequantization scale of a group from its amax (NaN already mapped to inf)."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32))
    # As quantize(): a subnormal amax may underflow to a zero scale; floor at 2^-149.
    tiniest = tl.full(amax.shape, 1, tl.int32).to(tl.float32, bitcast=True)
    s = tl.where(s > 0.0, s, tiniest)
    s = tl.where(amax > 0.0, s, 1.0)
    return tl.where(amax == float("inf"), float("nan"), s)


@triton.jit
def _round_grid(
    v,
    seed,
    rng_offsets,
    FMAX: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    IS_INT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Round float32 v onto the grid (saturating at FMAX, NaN kept, sign kept bit-for-bit)."""
    mag = tl.abs(v)
    mag = tl.where(mag > FMAX, FMAX, mag)  # a comparison, not minimum(): NaN must survive
    if IS_INT:
        y = mag
        quantum = tl.full(mag.shape, 1.0, tl.float32)
    else:
        e = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, EMIN)
        inv_quantum = ((127 + MBITS - e) << 23).to(tl.float32, bitcast=True)
        quantum = ((127 - MBITS + e) << 23).to(tl.float32, bitcast=True)
        y = mag * inv_quantum  # exact: a power-of-two scaling
    if STOCHASTIC:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        r = tl.floor(y + tl.rand(seed, rng_offsets))
    else:
        r = (y + 8388608.0) - 8388608.0  # round half to even, y < 2^22
    q = r * quantum
    q = tl.where(q > FMAX, FMAX, q)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _load_scaled(
    x_ptr,
    rmul_ptr,
    cmul_ptr,
    rows,
    cols,
    R,
    C,
    stride_xr,
    stride_xc,
    lo_ptr,
    hi_ptr,
    HAS_CLIP: tl.constexpr,
    HAS_RMUL: tl.constexpr,
    HAS_CMUL: tl.constexpr,
):
    """Load a [rows, cols] tile as float32, clip finite entries to [lo, hi] (OCC) if asked, then
    apply the optional pre-scaling."""
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    ptrs = x_ptr + rows64[:, None] * stride_xr + cols64[None, :] * stride_xc
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_CLIP:
        lo = tl.load(lo_ptr)
        hi = tl.load(hi_ptr)
        xc = tl.where(x < lo, lo, x)
        xc = tl.where(xc > hi, hi, xc)
        x = tl.where(tl.abs(x) < float("inf"), xc, x)  # non-finite entries pass unchanged
    if HAS_RMUL:
        x = x * tl.load(rmul_ptr + rows, mask=rows < R, other=1.0)[:, None]
    if HAS_CMUL:
        x = x * tl.load(cmul_ptr + cols, mask=cols < C, other=1.0)[None, :]
    return x, mask


@triton.jit
def _store_tile(q, q_ptr, rows, cols, mask, stride_qr, stride_qc):
    ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_qr + cols.to(tl.int64)[None, :] * stride_qc
    tl.store(ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _band_amax(
    x_ptr, stride_xr, stride_xc, R, C, rmul_ptr, cmul_ptr, lo_ptr, hi_ptr, rows, first_chunk,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, N_CHUNKS: tl.constexpr,
    HAS_CLIP: tl.constexpr, HAS_RMUL: tl.constexpr, HAS_CMUL: tl.constexpr,
):  # fmt: skip
    """Per-row amax (NaN -> inf) of `rows` over N_CHUNKS tiles of BLOCK_C columns."""
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for i in range(0, N_CHUNKS):
        cols = (first_chunk + i) * BLOCK_C + tl.arange(0, BLOCK_C)
        x, mask = _load_scaled(
            x_ptr, rmul_ptr, cmul_ptr, rows, cols, R, C, stride_xr, stride_xc, lo_ptr, hi_ptr,
            HAS_CLIP, HAS_RMUL, HAS_CMUL,
        )  # fmt: skip
        amax = tl.maximum(amax, tl.max(_abs_inf_nan(x), axis=1))
    return amax


@triton.jit
def _quant_rows_kernel(
    x_ptr, stride_xr, stride_xc, R, C,
    rmul_ptr, cmul_ptr, lo_ptr, hi_ptr,
    q_ptr, stride_qr, stride_qc,
    s_ptr, stride_sr, stride_sg,
    part_ptr, stride_pr, seed,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, N_CHUNKS: tl.constexpr,
    N_PARTS: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_CLIP: tl.constexpr, HAS_RMUL: tl.constexpr, HAS_CMUL: tl.constexpr,
    FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, IS_INT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Groups of 1 x GROUP along each row (GROUP == 0: the whole row).

    Program (pid_r, pid_g) covers N_CHUNKS tiles of BLOCK_C columns starting at tile
    pid_g * N_CHUNKS: one 1 x GROUP group, a whole row (one program per row band, two passes over
    C: amax, then quantize; the re-read mostly hits L2), or, when N_PARTS > 0, one of N_PARTS
    slices of whole rows whose amax `_row_amax_kernel` already wrote to `part_ptr` [R, N_PARTS]
    (long rows, few row bands: splitting C keeps every SM busy). Loop trip counts are
    compile-time constants: Triton's CPU interpreter cannot loop over run-time bounds with
    numpy >= 2.4.
    """
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    if N_PARTS > 0:
        parts = tl.arange(0, BLOCK_P)
        pmask = (rows[:, None] < R) & (parts[None, :] < N_PARTS)
        pptrs = part_ptr + rows.to(tl.int64)[:, None] * stride_pr + parts[None, :]
        amax = tl.max(tl.load(pptrs, mask=pmask, other=0.0), axis=1)
        scale = _scale_of(amax, FMAX)
        tl.store(s_ptr + rows.to(tl.int64) * stride_sr, scale, mask=(rows < R) & (pid_g == 0))
    else:
        amax = _band_amax(
            x_ptr, stride_xr, stride_xc, R, C, rmul_ptr, cmul_ptr, lo_ptr, hi_ptr, rows,
            pid_g * N_CHUNKS, BLOCK_R, BLOCK_C, N_CHUNKS, HAS_CLIP, HAS_RMUL, HAS_CMUL,
        )  # fmt: skip
        scale = _scale_of(amax, FMAX)
        tl.store(s_ptr + rows.to(tl.int64) * stride_sr + pid_g * stride_sg, scale, mask=rows < R)
    for i in range(0, N_CHUNKS):
        cols = (pid_g * N_CHUNKS + i) * BLOCK_C + tl.arange(0, BLOCK_C)
        x, mask = _load_scaled(
            x_ptr, rmul_ptr, cmul_ptr, rows, cols, R, C, stride_xr, stride_xc, lo_ptr, hi_ptr,
            HAS_CLIP, HAS_RMUL, HAS_CMUL,
        )  # fmt: skip
        v = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        offs = rows[:, None] * C + cols[None, :]
        q = _round_grid(v, seed, offs, FMAX, EMIN, MBITS, IS_INT, STOCHASTIC)
        _store_tile(q, q_ptr, rows, cols, mask, stride_qr, stride_qc)


@triton.jit
def _row_amax_kernel(
    x_ptr, stride_xr, stride_xc, R, C,
    rmul_ptr, cmul_ptr, lo_ptr, hi_ptr, part_ptr, stride_pr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, N_CHUNKS: tl.constexpr,
    HAS_CLIP: tl.constexpr, HAS_RMUL: tl.constexpr, HAS_CMUL: tl.constexpr,
):  # fmt: skip
    """Per-row amax (NaN -> inf) of one slice of N_CHUNKS x BLOCK_C columns, into part_ptr
    [R, slices]; max is exact in any order, so the split changes no bit of the result."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    amax = _band_amax(
        x_ptr, stride_xr, stride_xc, R, C, rmul_ptr, cmul_ptr, lo_ptr, hi_ptr, rows,
        tl.program_id(1) * N_CHUNKS, BLOCK_R, BLOCK_C, N_CHUNKS, HAS_CLIP, HAS_RMUL, HAS_CMUL,
    )  # fmt: skip
    ptrs = part_ptr + rows.to(tl.int64) * stride_pr + tl.program_id(1)
    tl.store(ptrs, amax, mask=rows < R)


@triton.jit
def _amax_partial_kernel(
    x_ptr, stride_xr, stride_xc, R, C,
    rmul_ptr, cmul_ptr, lo_ptr, hi_ptr, part_ptr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, N_CHUNKS: tl.constexpr,
    HAS_CLIP: tl.constexpr, HAS_RMUL: tl.constexpr, HAS_CMUL: tl.constexpr,
):  # fmt: skip
    """One amax (NaN -> inf) per band of BLOCK_R rows, for tensor-wise scales."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    amax = _band_amax(
        x_ptr, stride_xr, stride_xc, R, C, rmul_ptr, cmul_ptr, lo_ptr, hi_ptr, rows, 0,
        BLOCK_R, BLOCK_C, N_CHUNKS, HAS_CLIP, HAS_RMUL, HAS_CMUL,
    )  # fmt: skip
    tl.store(part_ptr + tl.program_id(0), tl.max(amax, 0))


@triton.jit
def _quant_tiles_kernel(
    x_ptr, stride_xr, stride_xc, R, C,
    rmul_ptr, cmul_ptr, lo_ptr, hi_ptr,
    q_ptr, stride_qr, stride_qc,
    s_ptr, stride_sr, stride_sc,
    part_ptr, n_part, given_ptr,
    seed,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_CLIP: tl.constexpr, HAS_RMUL: tl.constexpr, HAS_CMUL: tl.constexpr,
    FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, IS_INT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """BLOCK_R x BLOCK_C tiles in one pass. SCALE_MODE 0: each tile is a group (2-D blocks such as
    128 x 128); 1: one tensor scale from the partial amaxes; 2: a given tensor scale (delayed
    scaling; values saturate)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    x, mask = _load_scaled(
        x_ptr, rmul_ptr, cmul_ptr, rows, cols, R, C, stride_xr, stride_xc, lo_ptr, hi_ptr,
        HAS_CLIP, HAS_RMUL, HAS_CMUL,
    )  # fmt: skip
    if SCALE_MODE == 0:
        scale = _scale_of(tl.max(tl.max(_abs_inf_nan(x), 1), 0), FMAX)
        tl.store(s_ptr + pid_r * stride_sr + pid_c * stride_sc, scale)
    elif SCALE_MODE == 1:
        p = tl.arange(0, BLOCK_P)
        amax = tl.max(tl.load(part_ptr + p, mask=p < n_part, other=0.0), 0)
        scale = _scale_of(amax, FMAX)
        if (pid_r == 0) & (pid_c == 0):
            tl.store(s_ptr, scale)
    else:
        scale = tl.load(given_ptr)
    v = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * scale)
    offs = rows[:, None] * C + cols[None, :]
    q = _round_grid(v, seed, offs, FMAX, EMIN, MBITS, IS_INT, STOCHASTIC)
    _store_tile(q, q_ptr, rows, cols, mask, stride_qr, stride_qc)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _check_matrix(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"Triton quantizers take 2-D tensors, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"Triton quantizers take fp32/bf16/fp16 input, got {x.dtype}")


def _clip_args(
    clip: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    if clip is None:
        return x, x, False  # any pointers: never read
    lo, hi = clip
    return lo.float().reshape(1), hi.float().reshape(1), True


def _mult(v: torch.Tensor | None, n: int, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if v is None:
        return x, False  # any pointer: never read
    v = v.reshape(-1)
    if v.numel() != n:
        raise ValueError(f"pre-scale vector has {v.numel()} entries, expected {n}")
    return v.float().contiguous(), True


def _finish(
    q: torch.Tensor, scale: torch.Tensor, write_values: bool, write_transposed: bool, **extra
) -> QuantOut:
    """Package kernel results; the transposed copy is a byte-level transpose of `q`.

    The kernels write only the row-major layout: storing FP8 tiles through transposed pointers
    (with or without `tl.trans` first) scrambled about a quarter of the bytes under Triton 3.6 on
    an H200 (2026-11-22, benchmarks/diag_nan.py), so the copy is made by PyTorch, bit for bit.
    """
    if not (write_values or write_transposed):
        raise ValueError("ask for values, transposed values, or both")
    qt = None
    if write_transposed:  # FP8 moves as raw bytes, so no dtype-specific copy can touch a value
        raw = q.view(torch.uint8) if q.element_size() == 1 else q
        # clone(), not contiguous(): for a single row or column the transpose is already
        # contiguous, and a custom op's outputs must not alias each other.
        qt = raw.t().clone(memory_format=torch.contiguous_format).view(q.dtype)
    return QuantOut(values=q if write_values else None, values_t=qt, scale=scale, **extra)


@dataclass(frozen=True)
class _Launch:
    """What every quantizer launch needs beyond its own layout: the checked format, the output
    buffer, the rounding arguments and the OCC clip bounds."""

    fmt: ElementFormat
    q: torch.Tensor
    stochastic: bool
    seed: int
    lo: torch.Tensor
    hi: torch.Tensor
    has_clip: bool


def _prepare(
    x: torch.Tensor,
    fmt: str | ElementFormat,
    *,
    out_dtype: torch.dtype | None,
    clip: tuple[torch.Tensor, torch.Tensor] | None,
    rounding: str,
    seed: int | None,
) -> _Launch:
    _check_matrix(x)
    fmt = formats.get(fmt)
    q = torch.empty(x.shape, dtype=out_dtype or storage_dtype(fmt), device=x.device)
    stochastic, seed = _rounding_args(rounding, seed)
    lo, hi, has_clip = _clip_args(clip, x)
    return _Launch(fmt, q, stochastic, seed, lo, hi, has_clip)


def _rounding_args(rounding: str, seed: int | None) -> tuple[bool, int]:
    if rounding not in formats.ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {formats.ROUNDING_MODES}, got {rounding!r}")
    stochastic = rounding == "stochastic"
    if stochastic and seed is None:
        raise ValueError("stochastic rounding needs an explicit integer seed")
    return stochastic, int(seed or 0) & 0x7FFFFFFF


def _fmt_kwargs(fmt: ElementFormat) -> dict:
    k = fmt_constants(fmt)
    return {"FMAX": k.fmax, "EMIN": k.emin, "MBITS": k.mbits, "IS_INT": k.is_int}


def quantize_rows(
    x: torch.Tensor,
    fmt: str | ElementFormat,
    *,
    group: int | None = None,
    row_mult: torch.Tensor | None = None,
    col_mult: torch.Tensor | None = None,
    clip: tuple[torch.Tensor, torch.Tensor] | None = None,
    write_values: bool = True,
    write_transposed: bool = False,
    out_dtype: torch.dtype | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    tuning: tuple[int, int, int] | None = None,
) -> QuantOut:
    """Quantize each row of the 2-D `x` (any strides) in groups of `group` columns (None: the
    whole row). Scale shape [R, 1] (whole rows) or [R, ceil(C / group)]. `clip=(lo, hi)` clamps
    finite entries first (OCC), then `row_mult` [R] / `col_mult` [C] multiply (float32).
    `tuning=(block_r, block_c, num_warps)` overrides the launch shape (benchmarks only).

    Column granularity is `quantize_rows(x.t())`: its `values` are the contiguous transposed copy
    the backward GEMMs need, read coalesced through x's strides.
    """
    k = _prepare(x, fmt, out_dtype=out_dtype, clip=clip, rounding=rounding, seed=seed)
    r, c = x.shape
    rm, has_rm = _mult(row_mult, r, x)
    cm, has_cm = _mult(col_mult, c, x)
    if group is None:
        n_groups, block_c = 1, min(256, triton.next_power_of_2(max(c, 16)))
    else:
        if group < 16 or group & (group - 1):
            raise ValueError(f"group must be a power of two >= 16, got {group}")
        n_groups, block_c = math.ceil(c / group), group
    scale = torch.empty((r, n_groups), dtype=torch.float32, device=x.device)
    block_r, warps = 16, 4
    if tuning is not None:
        block_r, warps = tuning[0], tuning[2]
        block_c = tuning[1] if group is None else block_c
    n_chunks, n_parts, parts = 1, 0, scale  # parts: any pointer unless rows are split
    if group is None:
        n_chunks = triton.cdiv(c, block_c)
        slices = _row_slices(triton.cdiv(r, block_r), n_chunks)
        if slices > 1:
            n_chunks = triton.cdiv(n_chunks, slices)
            n_parts = triton.cdiv(triton.cdiv(c, block_c), n_chunks)
            parts = torch.empty((r, n_parts), dtype=torch.float32, device=x.device)
            _row_amax_kernel[(triton.cdiv(r, block_r), n_parts)](
                x, *x.stride(), r, c, rm, cm, k.lo, k.hi, parts, parts.stride(0),
                BLOCK_R=block_r, BLOCK_C=block_c, N_CHUNKS=n_chunks,
                HAS_CLIP=k.has_clip, HAS_RMUL=has_rm, HAS_CMUL=has_cm, num_warps=warps,
            )  # fmt: skip
    grid = (triton.cdiv(r, block_r), max(n_groups, n_parts))
    _quant_rows_kernel[grid](
        x, *x.stride(), r, c, rm, cm, k.lo, k.hi,
        k.q, *k.q.stride(),
        scale, *scale.stride(), parts, parts.stride(0), k.seed,
        GROUP=group or 0, BLOCK_R=block_r, BLOCK_C=block_c, N_CHUNKS=n_chunks,
        N_PARTS=n_parts, BLOCK_P=triton.next_power_of_2(max(n_parts, 1)),
        HAS_CLIP=k.has_clip, HAS_RMUL=has_rm, HAS_CMUL=has_cm,
        STOCHASTIC=k.stochastic, num_warps=warps, **_fmt_kwargs(k.fmt),
    )  # fmt: skip
    return _finish(k.q, scale, write_values, write_transposed)


def quantize_blocks(
    x: torch.Tensor,
    fmt: str | ElementFormat,
    block: tuple[int, int] = (128, 128),
    *,
    clip: tuple[torch.Tensor, torch.Tensor] | None = None,
    write_values: bool = True,
    write_transposed: bool = False,
    out_dtype: torch.dtype | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
) -> QuantOut:
    """Quantize 2-D blocks of `x` (block dims powers of two >= 16, e.g. (128, 128) or (16, 16));
    scale shape [ceil(R / br), ceil(C / bc)]. `values_t` is the transposed copy (its scales are
    `scale.t()`)."""
    br, bc = block
    if min(br, bc) < 16 or br & (br - 1) or bc & (bc - 1):
        raise ValueError(f"2-D blocks must be powers of two >= 16, got {block}")
    k = _prepare(x, fmt, out_dtype=out_dtype, clip=clip, rounding=rounding, seed=seed)
    r, c = x.shape
    scale = torch.empty((triton.cdiv(r, br), triton.cdiv(c, bc)), dtype=torch.float32,
                        device=x.device)  # fmt: skip
    _quant_tiles_kernel[scale.shape](
        x, *x.stride(), r, c, x, x, k.lo, k.hi,
        k.q, *k.q.stride(),
        scale, *scale.stride(), scale, 1, scale, k.seed,
        BLOCK_R=br, BLOCK_C=bc, BLOCK_P=16, SCALE_MODE=0,
        HAS_CLIP=k.has_clip, HAS_RMUL=False, HAS_CMUL=False,
        STOCHASTIC=k.stochastic,
        num_warps=8 if br * bc >= 8192 else 4, **_fmt_kwargs(k.fmt),
    )  # fmt: skip
    return _finish(k.q, scale, write_values, write_transposed)


def quantize_tensor(
    x: torch.Tensor,
    fmt: str | ElementFormat,
    *,
    scale: torch.Tensor | None = None,
    row_mult: torch.Tensor | None = None,
    col_mult: torch.Tensor | None = None,
    clip: tuple[torch.Tensor, torch.Tensor] | None = None,
    write_values: bool = True,
    write_transposed: bool = False,
    out_dtype: torch.dtype | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
) -> QuantOut:
    """One scale for the whole 2-D `x`: its own absmax scale, or a given float32 `scale` (delayed
    scaling; values saturate at ±max). Scale shape [1, 1]; `amax` is always the tensor's current
    amax (NaN mapped to inf), for an amax history."""
    k = _prepare(x, fmt, out_dtype=out_dtype, clip=clip, rounding=rounding, seed=seed)
    r, c = x.shape
    rm, has_rm = _mult(row_mult, r, x)
    cm, has_cm = _mult(col_mult, c, x)
    br, bc = 64, 128
    grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
    # Bands of rows, at most _MAX_PARTIALS of them, so each quantizing program reduces few.
    pr = max(16, min(256, triton.next_power_of_2(triton.cdiv(r, _MAX_PARTIALS))))
    parts = torch.empty(triton.cdiv(r, pr), dtype=torch.float32, device=x.device)
    pc = 128 if pr <= 64 else 32
    _amax_partial_kernel[(parts.numel(),)](
        x, *x.stride(), r, c, rm, cm, k.lo, k.hi, parts,
        BLOCK_R=pr, BLOCK_C=pc, N_CHUNKS=triton.cdiv(c, pc),
        HAS_CLIP=k.has_clip, HAS_RMUL=has_rm, HAS_CMUL=has_cm, num_warps=4,
    )  # fmt: skip
    out_scale = torch.empty((1, 1), dtype=torch.float32, device=x.device)
    if scale is None:
        mode, given = 1, out_scale
    else:
        mode, given = 2, scale.reshape(1).float().contiguous()
        out_scale.copy_(given.reshape(1, 1))
    _quant_tiles_kernel[grid](
        x, *x.stride(), r, c, rm, cm, k.lo, k.hi,
        k.q, *k.q.stride(),
        out_scale, 0, 0, parts, parts.numel(), given, k.seed,
        BLOCK_R=br, BLOCK_C=bc, BLOCK_P=triton.next_power_of_2(parts.numel()),
        SCALE_MODE=mode, HAS_CLIP=k.has_clip, HAS_RMUL=has_rm, HAS_CMUL=has_cm,
        STOCHASTIC=k.stochastic,
        num_warps=4, **_fmt_kwargs(k.fmt),
    )  # fmt: skip
    return _finish(k.q, out_scale, write_values, write_transposed, amax_parts=parts)
