"""How fast could the SwiGLU backward's quantization run as two hand-written kernels? (issue 13)

    PYTHONPATH=src python benchmarks/swiglu_probe.py [--out-dir DIR] [--date D] [--tag T]
        [--tiles "BM,BN,W,BM,BN,W;..."] [--quotients f64,fma] [--configs rowwise,fp4,tensorwise]
        [--aten]
    PYTHONPATH=src:<triton> TRITON_INTERPRET=1 python benchmarks/swiglu_probe.py --smoke

In training, the compiled backward of a converted SwiGLU MLP (`w2(silu(w1 x) * w3 x)`) reads
the saved g = w1 x and u = w3 x and the down projection's dgrad output dh, and quantizes five
GEMM operands from them: h = silu(g)·u for the down projection's wgrad, and dg and du each for
their projection's dgrad (row layout, scales per token) and wgrad (transposed, scales per
channel over the tokens). Inductor emits three passes over g, u and dh (row maxima, column
maxima in 256-row bands, then one 2-D tiled kernel with the five casts), and the transposed
outputs are then copied by `transpose_copy` or written with strided byte stores. At 1.3B that
is ~24 ms of fp4-dge's 245 ms step (docs/hopper_sessions.md, session 26).

This probe times, for one [M, F] SwiGLU at 1.3B and 7B widths, the compiled code as training
ran it until session 60 (`quantize_operand` plus `transpose_copy` for each transposed operand;
since then compiled training writes those from the cast's kernel) against two
Triton kernels: one pass that computes h, dg and du once per tile and writes the tile's row
and column maxima (partials, reduced by two small ops), and one pass that writes all five
operands, the transposed ones through shared memory. Same quotients (`exact.div_rn_by_scale`'s
float64 reciprocals) and rounding (`round_to_storage`'s forms), so the bytes should match;
the probe reports how many differ. Two configurations:
- `rowwise` (fp8-rowwise): h_qᵀ E4M3 with per-channel scales; dg, du E4M3 row and transposed.
- `fp4` (fp4-direct / fp4-dge): h_q E2M1 per token written transposed (the down projection's
  reused wgrad operand); dg, du E5M2, row with the weight's row scales folded into columns
  (dgrad) and transposed with the input's row scales folded into rows (wgrad).
- `tensorwise` (fp8-tensorwise, session 29): h_qᵀ E4M3 under h's tensor scale from forward
  (saved, so backward reduces only dg and du); dg, du E5M2 under one scale each, row layout
  and transposed (the same bytes). As trained, h_qᵀ is a plain transposed copy that inductor
  fuses into the cast kernel and dg, du are transposed by `transpose_copy` (until session 60).

The Triton rows run each tile choice (maxima and cast kernels' BM, BN, warps) with the
float64 quotient and with Markstein's FMA quotient (`--quotients`). Writes
`swiglu_probe[_<tag>]_<gpu>_<date>.{md,json}`; needs a CUDA GPU with Triton. `--smoke` checks
the kernels on the CPU under Triton's interpreter against a float32 reference (small shapes,
writes nothing). Results: docs/hopper_sessions.md, sessions 27 and 29.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import RESULTS_DIR, copy_bandwidth, kernel_profile, time_ms, write_results  # noqa: E402
from division_probe import fma_factors  # noqa: E402  (s1, 1/s1, p1, p2, session 22)
from minifloat.kernels.operand import quantize_operand, scale_from_amax  # noqa: E402
from minifloat.kernels.transpose import transpose_copy  # noqa: E402

CONFIGS = ("rowwise", "fp4", "tensorwise")
FMT = {  # name -> (max, torch dtype, is_e2m1)
    "e4m3": (448.0, torch.float8_e4m3fn, False),
    "e5m2": (57344.0, torch.float8_e5m2, False),
    "e2m1": (6.0, torch.float8_e4m3fn, True),
}


# --------------------------------------------------------------------------- the compiled code


def reference(g, u, dh, config, pg=None, pu=None, px=None, fp32=False, s_h=None):
    """The five operands as training computes them (compiled): [(values, scale)]. `fp32`:
    h, dg and du in float32 from the bf16 inputs, as the Triton kernels (and inductor's Triton
    code) compute them, without the eager ops' bf16 roundings between them."""
    if fp32:
        g, u, dh = g.float(), u.float(), dh.float()
        sig = torch.sigmoid(g)
        sg, dg = g * sig, dh * u * sig * (1.0 + g * (1.0 - sig))
    else:
        sg = F.silu(g)
        dg = torch.ops.aten.silu_backward(dh * u, g)
    h = sg * u
    du = dh * sg
    if config == "tensorwise":  # s_h: h's tensor scale, from forward
        h_q, s_h = quantize_operand(h, "e4m3", "tensor", scale=s_h)
        outs = [(h_q.t().contiguous(), s_h)]
        for v in (dg, du):
            v_q, s_v = quantize_operand(v, "e5m2", "tensor")
            outs += [(v_q, s_v), (transpose_copy(v_q), s_v)]
        return outs
    if config == "rowwise":
        h_t, s_h = quantize_operand(h, "e4m3", "row", transpose=True)
        outs = [(transpose_copy(h_t.t()), s_h)]
        for v in (dg, du):
            outs.append(quantize_operand(v, "e4m3", "row"))
            v_t, s_t = quantize_operand(v, "e4m3", "row", transpose=True)
            outs.append((transpose_copy(v_t.t()), s_t))
        return outs
    h_q, s_h = quantize_operand(h, "e2m1", "row")
    outs = [(transpose_copy(h_q), s_h.t().contiguous())]
    for v, pw in ((dg, pg), (du, pu)):
        outs.append(quantize_operand(v, "e5m2", "row", prescale=pw))
        v_t, s_t = quantize_operand(v, "e5m2", "row", prescale=px, transpose=True)
        outs.append((transpose_copy(v_t.t()), s_t))
    return outs


