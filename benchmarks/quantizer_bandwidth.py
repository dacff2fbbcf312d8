"""Quantizer bandwidth and exactness on the GPU, and `_scaled_mm` behaviour probes.

    PYTHONPATH=src python benchmarks/quantizer_bandwidth.py [--out-dir DIR] [--date D] [--tag T]
        [--scale-format inv|fp32]

For each operand quantization QuantLinear runs (M = 16384 tokens at the 7B widths, and the 125M
model's 32768 x 768 / 2048), times `kernels/operand.quantize_operand` compiled on its own
(`torch.compile(fullgraph=True)`: the kernels inductor makes of it): CUDA-event time per call
(host overhead included) and GPU kernel time (profiler); bandwidth is bytes read once plus bytes
written over the kernel time, against a measured device-to-device copy's rate. Then each memory
pass on its own: every kernel inductor makes of a quantizer, timed by inductor's bandwidth
profiler with the bytes inductor counts for it (each buffer read or written once), and the
transposed FP8 copy (`transpose_copy`) that eager Hopper GEMMs run after the transposed ones
(compiled training ran it too until session 60; now the cast's kernel writes them), and the
weight ops, each timed whole (`weight_passes`): fp8-blockwise's one Triton kernel a weight
(session 91), fp8-tensorwise's two (session 92), fp8-rowwise's two (prepared in session 92).
Checks that the compiled quantizer's values and scales equal `minifloat.quantize.quantize` on
the CPU bit for bit (random data with exact grid midpoints, zeros, NaN, inf, subnormals). Also:
which fp32 order row-wise `_scaled_mm` applies scales in (the emulation uses the same).
Scales in the "inv" format by default, the one every absmax recipe quantizes with since session
38 (`--scale-format fp32`: the format these tables used until session 58, whose casts keep a clamp
to the format's range that the "inv" casts leave out; `round_to_storage`).
Results: benchmarks/results/kernels[_<tag>]_<gpu>_<date>.{md,json} (the script was kernels.py until
session 88: benchmarks/ lands on sys.path, and a module named `kernels` there shadowed the
Hugging Face `kernels` package that `transformers` imports when it finds one).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, environment, kernel_ms, time_ms, write_results  # noqa: E402
from minifloat import formats  # noqa: E402
from minifloat.kernels import operand  # noqa: E402
from minifloat.kernels import scaled_mm as smm  # noqa: E402
from minifloat.kernels.transpose import transpose_copy  # noqa: E402
from minifloat.quantize import quantize  # noqa: E402

M = 16384
# A pass moving less than this share of its quantizer's bytes (the maximum of a few thousand
# partial maxima, a scale's arithmetic) is bound by its launch, not by memory: listed, not rated.
SMALL_PASS = 0.01
# (tokens, features): the 7B and 1.3B layer shapes, and the 125M model's (batch 32 x 1024).
SHAPES = ((M, 4096), (M, 11008), (M, 2048), (32768, 768), (32768, 2048))


def _cases(x: torch.Tensor, col: torch.Tensor, row: torch.Tensor, scale_format: str) -> dict:
    """name -> (quantize_operand kwargs, bytes per element moved: 2 read + 1 per output)."""
    cases = {
        "row e2m1": (dict(fmt="e2m1", granularity="row"), 3),
        "row e5m2 prescale cols (dgrad fold)": (
            dict(fmt="e5m2", granularity="row", prescale=col), 3),
        "col e5m2 prescale rows, T (wgrad fold)": (
            dict(fmt="e5m2", granularity="row", prescale=row, transpose=True), 3),
        "row e4m3": (dict(fmt="e4m3", granularity="row"), 3),
        "col e4m3, T": (dict(fmt="e4m3", granularity="row", transpose=True), 3),
        "tensor e4m3": (dict(fmt="e4m3", granularity="tensor"), 3),
        "1x128 e4m3": (dict(fmt="e4m3", granularity=(1, 128)), 3),
        "128x1 e4m3, T": (dict(fmt="e4m3", granularity=(1, 128), transpose=True), 3),
    }  # fmt: skip
    return {name: (kw | {"scale_format": scale_format}, n) for name, (kw, n) in cases.items()}


def shape_cases(m: int, k: int, scale_format: str) -> tuple[torch.Tensor, dict]:
    """A bf16 input [m, k] on the GPU and `_cases` for it (random folded row and column scales)."""
    x = torch.randn(m, k, device="cuda").bfloat16()
    col = torch.rand(1, k, device="cuda") + 0.5
    row = torch.rand(m, 1, device="cuda") + 0.5
    return x, _cases(x, col, row, scale_format)


def _timings(name: str, fn, nbytes: int, bw: float) -> dict:
    """Event time per call (host overhead included) and GPU kernel time (profiler), and the
    kernel time's bandwidth as a fraction of the copy's."""
    ms = time_ms(fn)
    kms = kernel_ms(fn) or float("nan")
    return {f"{name}_us": ms * 1e3, f"{name}_kernel_us": kms * 1e3,
            f"{name}_frac_of_copy": nbytes / kms / 1e6 / bw}  # fmt: skip


def quantizer_table(bw: float, scale_format: str) -> list[dict]:
    records = []
    for m, k in SHAPES:
        x, cases = shape_cases(m, k, scale_format)
        for name, (kw, bytes_per_el) in cases.items():
            torch._dynamo.reset()
            fn = torch.compile(functools.partial(operand.quantize_operand, **kw), fullgraph=True)
            rec = dict(shape=f"{m}x{k}", case=name)
            rec |= _timings("compiled", lambda: fn(x), bytes_per_el * x.numel(), bw)  # noqa: B023
            records.append(rec)
            print(rec, flush=True)
    return records


def inductor_passes(fn, x: torch.Tensor) -> list[tuple[str, float, float]]:
    """[(kernel, ms, GB)] for each Triton kernel inductor makes of `fn(x)`: inductor's bandwidth
    profiler (`profile_bandwidth`) times each kernel on its own (L2 flushed between repeats, the
    kernel's duration from the profiler) and counts its bytes as every input and output buffer
    moved once."""
    from torch._inductor import config
    from torch._inductor.runtime import triton_heuristics

    calls = triton_heuristics.collected_calls
    calls.clear()
    torch._dynamo.reset()
    # Timed through the profiler (kernel durations from CUPTI): with inductor's default timer a
    # quantizer's passes summed to 1.0-4.7x its profiled time, kernels of a few us read 21-223 us
    # (benchmarks/results/kernels_default_timer_h200_2026-11-26.md).
    timing = dict(profile_bandwidth_with_do_bench_using_profiling=True)
    with config.patch(profile_bandwidth=True, force_disable_caches=True, **timing):
        torch.compile(fn, fullgraph=True)(x)
    torch.cuda.synchronize()
    passes = [(name, ms, gb) for ms, gb, _, name in calls]
    calls.clear()
    torch._dynamo.reset()
    return passes


def same_size_copy_us(gb: float, cache: dict[int, float]) -> float:
    """Kernel µs of a device-to-device copy moving `gb` GB (half read, half written), timed as
    inductor's bandwidth profiler times a pass (profiler durations, L2 flushed between calls);
    cached by size in MB. Why: the copy bandwidth above is a 512 MB copy's, and a pass of
    50-70 MB (the 1.3B and 125M widths) also pays a kernel's ramp-up and tail, which a copy of
    its own size pays too (session 63)."""
    from torch._inductor.utils import do_bench_using_profiling

    key = round(gb * 1e3)
    if key not in cache:
        src = torch.empty(max(1, int(gb * 1e9 / 2)), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        cache[key] = do_bench_using_profiling(lambda: dst.copy_(src)) * 1e3
    return cache[key]


def pass_table(bw: float, scale_format: str) -> list[dict]:
    """Every memory pass of every quantizer case, and the transposed FP8 copy, as a fraction of
    the copy's bandwidth and of a copy of the pass's own bytes (`same_size_copy_us`; `rated`:
    the passes that move at least SMALL_PASS of the case's bytes)."""
    records = []
    copies: dict[int, float] = {}
    for m, k in SHAPES:
        x, cases = shape_cases(m, k, scale_format)
        for name, (kw, _) in cases.items():
            passes = inductor_passes(functools.partial(operand.quantize_operand, **kw), x)
            total = sum(gb for _, _, gb in passes)
            for kernel, ms, gb in passes:
                records.append(dict(shape=f"{m}x{k}", case=name, kernel=kernel, us=ms * 1e3,
                                    gb=gb, frac_of_copy=gb / ms * 1e3 / bw,
                                    frac_of_same_copy=same_size_copy_us(gb, copies) / (ms * 1e3),
                                    rated=gb >= SMALL_PASS * total))  # fmt: skip
                print(records[-1], flush=True)
        q = x.to(torch.float8_e4m3fn)
        kms = kernel_ms(lambda: transpose_copy(q))  # noqa: B023
        gb = 2 * q.numel() / 1e9
        records.append(_kernel_pass(f"{m}x{k}", "transpose_copy e4m3", "_transpose_kernel",
                                    kms, gb, bw, copies))  # fmt: skip
        print(records[-1], flush=True)
    return records + weight_passes(bw, copies)


def _kernel_pass(
    shape: str, case: str, kernel: str, ms: float, gb: float, bw: float, copies: dict[int, float]
) -> dict:
    """A rated pass record of one kernel of ours (not inductor's) taking `ms` for `gb` GB."""
    return dict(shape=shape, case=case, kernel=kernel, us=ms * 1e3, gb=gb,
                frac_of_copy=gb / ms * 1e3 / bw,
                frac_of_same_copy=same_size_copy_us(gb, copies) / (ms * 1e3),
                rated=True)  # fmt: skip


# The weights (out_features, in_features) at the 7B and 1.3B widths, float32 masters
WEIGHT_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (2048, 2048), (5632, 2048),
                 (2048, 5632))  # fmt: skip


def _weight_ops() -> list[tuple[str, str, Callable, int]]:
    """(case, kernels, fn(w), bytes an element of w moved by all its kernels) of the weight ops:
    fp8-blockwise's (one kernel: w read once, E4M3 written twice), fp8-tensorwise's (block
    maxima, then both casts: w read twice) and fp8-rowwise's (row and column maxima, then its two
    casts: w read twice, the second read of a block's transposed tile L2-hot, not counted)."""
    from minifloat.kernels.weight_blocks import weight_blocks
    from minifloat.kernels.weight_rows import weight_rows
    from minifloat.kernels.weight_tensor import weight_tensor

    return [
        ("weight 128x128 e4m3 (values and transpose)", "_weight_blocks_kernel",
         lambda w: weight_blocks(w, inv=True), 4 + 1 + 1),
        ("weight tensor e4m3 (values and transpose)", "maxima + cast kernels",
         lambda w: weight_tensor(w, inv=True), 4 + 4 + 1 + 1),
        ("weight rows e4m3 (w and wT operands)", "maxima + cast kernels",
         lambda w: weight_rows(w, inv=True), 4 + 4 + 1 + 1),
    ]  # fmt: skip


def weight_passes(bw: float, copies: dict[int, float]) -> list[dict]:
    """The weight ops (kernels/weight_blocks.py, weight_tensor.py, weight_rows.py), each timed
    whole (all its kernels) as inductor's bandwidth profiler times its passes (profiler
    durations, L2 flushed between calls: a 1.3B weight would otherwise stay in L2), rated by the
    bytes all its kernels move (scales and partial maxima left out: under 1 %)."""
    from torch._inductor.utils import do_bench_using_profiling

    records = []
    for case, kernel, fn, bytes_per_el in _weight_ops():
        for n, k in WEIGHT_SHAPES:
            w = torch.randn(n, k, device="cuda") * 0.02
            kms = do_bench_using_profiling(lambda: fn(w))  # noqa: B023
            gb = bytes_per_el * w.numel() / 1e9
            records.append(_kernel_pass(f"{n}x{k}", case, kernel, kms, gb, bw, copies))
            print(records[-1], flush=True)
    return records


def _adversarial(r: int, c: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(r * c)
    x = torch.randn(r, c, generator=gen) * torch.exp(3 * torch.randn(r, c, generator=gen))
    grid = formats.get("e2m1").grid.float()
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])  # grid points and exact midpoints
    s = x.abs().amax(1, keepdim=True) / 6
    x[0, : points.numel()] = points * s[0]
    x[1, : points.numel()] = -points * s[1]
    x[2] = 0.0
    x[3, 3], x[4, 4], x[5] = float("nan"), float("inf"), 1e-42
    x[6, :5] = torch.tensor([448.0, 464.0, 480.0, 57344.0, 61440.0])
    return x.to(dtype)


