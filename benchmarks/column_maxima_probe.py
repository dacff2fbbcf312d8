"""Why do the wgrad fold's column maxima run slower than the same input's plain column maxima?

The bandwidth target's misses that nothing explains yet (docs/hopper.md's target table): the
wgrad fold's quantizer takes the column maxima of x·s (bf16 x [M, K], float32 row multipliers s
[M, 1]) at 52-72 % of copy bandwidth, where the plain transposed quantizer's column maxima of
the same x reach 72-92 % (`kernels_s92_h200_2026-12-04.md`: 23.5 against 16.9 us at 32768 x
768, 45.6 against 37.5 us at 32768 x 2048), the bytes read the same but for s. Session 84's
hand-written Triton tilings of the fold's maxima were slower still. Session 58 found the
quantizers bound by their instructions, not their bytes. The forms here take one step at a
time from the plain maxima to the fold's, each `operand._column_amax` (bands of 256 rows, then
the bands' maximum) compiled alone:

- "bf16 x": the magnitude bits of x itself (16-bit integers), as the plain quantizer does;
- "float32 x": of x converted to float32 (32-bit integers: the width);
- "float32 x * 2": times a constant (the multiply, no second input);
- "float32 x * s": times s, the fold's maxima (the load of s along the reduced dim);
- "float32 x * s, one stage" (session 95): the same in one reduction over all rows, whose
  kernels index s by the reduced dim alone (inductor may split it in its own way);
- "float32 x * s, nd tiling" (session 95): the fold compiled with inductor's two-dimensional
  tiles (`ND_TILING`), band and column as separate indices: whether s's load is the cost;
- "triton band=B rows=R cols=C warps=W" (session 94): the fold's maxima by a Triton kernel of
  our own, each program a band of B rows by C columns in loads of R rows, s loaded once a row,
  an elementwise running maximum reduced across rows once at the end (session 84's tilings in
  maxima_ceiling_probe.py reduced every load, 35-58 % of copy), then the bands' maximum
  (`torch.amax`, its kernel counted); "atomic" (session 94, prepared): one kernel that takes
  the bands' maxima by atomic maxima into a zeroed [K] (the memset counted). The last column
  has the Triton kernel's own time (10 profiled calls, L2 flushed), without the partials'
  `torch.amax` or the memset: session 94's run had those in every Triton form's time. Why a
  kernel of our own: session 94's run showed inductor's fold loading s as a [columns x rows]
  tile, one address an element of x, since s's index there depends on the program's columns
  (`x1 = xindex // K`): as many loads of s as of x.

Each form's maxima equal its eager run bit for bit (checked), its GPU time is the profiler's
with the L2 flushed (`do_bench_using_profiling`, all its kernels), rated against the copy and
against a copy of the same bytes (quantizer_bandwidth.py's `same_size_copy_us`), and the
results file keeps what decides a reduction's speed for reading afterwards: each kernel's
source as inductor wrote it (size hints, reduction hint, persistent or looped) and the
configuration its autotuner kept.

    PYTHONPATH=src python benchmarks/column_maxima_probe.py [--tag T] [--out-dir D]
    PYTHONPATH=src python benchmarks/column_maxima_probe.py --device cpu   # smoke run, no times
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cold_kernel_times, copy_bandwidth, probe_parser, write_probe  # noqa: E402
from minifloat.kernels import operand  # noqa: E402
from quantizer_bandwidth import SHAPES, same_size_copy_us  # noqa: E402

CPU_SHAPES = ((512, 256),)
# (band, rows a load, columns, warps, atomic) of the Triton form; the columns divide every K
# here. Session 94's run timed eight partial and four atomic tilings (`column_maxima_probe_s94b`,
# `_s95`): 32-row loads, 2048-8192 elements a program, alone 80-86 % of copy at 16384 x 11008
# and 27-68 % elsewhere, slower than inductor's 64 columns x 8 rows at 4 warps (512 elements).
# Session 95's: inductor's tile size with s loaded once a row, and the four best before.
TILES = ((256, 8, 64, 4, 0), (256, 8, 64, 2, 0), (256, 16, 64, 4, 0), (256, 8, 128, 4, 0),
         (256, 4, 128, 4, 0), (512, 8, 64, 4, 0), (256, 8, 64, 4, 1), (256, 16, 64, 4, 1),
         (256, 32, 64, 2, 0), (256, 32, 64, 2, 1), (512, 32, 128, 4, 1),
         (256, 32, 128, 4, 0))  # fmt: skip
# Inductor's two-dimensional tiles for the reduction's kernel: (band, column) as two program
# indices, so that s's index no longer depends on the columns (a diagnosis: options of one
# compile here, not something a quantizer inside a user's compiled model could set).
ND_TILING = {"triton.prefer_nd_tiling": True, "triton.tile_reductions": True}


def forms() -> dict[str, tuple[Callable, int, dict]]:
    """name -> (fn(x, s) -> [1, K] float32 maxima, bytes read per element of x besides x's 2,
    torch.compile options)."""
    fold = lambda x, s: operand._column_amax(x.float() * s)  # noqa: E731

    def one_stage(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        bits = operand.magnitude_bits(x.float() * s).amax(dim=0, keepdim=True)
        return operand.from_magnitude_bits(bits, torch.float32)

    return {
        "bf16 x": (lambda x, s: operand._column_amax(x), 0, {}),
        "float32 x": (lambda x, s: operand._column_amax(x.float()), 0, {}),
        "float32 x * 2": (lambda x, s: operand._column_amax(x.float() * 2.0), 0, {}),
        "float32 x * s": (fold, 1, {}),
        "float32 x * s, one stage": (one_stage, 1, {}),
        "float32 x * s, nd tiling": (fold, 1, known_options(ND_TILING)),
    }


def known_options(options: dict) -> dict:
    """`options` this torch's inductor knows (torch.compile rejects the others)."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {key: value for key, value in options.items() if key in known}


