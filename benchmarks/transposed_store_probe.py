"""Can one kernel write FP8 operands both row-major and transposed near copy bandwidth? (issue 13)

    PYTHONPATH=src python benchmarks/transposed_store_probe.py [--out-dir DIR] [--date D]
        [--tag T] [--tiles "BM,BN,W;..."]

fp8-tensorwise's SwiGLU backward reads g, u and dh (bf16 [M, F]) and writes five FP8 operands:
dg_q and du_q row-major (dgrad) and h_qᵀ, dg_qᵀ and du_qᵀ transposed (wgrad); with a tensor
scale the transposed dg and du are the same bytes as the row-major ones. Inductor's cast
kernel for it moves ~1 GB in 0.39-0.42 ms a layer at 1.3B width (~2.4 TB/s, 1.3B profiles of
sessions 27 and 29), and session 29's hand-written kernel was slower still (0.50-0.60 ms).
Before a SwiGLU unit of our own is worth building (the one lever left there: MLP backward as
one autograd Function, docs/hopper_sessions.md session 35), the data movement alone must run
well above that. This probe times the data movement with the SwiGLU's arithmetic and
three quotient forms (bits not compared: scales are fixed multipliers), per shape:
- `rows`: three FP8 outputs row-major (h_q, dg_q, du_q), nothing transposed: the floor;
- `rows+T`: the five outputs, the three transposed ones through `tl.trans` (shared memory);
- `rows, then transpose_copy`: `rows`' kernel then our opaque tiled transpose of each of the
  three (`kernels/transpose_triton.py`), as training does for dg and du today;
- `inductor`: the same five outputs written by `torch.compile` (`.t().contiguous()`);
- `maxima`: the first pass of a tensor scale, each tile's max |dg| and |du| (no output bytes);
- `rows+T mul / f64 / fma`: the quotient as a float32 multiply (inexact), as float64's
  RN32(v · 1/s) (the library's exact form), or as Markstein's two FMAs. The multipliers are
  compile-time powers of two, which the compiler may fold the float64 and FMA forms into:
  those rows understate a run-time scale's cost (`swiglu_tensorwise_probe.py` loads its
  scales at run time);
- `..., ATen SiLU`: the SiLU as inductor computes ATen's decompositions (libdevice's exp and
  two IEEE divisions, where the other rows use `tl.sigmoid`) and NaN kept by the clamp: the
  arithmetic of the compiled code as trained.
Bandwidth = bytes of one pass (three bf16 inputs read, each output the unit needs written once:
five, or three for `rows`) over the GPU kernel time, as a share of the measured copy bandwidth.
Needs a CUDA GPU with Triton. Writes `transposed_store_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import (  # noqa: E402
    copy_bandwidth,
    kernel_profile,
    parse_tiles,
    probe_parser,
    require_cuda,
    write_probe,
)
from minifloat.kernels.transpose_triton import transpose_2d  # noqa: E402
from swiglu_probe import _tile  # noqa: E402

SHAPES = ((16384, 5632), (16384, 11008), (16384, 2048))
SCALES = (0.5, 4.0, 8.0)  # h, dg, du: any finite multipliers serve for timing
QUOTIENTS = {0: "mul", 1: "f64", 2: "fma"}  # `_quotient`'s forms


@triton.jit
def _quotient(v, S: tl.constexpr, MAX: tl.constexpr, QUOT: tl.constexpr, NAN: tl.constexpr):
    """v / (1/S), clamped to the format's range: QUOT 0 a float32 multiply by S (inexact),
    1 float64's RN32(v * S) (`exact.div_rn_by_scale`'s form), 2 Markstein's two FMAs on it."""
    if QUOT == 1:
        q = (v.to(tl.float64) * S).to(tl.float32)
    elif QUOT == 2:
        q0 = v * S
        q = tl.fma(tl.fma(-q0, 1.0 / S, v), S, q0)
    else:
        q = v * S
    return _clamp(q, MAX, NAN)


@triton.jit
def _sigmoid_silu(g, ATEN: tl.constexpr):
    """(sigmoid(g), silu(g)) in float32. ATEN: as inductor's code for ATen's decompositions
    computes them (libdevice's exp, then two IEEE divisions, 1 / (1 + e) and g / (1 + e));
    else `tl.sigmoid` and a product."""
    if ATEN:
        d = libdevice.exp(-g) + 1.0
        return 1.0 / d, g / d
    sig = tl.sigmoid(g)
    return sig, g * sig


@triton.jit
def _clamp(q, MAX: tl.constexpr, NAN: tl.constexpr):
    """q clamped to [-MAX, MAX]; NAN keeps NaN (the library's casts do; PTX min/max drop it)."""
    c = tl.minimum(tl.maximum(q, -MAX), MAX)
    if NAN:
        c = tl.where(q != q, q, c)
    return c


