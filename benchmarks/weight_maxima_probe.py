"""fp8-rowwise's weight maxima (every row's and every column's maximum magnitude of w, the first of
kernels/weight_rows_triton.py's two kernels) by that kernel and by streaming tilings of our own.

Why (docs/hopper_sessions.md, sessions 94-95): the rows weight op misses 80 % of copy bandwidth
at 1.3B's weights (56-73 %, `kernels_s94_h200_2026-12-04.md`) while its cast kernel moves its
bytes at copy speed: of the op's 36.2 us for a 5632 x 2048 float32 weight the maxima kernel
takes 19.0 (46 MB read: 2.4 TB/s), and of 18.0 us at 2048 x 2048 it takes 12.1 (16.8 MB:
1.4 TB/s; `weight_blocks_probe_1.3B_rows_s94b_h200_2026-12-04.md`). That kernel holds a whole
128 x 128 float32 block in registers per program (128 values a thread at 4 warps) and makes 256
atomic maxima a block; 2048 x 2048 is 256 such programs on 132 SMs. Weights are leaves with no
producer to fuse, so a faster kernel here costs nothing elsewhere (unlike session 95's fold
maxima, 2.8 ms a step slower for taking dy out of inductor's fusion).

Forms, per weight shape of the 1.3B and 7B blocks (float32, as master weights are):

- "production": `_row_col_maxima_kernel` and its memset, timed in one profile of the op
  (`weight_rows`) with the cast kernel, whose bits test_weight_rows.py checks;
- "band B x C, R rows a load, W warps": each program streams a band of B rows by C columns in
  loads of R rows: the row maxima of each load by an atomic maximum (its C columns are the
  row's part here), the columns' running maximum elementwise in registers, reduced and stored
  by one atomic maximum per column at the band's end (the fold kernel's pattern, session 95).

Session 96 (`weight_maxima_probe_s96{,b}_h200_2026-12-04.md`; the second run's eleven single-load
tilings through `--tiles`): the streaming bands gained at most 1.6 us at 1.3B's weights and lost
at 7B's 4096 x 4096; 64 x 64 blocks at 2 warps took 2048 x 2048 from 11.9 to 8.5 us and tied
elsewhere, but in the op they left a 1.3B fp8-rowwise step no faster (docs/hopper_sessions.md,
session 96), so the production kernel keeps its tiling.

Each tiling's maxima are checked bit for bit against the rows' and columns' maximum magnitudes
by `operand.magnitude_bits` (weights with NaN, inf, -0 and subnormal entries). Times: each
kernel's from the profiler, 10 calls, L2 flushed before each (`common.cold_kernel_times`), rated
against a 256 MiB copy's bandwidth by the bytes read; "op" adds the production cast kernel's
time from the same run, the op's expected time with that maxima kernel, rated as
quantizer_bandwidth.py rates the op (10 bytes an element).

    PYTHONPATH=src python benchmarks/weight_maxima_probe.py [--tag T] [--tiles "B,R,C,W;..."]
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/weight_maxima_probe.py --device cpu
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cold_kernel_times, copy_bandwidth, parse_tiles, probe_parser, write_probe  # noqa: E402
from minifloat.kernels import operand  # noqa: E402
from weight_blocks_probe import weight_shapes  # noqa: E402

# (band rows, rows a load, columns, warps): inductor-sized loads (8 x 64-128) up to the
# production kernel's whole block streamed in 32-row loads.
TILES = "128,8,128,4;128,16,128,4;128,32,128,4;128,32,128,8;256,8,128,4;256,16,128,4;" \
        "128,8,256,4;128,16,256,8;64,8,128,4;128,8,64,2;512,16,128,4;256,32,128,8"  # fmt: skip
CPU_SHAPES = ((256, 384), (384, 128))
BYTES_OP = 10  # quantizer_bandwidth.py's rows op: w read twice (4 + 4), two E4M3 outputs


@functools.cache
def band_kernel() -> Callable:
    """The streaming maxima kernel (built on first use: Triton is imported here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def band_maxima(w, amax, rows, cols, BAND: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):  # fmt: skip
        band = tl.program_id(0)
        c = tl.program_id(1) * COLS + tl.arange(0, COLS)
        acc = tl.zeros([ROWS, COLS], dtype=tl.int32)  # magnitudes' bits: >= 0
        for r0 in tl.range(0, BAND, ROWS):
            r = band * BAND + r0 + tl.arange(0, ROWS)
            v = tl.load(w + r[:, None].to(tl.int64) * cols + c[None, :]).to(tl.float32)
            bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            tl.atomic_max(amax + r, tl.max(bits, axis=1))
            acc = tl.maximum(acc, bits)
        tl.atomic_max(amax + rows + c, tl.max(acc, axis=0))

    return band_maxima


def tile_name(tile: tuple[int, ...]) -> str:
    band, rows, cols, warps = tile
    return f"band {band} x {cols}, {rows} rows a load, {warps} warps"


def band_maxima(w: torch.Tensor, tile: tuple[int, ...]) -> Callable | None:
    """A call of `band_kernel` with `tile` on contiguous float w [R, C] returning the int32
    maxima bits [R + C] (rows, then columns) as the production kernel lays them out; None
    where the tile does not divide w."""
    band, rows, cols, warps = tile
    n, k = w.shape
    if n % band or k % cols or band % rows:
        return None
    kernel = band_kernel()

    def run() -> torch.Tensor:
        amax = torch.zeros(n + k, dtype=torch.int32, device=w.device)
        kernel[(n // band, k // cols)](w, amax, n, k, BAND=band, ROWS=rows, COLS=cols,
                                       num_warps=warps)  # fmt: skip
        return amax

    return run


def reference_maxima(w: torch.Tensor) -> torch.Tensor:
    """The rows' then the columns' maximum magnitudes of w as int32 bits [R + C], by
    `operand.magnitude_bits` (the quantizers' definition; the layout of the kernels' amax)."""
    bits = operand.magnitude_bits(w.float())
    return torch.cat([bits.amax(dim=1), bits.amax(dim=0)])


def special_weight(n: int, k: int, device: str) -> torch.Tensor:
    """Random float32 weights with NaN, inf, -0 and subnormal entries in some rows and columns."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[1, 2], w[3, 5], w[4, :] = float("nan"), float("-inf"), -0.0
    w[:, 7] = 1e-40  # subnormal: its column's maximum
    return w.to(device)


def production_record(names: str, w: torch.Tensor, bw: float) -> tuple[dict, float]:
    """The production op's maxima kernel and memset as a record (their times from one profile
    of `weight_rows`; its bits are test_weight_rows.py's), and its cast kernel's us."""
    from minifloat.kernels.weight_rows import weight_rows

    kernels = cold_kernel_times(lambda: weight_rows(w, inv=True))[0]
    cast_us = kernels.pop("_rows_cast_kernel", float("nan")) * 1e3
    n, k = w.shape
    rec = dict(weights=names, rows=n, cols=k, form="production", exact=None, gb=4 * n * k / 1e9)
    return rec | rates(kernels, rec["gb"], cast_us, n * k, bw), cast_us


def rates(kernels: dict[str, float], gb: float, cast_us: float, numel: int, bw: float) -> dict:
    """A maxima form's times and rates from its kernels' ms (its memset included in the op)."""
    maxima_us = sum(ms for name, ms in kernels.items() if "maxima" in name) * 1e3
    op_us = sum(kernels.values()) * 1e3 + cast_us
    return dict(maxima_us=maxima_us, frac_of_copy=gb / maxima_us * 1e6 / bw, cast_us=cast_us,
                op_us=op_us, op_frac_of_copy=BYTES_OP * numel / op_us / 1e3 / bw)  # fmt: skip


def shape_records(names: str, n: int, k: int, device: str, tiles, bw: float | None) -> list[dict]:
    """Every form at [n, k]: the tilings' maxima bits against `reference_maxima`; on the GPU,
    times, with the production kernel's first."""
    w = special_weight(n, k, device)
    want = reference_maxima(w)
    records, cast_us = [], None
    if bw is not None:
        production, cast_us = production_record(names, w, bw)
        records.append(production)
    for tile in tiles:
        run = band_maxima(w, tile)
        if run is None:
            continue
        rec = dict(weights=names, rows=n, cols=k, form=tile_name(tile),
                   exact=torch.equal(run(), want), gb=4 * n * k / 1e9)  # fmt: skip
        if bw is not None:
            rec |= rates(cold_kernel_times(run)[0], rec["gb"], cast_us, n * k, bw)
        records.append(rec)
    for rec in records:
        print(rec, flush=True)
    return records


def table(records: list[dict], bw: float | None) -> str:
    head = f"Copy bandwidth {bw:.0f} GB/s (256 MiB copy, read + write)." if bw else "No times."
    lines = [head, "", "| weights | shape | form | bit-exact | maxima us | % of copy (read) | "
             "op us (with the cast) | op % of copy |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        t = [f"{r[key]:.1f}" if key in r else "—" for key in ("maxima_us", "op_us")]
        f = [f"{r[key]:.0%}" if key in r else "—" for key in ("frac_of_copy", "op_frac_of_copy")]
        exact = {True: "yes", False: "**no**", None: "(tests)"}[r["exact"]]
        lines.append(f"| {r['weights']} | {r['rows']} x {r['cols']} | {r['form']} | {exact} | "
                     f"{t[0]} | {f[0]} | {t[1]} | {f[1]} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__, TILES, "';'-separated band,rows,columns,warps")
    ap.add_argument("--models", default="1.3B,7B")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("weight_maxima_probe.py needs a CUDA GPU (or --device cpu in Triton's "
                         "interpreter)")  # fmt: skip
    if not gpu and not os.environ.get("TRITON_INTERPRET"):
        raise SystemExit(
            "weight_maxima_probe.py --device cpu runs the kernels in Triton's "
            "interpreter: set TRITON_INTERPRET=1 (and have Triton installed)"
        )
    tiles = parse_tiles(args.tiles)
    if gpu:
        models = args.models.split(",")
        shapes = [(f"{m} {names}", n, k) for m in models for names, n, k in weight_shapes(m)]
    else:
        shapes = [("cpu", n, k) for n, k in CPU_SHAPES]
    bw = copy_bandwidth() if gpu else None
    records = [r for s in shapes for r in shape_records(*s, args.device, tiles, bw)]
    if any(r["exact"] is False for r in records):
        print("SOME MAXIMA DIFFER from the rows' and columns' maximum magnitudes")
    else:
        print("every tiling's maxima equal the rows' and columns' maximum magnitudes")
    write_probe("weight_maxima_probe", args, records, table(records, bw))


if __name__ == "__main__":
    main()