@functools.cache
def fold_kernel():
    """The fold's column maxima as a Triton kernel (built on first use): each band's partials,
    or with ATOMIC the maxima themselves by atomic maxima into a zeroed [K]."""
    import triton
    import triton.language as tl

    @triton.jit
    def fold_band_maxima(x_ptr, s_ptr, out_ptr, k, BAND: tl.constexpr, ROWS: tl.constexpr,
                         COLS: tl.constexpr, ATOMIC: tl.constexpr):  # fmt: skip
        band = tl.program_id(0)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        acc = tl.zeros([ROWS, COLS], dtype=tl.int32)  # magnitudes' bits: >= 0
        for r0 in tl.range(0, BAND, ROWS):
            rows = band * BAND + r0 + tl.arange(0, ROWS)
            v = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * k + cols[None, :],
                eviction_policy="evict_first",
            ).to(tl.float32)
            s = tl.load(s_ptr + rows)
            acc = tl.maximum(acc, (v * s[:, None]).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        if ATOMIC:  # non-negative int32: any order gives the same maximum
            tl.atomic_max(out_ptr + cols, tl.max(acc, axis=0))
        else:
            tl.store(out_ptr + band * k + cols, tl.max(acc, axis=0))

    return fold_band_maxima


def tile_name(tile: tuple[int, ...]) -> str:
    """A TILES entry as the form's name."""
    band, rows, cols, warps, atomic = tile
    return f"triton band={band} rows={rows} cols={cols} warps={warps}" + (
        " atomic" if atomic else ""
    )


def triton_fold(x: torch.Tensor, s: torch.Tensor, tile: tuple[int, ...]) -> Callable:
    """A call of `fold_kernel` with `tile` on contiguous x [M, K] and s [M, 1] that returns the
    [1, K] float32 maxima, as `operand._column_amax(x.float() * s)`; None where the tile does
    not divide x."""
    band, rows, cols, warps, atomic = tile
    m, k = x.shape
    if m % band or k % cols or band % rows:
        return None
    kernel = fold_kernel()
    grid = (m // band, k // cols)
    meta = dict(BAND=band, ROWS=rows, COLS=cols, ATOMIC=bool(atomic), num_warps=warps)
    if atomic:

        def run() -> torch.Tensor:
            out = torch.zeros(1, k, dtype=torch.int32, device=x.device)  # a memset kernel
            kernel[grid](x, s, out, k, **meta)
            return out.view(torch.float32)

        return run
    part = torch.empty(m // band, k, dtype=torch.int32, device=x.device)

    def run_partials() -> torch.Tensor:
        kernel[grid](x, s, part, k, **meta)
        return part.amax(dim=0, keepdim=True).view(torch.float32)

    return run_partials


def triton_records(x, s, want, bw, copies) -> list[dict]:
    """Every tiling of the Triton fold at x's shape: bit check against `want`, time, rates."""
    from torch._inductor.utils import do_bench_using_profiling

    m, k = x.shape
    nbytes = 2 * x.numel() + 4 * m + 4 * k
    records = []
    for tile in TILES:
        run = triton_fold(x, s, tile)
        if run is None:
            continue
        exact = torch.equal(run().view(torch.int32), want.view(torch.int32))
        rec = dict(shape=f"{m}x{k}", form=tile_name(tile), gb=nbytes / 1e9, kernels=2,
                   sources=[], configs={}, exact=exact)  # fmt: skip
        if bw is not None:
            us = do_bench_using_profiling(run) * 1e3
            # the fold kernel alone (without the partials' torch.amax or the memset)
            fold_us = cold_kernel_times(run)[0].get("fold_band_maxima", float("nan")) * 1e3
            rec |= dict(us=us, frac_of_copy=rec["gb"] / us * 1e6 / bw,
                        frac_of_same_copy=same_size_copy_us(rec["gb"], copies) / us,
                        fold_us=fold_us,
                        fold_frac_of_copy=rec["gb"] / fold_us * 1e6 / bw)  # fmt: skip
        print({key: v for key, v in rec.items() if key != "sources"}, flush=True)
        records.append(rec)
    return records


def compiled_with_sources(
    fn: Callable, *args: torch.Tensor, options: dict | None = None
) -> tuple[Callable, list[str], dict]:
    """`fn` compiled (fullgraph, with inductor `options`), its kernels' sources as inductor
    wrote them, and the configuration each Triton kernel's autotuner kept ({} where there are
    none: the CPU)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.utils import run_and_get_kernels

    compiled = torch.compile(fn, fullgraph=True, options=options or None)
    before = len(PyCodeCache.modules)
    _, sources = run_and_get_kernels(compiled, *args, remove_quote=True)
    return compiled, sources, kept_configs(PyCodeCache.modules[before:])


def kept_configs(modules: list) -> dict[str, str]:
    """{kernel name: the config its launcher runs (after autotuning, the one kept), and how
    many it chose from where torch still lists them} of the Triton kernels in inductor's
    generated `modules`."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    kept = {}
    for module in modules:
        for name, obj in vars(module).items():
            if isinstance(obj, CachingAutotuner) and obj.launchers:
                # torch 2.11 drops `configs` once autotuning has chosen (session 93's run).
                of = f" (of {len(obj.configs)})" if obj.configs is not None else ""
                kept[name] = f"{obj.launchers[0].config}{of}"
    return kept


def shape_records(m: int, k: int, device: str, bw: float | None, copies: dict) -> list[dict]:
    """Every form at [m, k]: bit check against eager, time and rates (GPU), sources, configs."""
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).bfloat16().to(device)
    s = (torch.rand(m, 1, generator=gen) + 0.5).to(device)
    records = []
    for name, (fn, s_per_row, options) in forms().items():
        torch._dynamo.reset()
        compiled, sources, configs = compiled_with_sources(fn, x, s, options=options)
        got, want = compiled(x, s), fn(x, s)
        exact = torch.equal(got.view(torch.int32), want.view(torch.int32))
        nbytes = 2 * x.numel() + 4 * m * s_per_row + 4 * k
        rec = dict(shape=f"{m}x{k}", form=name, exact=exact, gb=nbytes / 1e9,
                   kernels=len(sources), sources=sources, configs=configs)  # fmt: skip
        if bw is not None:
            from torch._inductor.utils import do_bench_using_profiling

            us = do_bench_using_profiling(lambda: compiled(x, s)) * 1e3  # noqa: B023
            rec |= dict(us=us, frac_of_copy=rec["gb"] / us * 1e6 / bw,
                        frac_of_same_copy=same_size_copy_us(rec["gb"], copies) / us)  # fmt: skip
        print({key: v for key, v in rec.items() if key != "sources"}, flush=True)
        records.append(rec)
    if x.is_cuda or triton_interpreted():
        fold = operand._column_amax(x.float() * s)  # eager: the definition
        records += triton_records(x.contiguous(), s.contiguous(), fold, bw, copies)
    return records


def triton_interpreted() -> bool:
    """Whether Triton runs in its interpreter here (TRITON_INTERPRET=1, Triton installed)."""
    import importlib.util
    import os

    return bool(os.environ.get("TRITON_INTERPRET")) and importlib.util.find_spec("triton")


def table(records: list[dict], bw: float | None) -> str:
    """The forms' times and rates, then each form's kept configs and kernel sources (from the
    first shape: the same code at every shape but for the size hints)."""
    head = f"Copy bandwidth {bw:.0f} GB/s (256 MiB copy, read + write)." if bw else "CPU: no times."
    lines = [head, "", "| shape | form | us | % of copy | % of a same-size copy | kernels | "
             "bit-exact | Triton fold kernel alone: us, % of copy |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        us = f"{r['us']:.1f}" if "us" in r else "—"
        rates = [
            f"{r[key]:.0%}" if key in r else "—" for key in ("frac_of_copy", "frac_of_same_copy")
        ]
        alone = f"{r['fold_us']:.1f}, {r['fold_frac_of_copy']:.0%}" if "fold_us" in r else "—"
        exact = "yes" if r["exact"] else "**no**"
        lines.append(f"| {r['shape']} | {r['form']} | {us} | {rates[0]} | {rates[1]} | "
                     f"{r['kernels']} | {exact} | {alone} |")  # fmt: skip
    for r in (r for r in records if r["sources"] or r["configs"]):
        lines += ["", f"### {r['shape']}, {r['form']}", ""]
        lines += [f"- `{name}`: {config}" for name, config in r["configs"].items()]
        for source in r["sources"]:
            lines += ["", "```python", source.strip(), "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("column_maxima_probe.py needs a CUDA GPU (or --device cpu)")
    gpu = args.device == "cuda"
    bw = copy_bandwidth() if gpu else None
    records, copies = [], {}
    for i, (m, k) in enumerate(SHAPES if gpu else CPU_SHAPES):
        shape = shape_records(m, k, args.device, bw, copies)
        if i:  # the sources once: the first shape's
            shape = [r | dict(sources=[], configs={}) for r in shape]
        records += shape
    exact = all(r["exact"] for r in records)
    verdict = "equal eager's" if exact else "differ from eager's: see the table"
    print(f"every form's compiled maxima {verdict}" if exact else f"some forms' maxima {verdict}")
    if not gpu:  # a smoke run: the forms compile and agree; no times to write
        return
    write_probe("column_maxima_probe", args, records, table(records, bw))


if __name__ == "__main__":
    main()