def exactness(scale_format: str) -> list[dict]:
    """Compiled quantize_operand on the GPU against quantize() on the CPU, bit for bit."""
    records = []
    for dtype in (torch.float32, torch.bfloat16):
        x = _adversarial(256, 384, dtype)
        for fmt in ("e2m1", "e4m3", "e5m2"):
            for g in ("tensor", "row", (1, 128), (128, 128), (1, 32)):
                for transpose in (False, True):
                    torch._dynamo.reset()
                    fn = torch.compile(
                        functools.partial(
                            operand.quantize_operand, fmt=fmt, granularity=g,
                            transpose=transpose, scale_format=scale_format,
                        )
                    )  # fmt: skip
                    values, scale = fn(x.cuda())
                    v = (x.t() if transpose else x).float()
                    ref = quantize(v, fmt, g, scale_format=scale_format)
                    rs = ref.scale.reshape(scale.shape)
                    same = torch.equal(values.float().cpu().nan_to_num(7), ref.values.nan_to_num(7))
                    same &= torch.equal(scale.cpu().nan_to_num(7), rs.nan_to_num(7))
                    records.append(dict(dtype=str(dtype), fmt=fmt, granularity=str(g),
                                        transpose=transpose, bit_exact=bool(same)))  # fmt: skip
    bad = [r for r in records if not r["bit_exact"]]
    print(f"exactness: {len(records) - len(bad)}/{len(records)} bit-exact; mismatches: {bad}")
    return records


