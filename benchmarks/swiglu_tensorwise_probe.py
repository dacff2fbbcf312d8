"""An exact SwiGLU backward for fp8-tensorwise in two Triton kernels: same bytes as inductor's?

    PYTHONPATH=src python benchmarks/swiglu_tensorwise_probe.py [--out-dir DIR] [--date D]
        [--tag T] [--tiles "BM,BN,W,BM,BN,W;..."]

The step before a SwiGLU unit of our own (docs/hopper_sessions.md, session 35): under
fp8-tensorwise the compiled backward of `w2(silu(w1 x) * w3 x)` quantizes h_qᵀ (E4M3, h's
scale from forward), dg_q and du_q (E5M2, one scale each) and their transposes from the saved
g, u and the down projection's dgrad output dh, in ~0.62 ms a layer at 1.3B width.
`transposed_store_probe.py` bounds two kernels of our own at ~0.51 ms with the same arithmetic;
session 29's kernels (`swiglu_probe.py`) were slower and differed in ~1.5·10^6 bytes: they
computed the SiLU with `tl.sigmoid`, five quotients an element, and rounded the maxima to
bf16. These two kernels
compute what inductor's code for ATen's decompositions computes (libdevice's exp, the two IEEE
divisions of `silu` and `silu_backward`, float32 products in the same order, float64
quotients, NaN kept by the clamps, the maxima not rounded to bf16):
1. maxima: each tile's max |dg| and |du| (integer maxima of the magnitudes' bits: NaN wins);
2. cast: h_qᵀ, dg_q, du_q, dg_qᵀ, du_qᵀ, the transposed ones through shared memory.
For each shape, input set (Gaussian, or with `swiglu_probe._inputs`' extremes planted in g)
and tile, the probe counts the bytes and scale words that differ from the compiled code's
(`swiglu_probe.reference`, as trained) and times both (GPU kernel time). Session 35: no byte
differs; parity at 1.3B width, ~0.6 ms a layer less at 7B width. Needs
a CUDA GPU with Triton. Writes `swiglu_tensorwise_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import kernel_profile, parse_tiles, probe_parser, require_cuda, write_probe  # noqa: E402
from division_probe import fma_factors  # noqa: E402
from swiglu_probe import (  # noqa: E402
    _inputs,
    _mismatches,
    _scale,
    _swiglu_aten,
    _tile,
    _tile_max,
    h_scale,
    reference,
)

SHAPES = ((16384, 5632), (16384, 11008))


@triton.jit
def _maxima_kernel(
    g_ptr, u_ptr, dh_ptr, part, M, N, BM: tl.constexpr, BN: tl.constexpr
):  # fmt: skip  # pragma: no cover - runs on the GPU
    _, _, mask, offs = _tile(M, N, BM, BN)
    _, dg, du = _swiglu_aten(g_ptr, u_ptr, dh_ptr, offs, mask)
    k = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)
    tl.store(part + 2 * k, _tile_max(dg))  # integer maxima of the magnitudes' bits: NaN wins
    tl.store(part + 2 * k + 1, _tile_max(du))


@triton.jit
def _cast(v, r_ptr, MAX: tl.constexpr, FMA: tl.constexpr):
    """v / s correctly rounded, clamped to ±MAX keeping NaN (as inductor's `triton_helpers.
    maximum/minimum`). Float64 (as shipped): r_ptr holds RN64(1/s) and q = RN32(v · r). FMA:
    r_ptr holds `division_probe.fma_factors(s)` = (s1, 1/s1, p1, p2) in float32 and Markstein's
    two FMAs give the same bits without float64 conversions (session 22)."""
    if FMA:
        x = v * tl.load(r_ptr + 2) * tl.load(r_ptr + 3)
        r1 = tl.load(r_ptr + 1)
        q0 = x * r1
        e = tl.fma(-q0, tl.load(r_ptr), x)
        q = tl.where((tl.abs(e) < float("inf")) & (q0 != 0.0), tl.fma(e, r1, q0), q0)
    else:
        q = (v.to(tl.float64) * tl.load(r_ptr)).to(tl.float32)
    q = tl.where((q > -MAX) | (q != q), q, -MAX)
    return tl.where((q < MAX) | (q != q), q, MAX)


@triton.jit
def _cast_kernel(
    g_ptr, u_ptr, dh_ptr, r_h, r_g, r_u, h_t, dg_q, du_q, dg_t, du_t, M, N,
    BM: tl.constexpr, BN: tl.constexpr, FMA: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    rows, cols, mask, offs = _tile(M, N, BM, BN)
    h, dg, du = _swiglu_aten(g_ptr, u_ptr, dh_ptr, offs, mask)
    qh = _cast(h, r_h, 448.0, FMA).to(tl.float8e4nv)
    qg = _cast(dg, r_g, 57344.0, FMA).to(tl.float8e5)
    qu = _cast(du, r_u, 57344.0, FMA).to(tl.float8e5)
    tl.store(dg_q + offs, qg, mask=mask)
    tl.store(du_q + offs, qu, mask=mask)
    offs_t = cols[:, None].to(tl.int64) * M + rows[None, :]
    mask_t = (cols[:, None] < N) & (rows[None, :] < M)
    tl.store(h_t + offs_t, tl.trans(qh), mask=mask_t)
    tl.store(dg_t + offs_t, tl.trans(qg), mask=mask_t)
    tl.store(du_t + offs_t, tl.trans(qu), mask=mask_t)


def fused(g, u, dh, s_h, tiles=(32, 128, 4, 64, 64, 4), *, fma=False, round_max=False):
    """[(values, scale)] for h_qᵀ, dg_q, dg_qᵀ, du_q, du_qᵀ (`swiglu_probe.reference`'s order)
    from the two kernels; the tile maxima's max and the scales are plain PyTorch between them
    (a compiled graph would fuse them). `fma`: Markstein's quotient; `round_max`: the maxima
    rounded to bf16 before the scales (the compiled graph does not round them)."""
    m, n = g.shape
    bm, bn, warps, cbm, cbn, cwarps = tiles
    part = torch.empty(triton.cdiv(m, bm) * triton.cdiv(n, bn), 2, device=g.device)
    _maxima_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        g, u, dh, part, m, n, BM=bm, BN=bn, num_warps=warps
    )
    amax = part.amax(0)
    s_g = _scale(amax[0].reshape(1, 1), "e5m2", round_max, False)[0]
    s_u = _scale(amax[1].reshape(1, 1), "e5m2", round_max, False)[0]
    if fma:
        r_h, r_g, r_u = (torch.cat([f.reshape(1) for f in fma_factors(s.reshape(1))])
                         for s in (s_h, s_g, s_u))  # fmt: skip
    else:
        r_h, r_g, r_u = (s.double().reciprocal() for s in (s_h, s_g, s_u))
    h_t = torch.empty((n, m), dtype=torch.float8_e4m3fn, device=g.device)
    dg_q, du_q = (torch.empty((m, n), dtype=torch.float8_e5m2, device=g.device) for _ in range(2))
    dg_t, du_t = (torch.empty((n, m), dtype=torch.float8_e5m2, device=g.device) for _ in range(2))
    _cast_kernel[(triton.cdiv(m, cbm), triton.cdiv(n, cbn))](
        g, u, dh, r_h, r_g, r_u, h_t, dg_q, du_q, dg_t, du_t, m, n, BM=cbm, BN=cbn, FMA=fma,
        num_warps=cwarps,
    )  # fmt: skip
    return [(h_t, s_h), (dg_q, s_g), (dg_t, s_g), (du_q, s_u), (du_t, s_u)]


def _checked_variants(compiled, g, u, dh, tiles) -> list[tuple[str, object, list[int]]]:
    """(name, call, mismatches against the compiled code) for the compiled code as trained
    and each Triton variant."""
    s_h = h_scale(g, u)
    ref = compiled(g, u, dh, "tensorwise", s_h=s_h)
    variants = [("inductor (as trained)",
                 functools.partial(compiled, g, u, dh, "tensorwise", s_h=s_h))]  # fmt: skip
    for t in tiles:
        variants += [
            (f"triton {t}, maxima rounded to bf16",
             functools.partial(fused, g, u, dh, s_h, t, round_max=True)),
            (f"triton {t}", functools.partial(fused, g, u, dh, s_h, t)),
            (f"triton {t}, FMA quotient", functools.partial(fused, g, u, dh, s_h, t, fma=True)),
        ]  # fmt: skip
    return [(name, fn, _mismatches(ref, fn())) for name, fn in variants]


def main() -> None:
    args = probe_parser(
        __doc__, "32,128,4,64,64,4;32,128,4,32,128,4;64,64,4,64,64,4",
        "maxima BM,BN,warps and cast BM,BN,warps; ';' between candidates",
    ).parse_args()  # fmt: skip
    require_cuda("swiglu_tensorwise_probe")
    torch.manual_seed(0)
    compiled = torch.compile(reference, fullgraph=True)
    tiles = parse_tiles(args.tiles)
    records, lines = [], []
    for (m, n), planted in itertools.product(SHAPES, (True, False)):
        g, u, dh, _ = _inputs(m, n, "cuda")
        if not planted:  # _inputs plants extremes in g's first row; here g is Gaussian only
            g = torch.randn_like(g)
        inputs = "planted extremes" if planted else "Gaussian"
        for name, fn, bad in _checked_variants(compiled, g, u, dh, tiles):
            prof = kernel_profile(fn, reps=10, top=6)
            parts = {k.strip("_"): ms for k, ms, _ in prof["top_kernels"]
                     if k in ("_maxima_kernel", "_cast_kernel")}  # fmt: skip
            records.append(dict(shape=[m, n], inputs=inputs, variant=name, mismatches=bad,
                                kernel_ms=prof["kernel_ms"], kernels=prof["kernels"], **parts,
                                top_kernels=prof["top_kernels"]))  # fmt: skip
            print(m, n, inputs, name, f"{prof['kernel_ms'] * 1e3:.1f} us", bad, parts, flush=True)
            lines.append(f"| {m}x{n} | {inputs} | {name} | {prof['kernel_ms'] * 1e3:.1f} | "
                         f"{prof['kernels']:.0f} | {bad} | "
                         f"{parts.get('maxima_kernel', 0) * 1e3:.0f} | "
                         f"{parts.get('cast_kernel', 0) * 1e3:.0f} |")  # fmt: skip
    body = (
        "GPU kernel time per call (profiler, 10 calls; the Triton "
        "rows include the small PyTorch ops between their kernels), launches, and per operand "
        "(h_qᵀ, dg_q, dg_qᵀ, du_q, du_qᵀ) the bytes and scale words that differ from the "
        "compiled code's.\n\n| shape | inputs | variant | kernel us | kernels | mismatches | "
        "maxima us | cast us |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    write_probe("swiglu_tensorwise_probe", args, records, body)


if __name__ == "__main__":
    main()
