"""Would one pass make fp8-blockwise's SwiGLU backward pay? Triton kernels of this probe's own
that read g, u and dh from memory once and write all five operands the MLP's backward GEMMs
take (three forms, `fused`), timed against the same arithmetic as PyTorch under torch.compile
(what training runs today).

    PYTHONPATH=src python benchmarks/blockwise_swiglu_probe.py [--m 16384 --ffn 5632]
        [--forms tile,bands,chunks] [--warps 4,8,16] [--bands 16,32] [--chunks 16,32,64]

Why (session 63): in the 6-layer 1.3B profile (`train_e2e_1.3B_ours_s63_blockprof_l6_...`)
fp8-blockwise's SwiGLU backward is three kernels a layer, 0.74 ms: the column-group maxima of
h, dg and du (128 tokens x 1 column each, for wgrad), the row-group maxima of dg and du (1 x 128,
for dgrad), and a cast writing the five operands; each reads g, u and dh (6 bytes an element).
A 1x128 or 128x1 group's maximum needs only its own 128 values, so one pass over 128 x 128
tiles could do all of it: 6 bytes read and 5 written an element, ~0.25 ms at copy bandwidth,
where inductor's three passes move 23. Session 36 built such a unit for fp8-tensorwise and
found its hand-written cast slower than inductor's in training (bound by instructions at the
power limit's clock), so this measures before anything is built. Session 63 timed the first two
forms (`blockwise_swiglu_probe_s63{,_trans,_2phase}_...`): 1.24 ms and more against 0.83; the
second of them (the whole tile's maxima first, then the tile read again: 2.0 ms) is in git
history (commit 0075889), not here. Session 64 (`blockwise_swiglu_probe_s64_*`, after 125116a's
mend): the tile form at 8 warps 0.78 ms against inductor's 0.83, the bands 1.08-3.05 ms.
Session 82 (`blockwise_swiglu_probe_s82{,_7b}_...`) added the column chunks (fewer values live
at once): 1.12-1.70 ms, the tile form 0.79 again (1.52 against 1.59 at 7B width).

Both sides compute, in float32 from bf16 g, u, dh [M, F]: s = sigmoid(g), h = g·s·u,
du = dh·g·s, dg = dh·u·s·(1 + g·(1 - s)) (`models/swiglu.py`), and the recipe's E4M3 "inv"
quantizers (`kernels/operand.quantize_operand`): dg and du in 1 x 128 groups along F (values
[M, F]) and in 128 x 1 groups along M (written transposed, [F, M]), h in 128 x 1 groups
(transposed). The reference keeps dg, du and h unrounded between the arithmetic and the casts,
as inductor does in the training graph. Reported: each output's bytes that differ from the
reference's, and the GPU kernel time of each side (profiler) with its share of copy bandwidth.
`--device cpu` runs the reference eagerly on a small shape (a smoke test; the Triton kernel
needs CUDA, or TRITON_INTERPRET=1). Writes `blockwise_swiglu_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, copy_bandwidth, kernel_profile, write_results  # noqa: E402
from minifloat.formats import _INV_MULTIPLIER_MAX  # noqa: E402 (inv_scales' clamp)
from minifloat.kernels.operand import quantize_operand  # noqa: E402
from minifloat.models.swiglu import swiglu_grads  # noqa: E402

OUTPUTS = ("dg_q", "dg_s", "dgt_q", "dgt_s", "du_q", "du_s", "dut_q", "dut_s", "ht_q", "ht_s")
E4M3_MAX = 448.0


def reference(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The five operands and their scales (`OUTPUTS`), in the library's quantizers."""
    gf = g.float()
    h = gf * torch.sigmoid(gf) * u.float()  # `swiglu`'s forward, unrounded
    dg, du = swiglu_grads(g, u, dh)
    out = []
    for v in (dg, du):
        q, sc = quantize_operand(v, "e4m3", (1, 128), scale_format="inv")
        qt, sct = quantize_operand(v, "e4m3", (1, 128), transpose=True, scale_format="inv")
        out += [q, sc, qt.contiguous(), sct]
    qt, sct = quantize_operand(h, "e4m3", (1, 128), transpose=True, scale_format="inv")
    return (*out, qt.contiguous(), sct)