# --------------------------------------------------------------------------- the Triton kernels


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(rows, cols, in-bounds mask, row-major offsets) of this program's tile of an [M, N]
    tensor on a (row blocks, column blocks) grid."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    return rows, cols, mask, rows[:, None].to(tl.int64) * N + cols[None, :]


@triton.jit
def _swiglu_aten(g_ptr, u_ptr, dh_ptr, offs, mask):
    """(h, dg, du) in float32 as inductor computes ATen's `silu` and `silu_backward`:
    libdevice's exp, the two IEEE divisions, the products in the same order (session 35)."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = libdevice.exp(-g) + 1.0
    silu = g / d
    sig = 1 / d
    dg = dh * u * sig * (g * (1.0 - sig) + 1.0)
    return silu * u, dg, dh * silu


@triton.jit
def _swiglu(g_ptr, u_ptr, dh_ptr, offs, mask, ATEN: tl.constexpr):
    """h, dg, du in float32 from bf16 g, u, dh. ATEN: `_swiglu_aten` (inductor's arithmetic);
    else `tl.sigmoid` (sessions 27 and 29: last-bit differences from inductor's code)."""
    if ATEN:
        return _swiglu_aten(g_ptr, u_ptr, dh_ptr, offs, mask)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    sg = g * sig
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    return sg * u, dg, dh * sg


@triton.jit
def _row_max(v):
    """max |v| along rows, as the maximum of the magnitudes' bits (for non-negative floats the
    integer order is the float order, and NaN's bits exceed inf's: NaN propagates)."""
    bits = tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _col_max(v):
    bits = tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile_max(v):
    bits = tl.max(tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _folded(dg, du, pg_ptr, pu_ptr, px_ptr, rows, cols, rmask, cmask, PRESCALE: tl.constexpr):
    """(dg_r, du_r, dg_c, du_c): the row-layout operands' values with the weights' row scales
    folded into their columns (dgrad) and the transposed ones' with the input's row scales
    folded into their rows (wgrad); dg and du themselves without PRESCALE."""
    dg_r, du_r, dg_c, du_c = dg, du, dg, du
    if PRESCALE:
        pg = tl.load(pg_ptr + cols, mask=cmask, other=0.0)[None, :]
        pu = tl.load(pu_ptr + cols, mask=cmask, other=0.0)[None, :]
        px = tl.load(px_ptr + rows, mask=rmask, other=0.0)[:, None]
        dg_r, du_r, dg_c, du_c = dg * pg, du * pu, dg * px, du * px
    return dg_r, du_r, dg_c, du_c


@triton.jit
def _maxima_kernel(
    g_ptr, u_ptr, dh_ptr, pg_ptr, pu_ptr, px_ptr,
    h_part, dg_row, du_row, dg_col, du_col,
    M, N, NB,
    H_ROW: tl.constexpr, PRESCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    TENSOR: tl.constexpr, ATEN: tl.constexpr,
):  # fmt: skip
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows, cols, mask, offs = _tile(M, N, BM, BN)
    h, dg, du = _swiglu(g_ptr, u_ptr, dh_ptr, offs, mask, ATEN)
    rmask, cmask = rows < M, cols < N
    if TENSOR:  # h's scale comes from forward; dg's and du's tile maxima only
        tl.store(dg_row + pm.to(tl.int64) * NB + pn, _tile_max(dg))
        tl.store(du_row + pm.to(tl.int64) * NB + pn, _tile_max(du))
        return
    if H_ROW:
        tl.store(h_part + rows.to(tl.int64) * NB + pn, _row_max(h), mask=rmask)
    else:
        tl.store(h_part + pm.to(tl.int64) * N + cols, _col_max(h), mask=cmask)
    dg_r, du_r, dg_c, du_c = _folded(
        dg, du, pg_ptr, pu_ptr, px_ptr, rows, cols, rmask, cmask, PRESCALE
    )
    tl.store(dg_row + rows.to(tl.int64) * NB + pn, _row_max(dg_r), mask=rmask)
    tl.store(du_row + rows.to(tl.int64) * NB + pn, _row_max(du_r), mask=rmask)
    tl.store(dg_col + pm.to(tl.int64) * N + cols, _col_max(dg_c), mask=cmask)
    tl.store(du_col + pm.to(tl.int64) * N + cols, _col_max(du_c), mask=cmask)


@triton.jit
def _round_to_grid(mag, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """|q| (finite or NaN, at most the format's max) rounded to nearest even on a grid of MBITS
    mantissa bits and smallest normal exponent EMIN, in float32: the spacing's power of two
    from the exponent bits, then the 2^23 addition (float32 addition rounds ties to even)."""
    e = (mag.to(tl.int32, bitcast=True) >> 23) - 127
    e = tl.minimum(tl.maximum(e, EMIN), 20) - MBITS  # 20: above every format's top binade
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return ((mag * inv_step + 8388608.0) - 8388608.0) * step


@triton.jit
def _group(ptr, idx, mask, ROWS: tl.constexpr):
    """A per-row ([BM, 1]) or per-column ([1, BN]) vector of group values."""
    v = tl.load(ptr + idx, mask=mask, other=1.0)
    return v[:, None] if ROWS else v[None, :]


@triton.jit
def _quotient(v, ptr, idx, mask, G, ROWS: tl.constexpr, FMA: tl.constexpr):
    """v / s correctly rounded, s the group's scale. Float64 (FMA False): ptr holds RN(1/s) in
    float64 and the quotient is RN32(v * (1/s)), as `exact.div_rn_by_scale`. FMA: ptr holds
    [s1, r1, p1, p2] (s = s1 / (p1 p2), s1 in [0.5, 1), r1 = RN(1/s1)) and Markstein's
    correction gives the same bits: x = v p1 p2, q0 = RN(x r1), e = fma(-q0, s1, x) exact,
    q = fma(e, r1, q0) (quotients below 2^-100 aside, which every format rounds to zero;
    docs/hopper_sessions.md, session 22)."""
    if FMA:
        s1 = _group(ptr, idx, mask, ROWS)
        r1 = _group(ptr + G, idx, mask, ROWS)
        x = v * _group(ptr + 2 * G, idx, mask, ROWS) * _group(ptr + 3 * G, idx, mask, ROWS)
        q0 = x * r1
        e = tl.fma(-q0, s1, x)
        q = tl.where((tl.abs(e) < float("inf")) & (q0 != 0.0), tl.fma(e, r1, q0), q0)
    else:
        q = (v.to(tl.float64) * _group(ptr, idx, mask, ROWS)).to(tl.float32)
    return q


@triton.jit
def _to_storage(
    v, recip, FMT_MAX: tl.constexpr, E2M1: tl.constexpr, E5M2: tl.constexpr,
    GRID: tl.constexpr,
):  # fmt: skip
    """round_to_storage(q) for q = v / s correctly rounded (`_quotient`). GRID: round on
    the grid here (exact casts), for Triton's CPU interpreter, whose float32 -> FP8 casts drop
    a rounding's carry into the next binade; the GPU's casts round correctly themselves."""
    q = recip
    mag = tl.where(tl.abs(q) > FMT_MAX, FMT_MAX, tl.abs(q))
    if E2M1:
        mag = _round_to_grid(mag, 1, 0)
    elif GRID:
        mag = _round_to_grid(mag, 2 if E5M2 else 3, -14 if E5M2 else -6)
    sign = q.to(tl.int32, bitcast=True) & -2147483648
    q = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return q.to(tl.float8e5 if E5M2 else tl.float8e4nv)


@triton.jit
def _cast_kernel(
    g_ptr, u_ptr, dh_ptr, pg_ptr, pu_ptr, px_ptr,
    r_h, r_dg_row, r_du_row, r_dg_col, r_du_col,
    h_t, dg_q, du_q, dg_t, du_t,
    M, N,
    H_ROW: tl.constexpr, PRESCALE: tl.constexpr,
    H_MAX: tl.constexpr, H_E2M1: tl.constexpr, G_MAX: tl.constexpr, G_E5M2: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, GRID: tl.constexpr, FMA: tl.constexpr,
    ATEN: tl.constexpr,
):  # fmt: skip
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    offs_t = cols[:, None].to(tl.int64) * M + rows[None, :]
    mask_t = cmask[:, None] & rmask[None, :]
    h, dg, du = _swiglu(g_ptr, u_ptr, dh_ptr, offs, mask, ATEN)
    if H_ROW:
        qh = _quotient(h, r_h, rows, rmask, M, True, FMA)
    else:
        qh = _quotient(h, r_h, cols, cmask, N, False, FMA)
    tl.store(h_t + offs_t, tl.trans(_to_storage(h, qh, H_MAX, H_E2M1, False, GRID)), mask=mask_t)
    dg_r, du_r, dg_c, du_c = _folded(
        dg, du, pg_ptr, pu_ptr, px_ptr, rows, cols, rmask, cmask, PRESCALE
    )
    q_gr = _quotient(dg_r, r_dg_row, rows, rmask, M, True, FMA)
    q_ur = _quotient(du_r, r_du_row, rows, rmask, M, True, FMA)
    q_gc = _quotient(dg_c, r_dg_col, cols, cmask, N, False, FMA)
    q_uc = _quotient(du_c, r_du_col, cols, cmask, N, False, FMA)
    tl.store(dg_q + offs, _to_storage(dg_r, q_gr, G_MAX, False, G_E5M2, GRID), mask=mask)
    tl.store(du_q + offs, _to_storage(du_r, q_ur, G_MAX, False, G_E5M2, GRID), mask=mask)
    q_gc = tl.trans(_to_storage(dg_c, q_gc, G_MAX, False, G_E5M2, GRID))
    tl.store(dg_t + offs_t, q_gc, mask=mask_t)
    q_uc = tl.trans(_to_storage(du_c, q_uc, G_MAX, False, G_E5M2, GRID))
    tl.store(du_t + offs_t, q_uc, mask=mask_t)


def _scale(amax: torch.Tensor, fmt: str, bf16: bool, fma: bool) -> tuple[torch.Tensor, ...]:
    """(scale, divisor): the divisor is 1/s in float64, or `_quotient`'s [s1, r1, p1, p2]."""
    # quantize_operand takes the amax of an unscaled operand in its own dtype (bf16 here)
    s = scale_from_amax(amax.to(torch.bfloat16).float() if bf16 else amax, FMT[fmt][0])
    if not fma:
        return s, s.double().reciprocal()
    return s, torch.stack(fma_factors(s.reshape(-1))).contiguous()


def fused(
    g,
    u,
    dh,
    config,
    pg=None,
    pu=None,
    px=None,
    tiles=(64, 128, 8, 64, 128, 8),
    round_amax=True,
    grid=False,
    fma=False,
    s_h=None,
    aten=False,
):
    """The same five operands from two Triton kernels (plus the partials' reductions).

    `round_amax`: round the maxima of unscaled operands to bf16, as `quantize_operand` takes
    them in the operand's own dtype (the compiled graph's h, dg and du are bf16 nodes).
    `aten`: the SiLU as inductor computes it (`_swiglu_aten`)."""
    if config == "tensorwise":
        return _fused_tensorwise(g, u, dh, s_h, tiles, round_amax, grid, aten)
    m, n = g.shape
    bm, bn, warps, cbm, cbn, cwarps = tiles
    nb, mb = triton.cdiv(n, bn), triton.cdiv(m, bm)
    h_row = config == "fp4"
    f32 = dict(dtype=torch.float32, device=g.device)
    h_part = torch.empty((m, nb) if h_row else (mb, n), **f32)
    dg_row, du_row = torch.empty((m, nb), **f32), torch.empty((m, nb), **f32)
    dg_col, du_col = torch.empty((mb, n), **f32), torch.empty((mb, n), **f32)
    prescale = pg is not None
    one = torch.ones(1, **f32)
    pgv, puv, pxv = (pg.reshape(-1), pu.reshape(-1), px.reshape(-1)) if prescale else (one,) * 3
    _maxima_kernel[(mb, nb)](
        g, u, dh, pgv, puv, pxv, h_part, dg_row, du_row, dg_col, du_col, m, n, nb,
        H_ROW=h_row, PRESCALE=prescale, BM=bm, BN=bn, TENSOR=False, ATEN=aten, num_warps=warps,
    )  # fmt: skip
    h_fmt, g_fmt = ("e2m1", "e5m2") if config == "fp4" else ("e4m3", "e4m3")
    h_amax = h_part.amax(1, keepdim=True) if h_row else h_part.amax(0, keepdim=True)
    bf16 = round_amax and not prescale
    s_h, r_h = _scale(h_amax, h_fmt, round_amax, fma)
    s_gr, r_gr = _scale(dg_row.amax(1, keepdim=True), g_fmt, bf16, fma)
    s_ur, r_ur = _scale(du_row.amax(1, keepdim=True), g_fmt, bf16, fma)
    s_gc, r_gc = _scale(dg_col.amax(0, keepdim=True), g_fmt, bf16, fma)
    s_uc, r_uc = _scale(du_col.amax(0, keepdim=True), g_fmt, bf16, fma)
    h_t = torch.empty((n, m), dtype=FMT[h_fmt][1], device=g.device)
    dg_q = torch.empty((m, n), dtype=FMT[g_fmt][1], device=g.device)
    du_q = torch.empty_like(dg_q)
    dg_t, du_t = (torch.empty((n, m), dtype=dg_q.dtype, device=g.device) for _ in range(2))
    _cast_kernel[(triton.cdiv(m, cbm), triton.cdiv(n, cbn))](
        g, u, dh, pgv, puv, pxv, r_h, r_gr, r_ur, r_gc, r_uc, h_t, dg_q, du_q, dg_t, du_t, m, n,
        H_ROW=h_row, PRESCALE=prescale, H_MAX=FMT[h_fmt][0], H_E2M1=FMT[h_fmt][2],
        G_MAX=FMT[g_fmt][0], G_E5M2=g_fmt == "e5m2", BM=cbm, BN=cbn, GRID=grid, FMA=fma,
        ATEN=aten, num_warps=cwarps,
    )  # fmt: skip
    return [(h_t, s_h.t().contiguous()), (dg_q, s_gr), (dg_t, s_gc.t().contiguous()), (du_q, s_ur),
            (du_t, s_uc.t().contiguous())]  # fmt: skip


def _fused_tensorwise(g, u, dh, s_h, tiles, round_amax, grid, aten):
    """`fused` for fp8-tensorwise: tile maxima of dg and du, then the rowwise cast kernel
    with every group's reciprocal the tensor's (a vector of equal values), so dg_t and du_t
    hold dg_q's and du_q's bytes transposed."""
    m, n = g.shape
    bm, bn, warps, cbm, cbn, cwarps = tiles
    nb, mb = triton.cdiv(n, bn), triton.cdiv(m, bm)
    f32 = dict(dtype=torch.float32, device=g.device)
    dg_part, du_part = torch.empty(mb, nb, **f32), torch.empty(mb, nb, **f32)
    one = torch.ones(1, **f32)
    _maxima_kernel[(mb, nb)](
        g, u, dh, one, one, one, one, dg_part, du_part, one, one, m, n, nb,
        H_ROW=False, PRESCALE=False, BM=bm, BN=bn, TENSOR=True, ATEN=aten, num_warps=warps,
    )  # fmt: skip
    s_g, r_g = _scale(dg_part.amax().reshape(1, 1), "e5m2", round_amax, False)
    s_u, r_u = _scale(du_part.amax().reshape(1, 1), "e5m2", round_amax, False)
    r_h, r_g, r_u = (r.reshape(1) for r in (s_h.double().reciprocal(), r_g, r_u))
    h_t = torch.empty((n, m), dtype=torch.float8_e4m3fn, device=g.device)
    dg_q = torch.empty((m, n), dtype=torch.float8_e5m2, device=g.device)
    du_q = torch.empty_like(dg_q)
    dg_t, du_t = (torch.empty((n, m), dtype=dg_q.dtype, device=g.device) for _ in range(2))
    _cast_kernel[(triton.cdiv(m, cbm), triton.cdiv(n, cbn))](
        g, u, dh, one, one, one, r_h.expand(n).contiguous(), r_g.expand(m).contiguous(),
        r_u.expand(m).contiguous(), r_g.expand(n).contiguous(), r_u.expand(n).contiguous(),
        h_t, dg_q, du_q, dg_t, du_t, m, n,
        H_ROW=False, PRESCALE=False, H_MAX=FMT["e4m3"][0], H_E2M1=False, G_MAX=FMT["e5m2"][0],
        G_E5M2=True,
        BM=cbm, BN=cbn, GRID=grid, FMA=False, ATEN=aten, num_warps=cwarps,
    )  # fmt: skip
    return [(h_t, s_h), (dg_q, s_g), (dg_t, s_g), (du_q, s_u), (du_t, s_u)]


def h_scale(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """h's E4M3 tensor scale as forward computes it (the amax of the bf16 h)."""
    return scale_from_amax((F.silu(g) * u).abs().amax().float().reshape(1, 1), FMT["e4m3"][0])


# --------------------------------------------------------------------------- the probe


def _differ(a: torch.Tensor, b: torch.Tensor, bits: torch.dtype) -> int:
    """Elements whose bits differ, NaNs of either sign counted as equal."""
    a, b = a.reshape(-1), b.reshape(-1)
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return int(((a.view(bits) != b.view(bits)) & ~both_nan).sum())


def _mismatches(ref, new) -> list[int]:
    """Per operand: values and scales whose bits differ."""
    return [_differ(rv, nv, torch.uint8) + _differ(rs, ns, torch.int32)
            for (rv, rs), (nv, ns) in zip(ref, new, strict=True)]  # fmt: skip


def _inputs(m, n, device):
    g, u, dh = (torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(3))
    g[0, :7] = torch.tensor([0.0, -0.0, 3e38, -1e-40, 88.0, -88.0, 1e-3])
    pg, pu = (torch.rand(1, n, device=device) + 0.5 for _ in range(2))
    px = torch.rand(m, 1, device=device) + 0.5
    return g, u, dh, (pg, pu, px)


def smoke() -> None:
    """Small shapes on the CPU (the kernels interpreted): mismatches per operand against the
    float32 reference (the CPU's compiled code rounds bf16 intermediates; inductor's Triton
    code does not)."""
    for m, n in ((64, 128), (50, 100)):
        g, u, dh, scales = _inputs(m, n, "cpu")
        g[0, 2] = 1.0  # no NaN: the interpreter's casts turn NaN into -384
        s_h = h_scale(g, u)
        for config in CONFIGS:
            extra = scales if config == "fp4" else ()
            kw = dict(s_h=s_h) if config == "tensorwise" else {}
            ref = reference(g, u, dh, config, *extra, fp32=True, **kw)
            for fma in (False, True) if config != "tensorwise" else (False,):
                t = (32, 64, 4, 32, 64, 4)
                new = fused(g, u, dh, config, *extra, tiles=t, round_amax=False, grid=True,
                            fma=fma, **kw)  # fmt: skip
                print(m, n, config, "fma" if fma else "f64", "vs float32:", _mismatches(ref, new))


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the kernels under TRITON_INTERPRET=1 (small shapes)",
    )
    ap.add_argument(
        "--tiles",
        default="128,64,8,64,128,8;64,128,8,64,128,8;256,64,8,64,128,8;128,128,8,64,128,8;"
        "64,64,4,64,128,8;128,64,8,128,64,8;128,64,8,64,64,4;128,64,8,128,128,8;"
        "128,64,8,32,128,4;128,64,8,64,256,8",
        help="maxima BM,BN,warps and cast BM,BN,warps; ';' between candidates (each with the "
        "float64 and the FMA quotient)",
    )
    ap.add_argument("--tag", default="", help="results file suffix: swiglu_probe_<tag>_...")
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS)
    )
    ap.add_argument(
        "--aten", action="store_true",
        help="the Triton rows compute the SiLU as inductor does (libdevice exp, two IEEE "
        "divisions: `_swiglu_aten`), not with tl.sigmoid",
    )  # fmt: skip
    ap.add_argument(
        "--quotients",
        default="f64,fma",
        help="the Triton rows' quotient forms: f64 (as shipped) and/or fma (Markstein)",
    )
    return ap.parse_args()


def _variants(compiled, args_, kw, tiles, quotients, aten) -> list[tuple]:
    """(name, call, tiles) of the compiled code as trained and of every Triton candidate."""
    rows = [("inductor (as trained)", functools.partial(compiled, *args_, **kw), None)]
    for t in tiles:
        for fma in ("fma" in q for q in quotients):
            name = f"triton {'fma' if fma else 'f64'}{', ATen SiLU' if aten else ''} {t}"
            call = functools.partial(fused, *args_, tiles=t, fma=fma, aten=aten, **kw)
            rows.append((name, call, t))
    return rows


def main() -> None:
    args = _parse_args()
    torch.manual_seed(0)
    if args.smoke:
        return smoke()
    copy_gbs = copy_bandwidth()
    records, lines = [], []
    compiled = torch.compile(reference, fullgraph=True)
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
    for m, n in ((16384, 5632), (16384, 11008)):
        g, u, dh, (pg, pu, px) = _inputs(m, n, "cuda")
        moved = m * n * (3 * 2 + 5)  # g, u, dh read once; five FP8 operands written
        for config in args.configs.split(","):
            extra = (pg, pu, px) if config == "fp4" else ()
            kw = dict(s_h=h_scale(g, u)) if config == "tensorwise" else {}
            ref = compiled(g, u, dh, config, *extra, **kw)
            unrounded = _mismatches(
                ref, fused(g, u, dh, config, *extra, round_amax=False, aten=args.aten, **kw)
            )
            print(m, n, config, "maxima unrounded: mismatches", unrounded, flush=True)
            quotients = args.quotients.split(",") if config != "tensorwise" else ["f64"]
            args_ = (g, u, dh, config, *extra)
            for name, fn, t in _variants(compiled, args_, kw, tiles, quotients, args.aten):
                bad = _mismatches(ref, fn())
                prof = kernel_profile(fn, reps=10, top=8)
                ms = time_ms(fn)
                rec = dict(shape=[m, n], config=config, variant=name, tiles=t,
                           kernel_ms=prof["kernel_ms"], event_ms=ms, kernels=prof["kernels"],
                           pct_of_copy=100 * moved / (prof["kernel_ms"] * 1e-3) / 1e9 / copy_gbs,
                           mismatches=bad, mismatches_amax_unrounded=unrounded,
                           top_kernels=prof["top_kernels"])  # fmt: skip
                for kname, kms, _ in prof["top_kernels"]:
                    if kname in ("_maxima_kernel", "_cast_kernel"):
                        rec[kname.strip("_")] = kms
                records.append(rec)
                print(rec["shape"], config, name, f"{prof['kernel_ms']:.3f} ms", bad, flush=True)
                lines.append(
                    f"| {m}x{n} | {config} | {name} | {prof['kernel_ms'] * 1e3:.1f} | "
                    f"{ms * 1e3:.1f} | {prof['kernels']:.0f} | {rec['pct_of_copy']:.0f}% | "
                    f"{sum(bad)} | {rec.get('maxima_kernel', 0) * 1e3:.0f} | "
                    f"{rec.get('cast_kernel', 0) * 1e3:.0f} |"
                )
    body = (
        f"`{' '.join(sys.argv)}`\n\nCopy bandwidth {copy_gbs:.0f} GB/s. Per call: GPU kernel "
        "time (profiler), event time (L2 flushed), launches, the bytes of one pass (g, u, dh "
        "read once, five FP8 operands written) over the kernel time as a share of copy, and "
        "bytes or scale words that differ from the compiled code's; the Triton rows' two "
        "kernels apart (the rest is the eager reductions of their partials and the scales, "
        "which a compiled graph would fuse).\n\n"
        "| shape | config | variant | kernel us | event us | kernels | one pass vs copy | "
        "mismatches | maxima us | cast us |\n|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(lines)
    )
    md, _ = write_results(
        "_".join(filter(None, ("swiglu_probe", args.tag))),
        records,
        body,
        out_dir=Path(args.out_dir),
        day=args.date,
    )
    print(md)


if __name__ == "__main__":
    main()