@triton.jit
def _bf16(v):
    """v rounded to bf16 and back: the compiled graph's dg and du are bf16 nodes."""
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _load_tile(g_ptr, u_ptr, dh_ptr, offs, mask):
    """g, u, dh of one tile in float32 (bf16 in memory)."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return g, u, dh


@triton.jit
def _maxima_kernel(
    g_ptr, u_ptr, dh_ptr, part, M, N, BM: tl.constexpr, BN: tl.constexpr, ATEN: tl.constexpr
):  # fmt: skip  # pragma: no cover - runs on the GPU
    """Each tile's max |dg| and max |du| (the first pass of a tensor scale)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    _, _, mask, offs = _tile(M, N, BM, BN)
    g, u, dh = _load_tile(g_ptr, u_ptr, dh_ptr, offs, mask)
    sig, sg = _sigmoid_silu(g, ATEN)
    dg = _bf16(dh * u * sig * (1.0 + g * (1.0 - sig)))
    du = _bf16(dh * sg)
    k = (pm * tl.num_programs(1) + pn).to(tl.int64) * 2
    tl.store(part + k, tl.max(tl.max(tl.abs(dg), axis=1), axis=0))
    tl.store(part + k + 1, tl.max(tl.max(tl.abs(du), axis=1), axis=0))


def triton_maxima(g, u, dh, *, tile: tuple[int, int, int], aten: bool = False) -> torch.Tensor:
    """Per-tile maxima of |dg| and |du|, [tiles, 2] float32."""
    m, n = g.shape
    bm, bn, warps = tile
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    part = torch.empty(grid[0] * grid[1], 2, device=g.device)
    _maxima_kernel[grid](g, u, dh, part, m, n, BM=bm, BN=bn, ATEN=aten, num_warps=warps)
    return part