def epilogue_order() -> dict:
    """Which fp32 order does row-wise _scaled_mm apply scales in? (E2M1 operands: exact acc)."""
    m, k, n = 1024, 4096, 1024
    xa = quantize(torch.randn(m, k, device="cuda"), "e2m1", "row")
    xb = quantize(torch.randn(n, k, device="cuda"), "e2m1", "row")
    a, b = xa.values.to(torch.float8_e4m3fn), xb.values.to(torch.float8_e4m3fn)
    acc = xa.values @ xb.values.t()  # exact in fp32
    sa, sb = xa.scale, xb.scale.t()
    cands = {"acc*(sa*sb)": acc * (sa * sb), "(acc*sa)*sb": (acc * sa) * sb,
             "(acc*sb)*sa": (acc * sb) * sa}  # fmt: skip
    out = {}
    for fast in (False, True):
        res = smm.scaled_mm_rowish(a, xa.scale, b, xb.scale, out_dtype=torch.float32,
                                   use_fast_accum=fast)  # fmt: skip
        out[f"fast_accum={fast}"] = {name: int((res != c).sum()) for name, c in cands.items()}
    print("epilogue mismatches per candidate order:", out)
    return out


def markdown(
    records: list[dict],
    bw: float,
    exact: list[dict],
    epilogue: dict,
    passes: list[dict],
    scale_format: str,
) -> str:
    n_ok = sum(r["bit_exact"] for r in exact)
    lines = [
        f"Copy bandwidth {bw:.0f} GB/s (read + write). Bandwidth of a quantizer = (2 bytes read "
        "+ 1 byte written) per element / GPU kernel time (profiler), as a fraction of the "
        "copy's; 'call us' is the CUDA-event time of one call, host overhead included. "
        "The quantizer is `kernels/operand.quantize_operand` under "
        f"`torch.compile(fullgraph=True)`, scale format {scale_format!r}. "
        "Target: >= 80 % of copy.",
        "",
        f"Compiled quantizer on the GPU vs `quantize()` on the CPU: {n_ok}/{len(exact)} "
        "configurations bit-exact (values and scales; adversarial inputs).",
        "",
        f"Row-wise `_scaled_mm` epilogue, mismatches per candidate fp32 order: {epilogue}",
        "",
        "| shape | case | call us | kernel us | % of copy |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['shape']} | {r['case']} | {r['compiled_us']:.1f} | "
            f"{r['compiled_kernel_us']:.1f} | {r['compiled_frac_of_copy']:.0%} |"
        )
    return "\n".join(lines + _pass_lines(passes))