try:  # CUDA machines have Triton; the CPU test runs the reference only
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _inv(bits, MIN_AMAX: tl.constexpr, FMT_MAX: tl.constexpr):
        # formats.inv_scales of group maxima given as magnitude bits: (m, 1 / m)
        amax = bits.to(tl.float32, bitcast=True)
        a = tl.maximum(amax, MIN_AMAX).to(tl.float64)
        m = (FMT_MAX * (1.0 / a)).to(tl.float32)
        zero = (amax == 0.0).to(tl.float32)
        m = m * (1.0 - zero) + zero + (amax - amax)
        return m, (1.0 / m.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _maxbits(v, AXIS: tl.constexpr):
        return tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)

    @triton.jit
    def _rows_and_cols(
        v, rows, cols, M, F, q_ptr, s_ptr, qt_ptr, st_ptr,
        MIN_AMAX: tl.constexpr, FMT_MAX: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        # 128 x 1 groups (along tokens): values transposed [F, M], scales [F, M / 128]
        mc, sc = _inv(_maxbits(v, 0), MIN_AMAX, FMT_MAX)
        qt = tl.trans((v * mc[None, :]).to(tl.float8e4nv))  # stored along tokens, coalesced
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], qt)
        tl.store(st_ptr + cols * (M // 128) + tl.program_id(0), sc)
        if ROWS:  # 1 x 128 groups (along F): values [M, F], scales [M, F / 128]
            mr, sr = _inv(_maxbits(v, 1), MIN_AMAX, FMT_MAX)
            q = (v * mr[:, None]).to(tl.float8e4nv)
            tl.store(q_ptr + rows[:, None] * F + cols[None, :], q)
            tl.store(s_ptr + rows * (F // 128) + tl.program_id(1), sr)

    @triton.jit
    def swiglu_backward_blocks(g_ptr, u_ptr, dh_ptr, M, F,
                               dg_q, dg_s, dgt_q, dgt_s, du_q, du_s, dut_q, dut_s, ht_q, ht_s,
                               MIN_AMAX: tl.constexpr, FMT_MAX: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0) * 128 + tl.arange(0, 128)
        cols = tl.program_id(1) * 128 + tl.arange(0, 128)
        h, du, dg = _swiglu_rows(g_ptr, u_ptr, dh_ptr, rows, cols, F)
        _rows_and_cols(h, rows, cols, M, F, ht_q, ht_s, ht_q, ht_s, MIN_AMAX, FMT_MAX, False)
        _rows_and_cols(du, rows, cols, M, F, du_q, du_s, dut_q, dut_s, MIN_AMAX, FMT_MAX, True)
        _rows_and_cols(dg, rows, cols, M, F, dg_q, dg_s, dgt_q, dgt_s, MIN_AMAX, FMT_MAX, True)

    @triton.jit
    def _swiglu_rows(g_ptr, u_ptr, dh_ptr, rows, cols, F):
        # h, du, dg of rows x cols in float32, in the compiled graph's order of operations
        offs = rows[:, None] * F + cols[None, :]
        g = tl.load(g_ptr + offs).to(tl.float32)
        u = tl.load(u_ptr + offs).to(tl.float32)
        dh = tl.load(dh_ptr + offs).to(tl.float32)
        s = tl.sigmoid(g)
        return g * s * u, dh * g * s, dh * u * s * (1.0 + g * (1.0 - s))

    @triton.jit
    def _row_cast(v, rows, cols, F, q_ptr, s_ptr, t1, MIN_AMAX: tl.constexpr,
                  FMT_MAX: tl.constexpr):  # fmt: skip
        m, sc = _inv(_maxbits(v, 1), MIN_AMAX, FMT_MAX)
        tl.store(q_ptr + rows[:, None] * F + cols[None, :], (v * m[:, None]).to(tl.float8e4nv))
        tl.store(s_ptr + rows * (F // 128) + t1, sc)

    @triton.jit
    def _col_cast(v, m, rows, cols, M, qt_ptr):
        qt = tl.trans((v * m[None, :]).to(tl.float8e4nv))
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], qt)

    @triton.jit
    def swiglu_backward_blocks_sub(
        g_ptr, u_ptr, dh_ptr, M, F, dg_q, dg_s, dgt_q, dgt_s, du_q, du_s, dut_q, dut_s, ht_q,
        ht_s, MIN_AMAX: tl.constexpr, FMT_MAX: tl.constexpr, SUB: tl.constexpr,
    ):  # fmt: skip
        # The 128 x 128 tile in bands of SUB tokens, so that few values are live at once: the
        # first sweep finishes each band's 1 x 128 groups (maxima, casts, stores) and carries
        # the 128 x 1 groups' maxima; the second reads the tile again (from L2) for those casts.
        t0, t1 = tl.program_id(0), tl.program_id(1)
        cols = t1 * 128 + tl.arange(0, 128)
        c_h = tl.zeros([128], dtype=tl.int32)
        c_du = tl.zeros([128], dtype=tl.int32)
        c_dg = tl.zeros([128], dtype=tl.int32)
        for i in tl.static_range(0, 128, SUB):
            rows = t0 * 128 + i + tl.arange(0, SUB)
            h, du, dg = _swiglu_rows(g_ptr, u_ptr, dh_ptr, rows, cols, F)
            c_h = tl.maximum(c_h, _maxbits(h, 0))
            c_du = tl.maximum(c_du, _maxbits(du, 0))
            c_dg = tl.maximum(c_dg, _maxbits(dg, 0))
            _row_cast(du, rows, cols, F, du_q, du_s, t1, MIN_AMAX, FMT_MAX)
            _row_cast(dg, rows, cols, F, dg_q, dg_s, t1, MIN_AMAX, FMT_MAX)
        m_h, s_h = _inv(c_h, MIN_AMAX, FMT_MAX)
        m_du, s_du = _inv(c_du, MIN_AMAX, FMT_MAX)
        m_dg, s_dg = _inv(c_dg, MIN_AMAX, FMT_MAX)
        tl.store(ht_s + cols * (M // 128) + t0, s_h)
        tl.store(dut_s + cols * (M // 128) + t0, s_du)
        tl.store(dgt_s + cols * (M // 128) + t0, s_dg)
        for i in tl.static_range(0, 128, SUB):
            rows = t0 * 128 + i + tl.arange(0, SUB)
            h, du, dg = _swiglu_rows(g_ptr, u_ptr, dh_ptr, rows, cols, F)
            _col_cast(h, m_h, rows, cols, M, ht_q)
            _col_cast(du, m_du, rows, cols, M, dut_q)
            _col_cast(dg, m_dg, rows, cols, M, dgt_q)

    @triton.jit
    def _col_groups(v, rows, cols, M, qt_ptr, st_ptr, t0, MIN_AMAX: tl.constexpr,
                    FMT_MAX: tl.constexpr):  # fmt: skip
        # v [128 tokens, CHUNK columns]: every 128 x 1 group whole; cast, stored transposed
        m, sc = _inv(_maxbits(v, 0), MIN_AMAX, FMT_MAX)
        _col_cast(v, m, rows, cols, M, qt_ptr)
        tl.store(st_ptr + cols * (M // 128) + t0, sc)

    @triton.jit
    def swiglu_backward_chunks(
        g_ptr, u_ptr, dh_ptr, M, F, dg_q, dg_s, dgt_q, dgt_s, du_q, du_s, dut_q, dut_s, ht_q,
        ht_s, MIN_AMAX: tl.constexpr, FMT_MAX: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # The 128 x 128 tile in chunks of CHUNK columns (all 128 tokens), so that few values
        # are live at once: a chunk holds its 128 x 1 groups whole, so the first sweep casts
        # and stores the three transposed operands (128 contiguous bytes a column) and carries
        # the 1 x 128 groups' maxima; the second computes dg and du again from the tile (now in
        # L1/L2) for the row-wise casts.
        t0, t1 = tl.program_id(0), tl.program_id(1)
        rows = t0 * 128 + tl.arange(0, 128)
        r_du = tl.zeros([128], dtype=tl.int32)
        r_dg = tl.zeros([128], dtype=tl.int32)
        for c0 in range(0, 128, CHUNK):
            cols = t1 * 128 + c0 + tl.arange(0, CHUNK)
            h, du, dg = _swiglu_rows(g_ptr, u_ptr, dh_ptr, rows, cols, F)
            _col_groups(h, rows, cols, M, ht_q, ht_s, t0, MIN_AMAX, FMT_MAX)
            _col_groups(du, rows, cols, M, dut_q, dut_s, t0, MIN_AMAX, FMT_MAX)
            _col_groups(dg, rows, cols, M, dgt_q, dgt_s, t0, MIN_AMAX, FMT_MAX)
            r_du = tl.maximum(r_du, _maxbits(du, 1))
            r_dg = tl.maximum(r_dg, _maxbits(dg, 1))
        m_du, s_du = _inv(r_du, MIN_AMAX, FMT_MAX)
        m_dg, s_dg = _inv(r_dg, MIN_AMAX, FMT_MAX)
        tl.store(du_s + rows * (F // 128) + t1, s_du)
        tl.store(dg_s + rows * (F // 128) + t1, s_dg)
        for c0 in range(0, 128, CHUNK):
            cols = t1 * 128 + c0 + tl.arange(0, CHUNK)
            _, du, dg = _swiglu_rows(g_ptr, u_ptr, dh_ptr, rows, cols, F)
            offs = rows[:, None] * F + cols[None, :]
            tl.store(du_q + offs, (du * m_du[:, None]).to(tl.float8e4nv))
            tl.store(dg_q + offs, (dg * m_dg[:, None]).to(tl.float8e4nv))


FORMS = ("tile", "bands", "chunks")


def fused(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, num_warps: int = 8,
          form: str = "tile", sub: int = 32):  # fmt: skip
    """`reference`'s outputs from a one-pass kernel (M and F multiples of 128): `form` "tile"
    holds each 128 x 128 tile for all its maxima and casts, "bands" works through the tile in
    bands of `sub` tokens (both group directions' maxima in the first sweep, the transposed
    casts in a second), "chunks" in chunks of `sub` columns (the transposed casts in the first
    sweep, the row-wise ones in a second)."""
    if triton is None:
        raise RuntimeError("the one-pass kernel needs Triton")
    m, f = g.shape
    if m % 128 or f % 128:
        raise ValueError(f"the probe's kernel takes multiples of 128, got {m} x {f}")
    e4m3, f32 = torch.float8_e4m3fn, torch.float32

    def new(*shape, dtype):
        return torch.empty(shape, dtype=dtype, device=g.device)

    out = []
    for _ in range(2):  # dg, du
        out += [new(m, f, dtype=e4m3), new(m, f // 128, dtype=f32),
                new(f, m, dtype=e4m3), new(f, m // 128, dtype=f32)]  # fmt: skip
    out += [new(f, m, dtype=e4m3), new(f, m // 128, dtype=f32)]
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    kw = dict(MIN_AMAX=E4M3_MAX / _INV_MULTIPLIER_MAX, FMT_MAX=E4M3_MAX, num_warps=num_warps)
    grid = (m // 128, f // 128)
    if form == "bands":
        swiglu_backward_blocks_sub[grid](g, u, dh, m, f, *out, SUB=sub, **kw)
    elif form == "chunks":
        swiglu_backward_chunks[grid](g, u, dh, m, f, *out, CHUNK=sub, **kw)
    else:
        swiglu_backward_blocks[grid](g, u, dh, m, f, *out, **kw)
    return tuple(out)


def inputs(m: int, f: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 g, u, dh [m, f] like a trained MLP's (unit-scale gate and up, small dh), with a
    few large entries so that groups differ in their maxima."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(scale):
        return (torch.randn(m, f, device=device, generator=gen) * scale).to(torch.bfloat16)

    g, u, dh = rand(1.5), rand(1.0), rand(1e-3)
    g.view(-1)[::9973] *= 8
    return g, u, dh


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16384, help="tokens")
    ap.add_argument("--ffn", type=int, default=5632, help="F, the MLP's hidden width (1.3B)")
    ap.add_argument("--warps", default="4,8,16", help="the kernels' num_warps to try")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"of {FORMS}")
    ap.add_argument("--bands", default="16,32", help="'bands' form: tokens a band")
    ap.add_argument("--chunks", default="16,32,64", help="'chunks' form: columns a chunk")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        g, u, dh = inputs(256, 384, "cpu")
        outs = reference(g, u, dh)
        print("cpu smoke run:", {n: tuple(t.shape) for n, t in zip(OUTPUTS, outs, strict=True)})
        return
    g, u, dh = inputs(args.m, args.ffn, "cuda")
    compiled = torch.compile(reference, fullgraph=True)
    want = compiled(g, u, dh)
    n = args.m * args.ffn
    copy = copy_bandwidth()
    records = []

    def timed(name, fn):
        prof = kernel_profile(fn, reps=10, top=6)
        gbs = 11 * n / (prof["kernel_ms"] * 1e-3) / 1e9  # 6 bytes read, 5 written
        rec = {"form": name, "kernel_ms": prof["kernel_ms"], "kernels": prof["kernels"],
               "gb_s_at_11_bytes": gbs, "frac_of_copy": gbs / copy,
               "top_kernels": prof["top_kernels"]}  # fmt: skip
        records.append(rec)
        print({k: v for k, v in rec.items() if k != "top_kernels"}, flush=True)
        return rec

    timed("inductor (compiled reference)", lambda: compiled(g, u, dh))
    variants = [
        (form, int(w), int(b))
        for form in args.forms.split(",")
        for w in args.warps.split(",")
        for b in {"bands": args.bands, "chunks": args.chunks}.get(form, "0").split(",")
    ]
    for form, w, b in variants:
        got = fused(g, u, dh, num_warps=w, form=form, sub=b)
        diff = {
            name: int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.dtype != b.dtype
            or a.element_size() == 1 else int((a != b).sum())
            for name, a, b in zip(OUTPUTS, got, want, strict=True)
        }  # fmt: skip
        unit = "columns" if form == "chunks" else "tokens"
        name = f"{form}{f' of {b} {unit}' if b else ''}, num_warps={w}"
        run = partial(fused, g, u, dh, num_warps=w, form=form, sub=b)
        rec = timed(name, run)
        rec["differing_entries"] = diff
        print(diff, flush=True)
    title = "blockwise_swiglu_probe" + (f"_{args.tag}" if args.tag else "")
    lines = [f"`{' '.join(sys.argv)}`", "", f"M = {args.m}, F = {args.ffn}; copy bandwidth "
             f"{copy:.0f} GB/s; bandwidth at the one-pass bytes (11 an element).", "",
             "| form | kernel ms | kernels | GB/s at 11 B | of copy | entries differing from "
             "the reference |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        diff = r.get("differing_entries")
        lines.append(
            f"| {r['form']} | {r['kernel_ms']:.3f} | {r['kernels']:.0f} | "
            f"{r['gb_s_at_11_bytes']:.0f} | {r['frac_of_copy']:.0%} | "
            f"{'—' if diff is None else diff} |"
        )
    md, _ = write_results(title, records, "\n".join(lines), out_dir=Path(args.out_dir),
                          day=args.date)  # fmt: skip
    print(md.read_text())


if __name__ == "__main__":
    main()