@triton.jit
def _swiglu_cast_kernel(
    g_ptr, u_ptr, dh_ptr, h_q, dg_q, du_q, h_t, dg_t, du_t, M, N,
    S_H: tl.constexpr, S_G: tl.constexpr, S_U: tl.constexpr,
    ROWS: tl.constexpr, TRANS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    QUOT: tl.constexpr, ATEN: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    rows, cols, mask, offs = _tile(M, N, BM, BN)
    g, u, dh = _load_tile(g_ptr, u_ptr, dh_ptr, offs, mask)
    sig, sg = _sigmoid_silu(g, ATEN)
    qh = _quotient(sg * u, S_H, 448.0, QUOT, ATEN).to(tl.float8e4nv)
    qg = _quotient(_bf16(dh * u * sig * (1.0 + g * (1.0 - sig))), S_G, 57344.0, QUOT, ATEN)
    qu = _quotient(_bf16(dh * sg), S_U, 57344.0, QUOT, ATEN)
    qg, qu = qg.to(tl.float8e5), qu.to(tl.float8e5)
    if ROWS:
        tl.store(dg_q + offs, qg, mask=mask)
        tl.store(du_q + offs, qu, mask=mask)
        if not TRANS:
            tl.store(h_q + offs, qh, mask=mask)
    if TRANS:
        offs_t = cols[:, None].to(tl.int64) * M + rows[None, :]
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        tl.store(h_t + offs_t, tl.trans(qh), mask=mask_t)
        tl.store(dg_t + offs_t, tl.trans(qg), mask=mask_t)
        tl.store(du_t + offs_t, tl.trans(qu), mask=mask_t)


def triton_cast(g, u, dh, outs, *, rows: bool, trans: bool, tile, quot=0, aten=False):
    """One launch of the cast kernel into preallocated `outs` (h_q, dg_q, du_q, h_t, dg_t,
    du_t); `tile` is (BM, BN, warps), `quot` a key of QUOTIENTS, `aten` the ATen-form SiLU;
    returns `outs`."""
    m, n = g.shape
    bm, bn, warps = tile
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    s_h, s_g, s_u = SCALES
    _swiglu_cast_kernel[grid](g, u, dh, *outs, m, n, S_H=s_h, S_G=s_g, S_U=s_u, ROWS=rows,
                              TRANS=trans, BM=bm, BN=bn, QUOT=quot, ATEN=aten,
                              num_warps=warps)  # fmt: skip
    return outs


def rows_then_transpose(g, u, dh, outs, *, tile):
    """`rows` then the opaque transpose of each of the three row-major outputs."""
    triton_cast(g, u, dh, outs, rows=True, trans=False, tile=tile)
    return [transpose_2d(t) for t in outs[:3]]


def eager_outputs(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> list[torch.Tensor]:
    """The five outputs in plain PyTorch, for `torch.compile` (inductor's code as trained)."""
    g, u, dh = g.float(), u.float(), dh.float()
    sig = torch.sigmoid(g)
    sg = g * sig
    s_h, s_g, s_u = SCALES
    qh = (sg * u * s_h).to(torch.float8_e4m3fn)
    qg = (dh * u * sig * (1.0 + g * (1.0 - sig)) * s_g).to(torch.float8_e5m2)
    qu = (dh * sg * s_u).to(torch.float8_e5m2)
    return [qg, qu, qh.t().contiguous(), qg.t().contiguous(), qu.t().contiguous()]


def _outs(m: int, n: int) -> list[torch.Tensor]:
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    row = [torch.empty(m, n, dtype=d, device="cuda") for d in (e4, e5, e5)]
    return row + [torch.empty(n, m, dtype=d, device="cuda") for d in (e4, e5, e5)]


def _variants(g, u, dh, tiles, quots) -> list[tuple[str, int, object]]:
    """(name, FP8 bytes written per element, call) for every variant and tile."""
    outs = _outs(*g.shape)
    compiled = torch.compile(eager_outputs, fullgraph=True)
    rows = [("inductor (five outputs)", 5, functools.partial(compiled, g, u, dh))]
    for t in tiles:
        rows += [
            (f"rows {t}", 3, functools.partial(triton_cast, g, u, dh, outs, rows=True,
                                               trans=False, tile=t)),
            (f"rows, then transpose_copy {t}", 5,
             functools.partial(rows_then_transpose, g, u, dh, outs, tile=t)),
            (f"maxima {t}", 0, functools.partial(triton_maxima, g, u, dh, tile=t)),
        ]  # fmt: skip
        rows += [
            (f"rows+T {QUOTIENTS[q]} {t}", 5, functools.partial(
                triton_cast, g, u, dh, outs, rows=True, trans=True, tile=t, quot=q))
            for q in quots
        ]  # fmt: skip
        rows += [
            (f"maxima, ATen SiLU {t}", 0,
             functools.partial(triton_maxima, g, u, dh, tile=t, aten=True)),
            (f"rows+T f64, ATen SiLU, NaN kept {t}", 5, functools.partial(
                triton_cast, g, u, dh, outs, rows=True, trans=True, tile=t, quot=1, aten=True)),
        ]  # fmt: skip
    return rows


def _parse_args() -> argparse.Namespace:
    ap = probe_parser(
        __doc__,
        "64,64,4;64,128,4;128,64,4;128,128,8;32,128,4;128,32,4;64,256,8;256,64,8",
        "BM,BN,warps of the cast kernel; ';' between candidates",
    )
    ap.add_argument(
        "--quotients", default="mul,f64,fma",
        help="the rows+T kernel's quotient forms: mul (inexact), f64 (as shipped), fma",
    )  # fmt: skip
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    require_cuda("transposed_store_probe")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    tiles = parse_tiles(args.tiles)
    records, lines = [], []
    for m, n in SHAPES:
        g, u, dh = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        quots = [q for q, name in QUOTIENTS.items() if name in args.quotients.split(",")]
        for name, written, fn in _variants(g, u, dh, tiles, quots):
            try:
                prof = kernel_profile(fn, reps=10, top=4)
            except Exception as exc:  # one variant failing to compile must not lose the rest
                print(m, n, name, "FAILED", exc, flush=True)
                records.append(dict(shape=[m, n], variant=name, error=str(exc)[-2000:]))
                lines.append(f"| {m}x{n} | {name} | failed: {type(exc).__name__} | | | |")
                continue
            moved = m * n * (3 * 2 + written)  # each output's bytes once, not the transposes'
            gbs = moved / (prof["kernel_ms"] * 1e-3) / 1e9
            rec = dict(shape=[m, n], variant=name, kernel_ms=prof["kernel_ms"],
                       kernels=prof["kernels"], bytes_one_pass=moved, gb_per_s=gbs,
                       pct_of_copy=100 * gbs / copy_gbs,
                       top_kernels=prof["top_kernels"])  # fmt: skip
            records.append(rec)
            print(m, n, name, f"{prof['kernel_ms'] * 1e3:.1f} us {rec['pct_of_copy']:.0f}%",
                  flush=True)  # fmt: skip
            us, pct = prof["kernel_ms"] * 1e3, rec["pct_of_copy"]
            lines.append(f"| {m}x{n} | {name} | {us:.1f} | {prof['kernels']:.0f} | "
                         f"{gbs:.0f} | {pct:.0f}% |")  # fmt: skip
    body = (
        f"Copy bandwidth {copy_gbs:.0f} GB/s. GPU kernel time per "
        "call (profiler, 10 calls); GB/s = bytes of one pass (g, u, dh read; each output "
        "written once) over that time.\n\n"
        "| shape | variant | kernel us | kernels | GB/s | vs copy |\n|---|---|---|---|---|---|\n"
        + "\n".join(lines)
    )
    write_probe("transposed_store_probe", args, records, body)


if __name__ == "__main__":
    main()