def _pass_lines(passes: list[dict]) -> list[str]:
    """The per-pass section: the slowest rated pass of each case, then every pass."""
    by_case: dict[tuple[str, str], list[dict]] = {}
    for p in passes:
        by_case.setdefault((p["shape"], p["case"]), []).append(p)
    lines = [
        "",
        "Each memory pass on its own (inductor's bandwidth profiler: each kernel run alone, L2 "
        "flushed, its duration from the profiler; bytes = every buffer it reads or writes, once; "
        f"`transpose_copy` by the profiler's kernel time). Passes under {SMALL_PASS:.0%} of "
        "their quantizer's bytes are listed, not rated (launch-bound).",
        "",
        "| shape | case | passes (rated) | slowest rated pass, % of copy | the same, % of a "
        "copy of its bytes |",
        "|---|---|---|---|---|",
    ]
    met = {"frac_of_copy": 0, "frac_of_same_copy": 0}
    quantizers = [key for key in by_case if not key[1].startswith("transpose_copy")]
    for (shape, case), ps in by_case.items():
        rated = [p for p in ps if p["rated"]]
        worst = {f: min((p.get(f, float("nan")) for p in rated), default=float("nan"))
                 for f in met}  # fmt: skip
        if not case.startswith("transpose_copy"):
            met = {f: n + (worst[f] >= 0.8) for f, n in met.items()}
        fracs = f"{worst['frac_of_copy']:.0%} | {worst['frac_of_same_copy']:.0%}"
        lines.append(f"| {shape} | {case} | {len(ps)} ({len(rated)}) | {fracs} |")
    lines += ["", f"A quantizer's slowest rated pass at 80 % or more: {met['frac_of_copy']} of "
              f"{len(quantizers)} against the copy bandwidth, {met['frac_of_same_copy']} of "
              f"{len(quantizers)} against a copy of the pass's own bytes.", "",
              "| shape | case | kernel | us | MB | % of copy | % of a same-size copy | rated |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in passes:
        lines.append(
            f"| {p['shape']} | {p['case']} | `{p['kernel'][:60]}` | {p['us']:.1f} | "
            f"{p['gb'] * 1e3:.1f} | {p['frac_of_copy']:.0%} | "
            f"{p.get('frac_of_same_copy', float('nan')):.0%} | {'yes' if p['rated'] else 'no'} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--date", default=None)
    ap.add_argument("--tag", default="", help="results file suffix")
    ap.add_argument("--scale-format", default="inv", choices=("inv", "fp32"))
    args = ap.parse_args()
    print(environment(), flush=True)
    exact = exactness(args.scale_format)
    epilogue = epilogue_order()
    bw = copy_bandwidth()
    records = quantizer_table(bw, args.scale_format)
    passes = pass_table(bw, args.scale_format)
    kw = {"day": args.date} | ({"out_dir": Path(args.out_dir)} if args.out_dir else {})
    all_records = [dict(kind="quantizer", **r) for r in records]
    all_records += [dict(kind="pass", **r) for r in passes]
    all_records += [dict(kind="exactness", **r) for r in exact]
    text = f"`{' '.join(sys.argv)}`\n\n" + markdown(
        records, bw, exact, epilogue, passes, args.scale_format
    )
    md, js = write_results("_".join(filter(None, ("kernels", args.tag))), all_records, text, **kw)
    print(md.read_text())


if __name__ == "__main__":
    main()
