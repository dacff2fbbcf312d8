"""How fast can a quantizer's maxima pass run? Inductor's against hand-written Triton (GPU only).

Issue 13 asks every quantization pass for >= 80 % of copy bandwidth. On HEAD 27 of the 29
rated passes under that line are maxima passes (`kernels_s82_h200_2026-12-02.md`): among them
the row maxima at widths 768-4096 (71-78 %) and the wgrad fold's column maxima of prescaled rows
(59-72 %; quantizer_bandwidth.py, kernels.py then). This times, at its shapes, the maxima alone
as the quantizers compute them (inductor: `operand.row_amax` of x, and `operand._column_amax` of
x·s for a row multiplier s), against Triton kernels written for nothing but that read, over a
sweep of tilings, to tell whether 80 % is there to take:

- `row`: integer maxima of x's magnitude bits (bf16 -> int16 & 0x7fff) along each row; each
  program reduces `rows` rows, `cols` columns a load, `warps` warps.
- `col`: the same of float32 x·s along each column (int32 & 0x7fffffff): each program reduces
  a band of `band` rows x `cols` columns, `rows` rows a load, into a partial; one torch.amax of
  the partials (its kernel time counted too).
- `inductor partials=N`: inductor's own code with another first-stage width than the quantizers'
  256 (`row_amax`'s `cols_per_partial`, `_column_amax`'s `rows_per_partial`; a width that does
  not divide the reduced dim is skipped, since the quantizers then reduce in one stage; "no
  partials": one `amax`, which inductor may still split itself), to tell whether that choice,
  not inductor, holds the maxima under 80 %.

Every kernel's maxima equal inductor's bit for bit (checked). Times are GPU kernel time from the
profiler with the L2 flushed (`do_bench_using_profiling`, all of a form's kernels together, as
quantizer_bandwidth.py times its same-size copies; it times each quantizer pass alone with
inductor's bandwidth profiler, so its maxima passes read a few points higher); bytes are x's
(plus s's and the maxima; not the column partials); rated against a 256 MiB copy's bandwidth
and against a copy of the same bytes (quantizer_bandwidth.py's `same_size_copy_us`).

    PYTHONPATH=src python benchmarks/maxima_ceiling_probe.py [--tag T] [--out-dir D]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import copy_bandwidth, probe_parser, require_cuda, write_probe  # noqa: E402
from minifloat.kernels import operand  # noqa: E402
from minifloat.kernels.clip import one_stage  # noqa: E402
from quantizer_bandwidth import SHAPES, same_size_copy_us  # noqa: E402

# (rows, cols, warps) for the row maxima; (band, rows, cols, warps) for the column maxima
ROW_TILES = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 8), (8, 512, 8), (16, 256, 4), (4, 512, 4),
             (8, 1024, 8), (32, 256, 8)]  # fmt: skip
COL_TILES = [(256, 32, 128, 4), (256, 16, 256, 4), (512, 32, 128, 8), (128, 64, 64, 4),
             (256, 64, 128, 8), (1024, 32, 128, 8)]  # fmt: skip
# first-stage widths of inductor's two-stage maxima besides the quantizers' 256; 0: one stage
PARTIALS = (128, 512, 1024, 2048, 0)


@functools.cache
def _kernels():
    """The two Triton kernels (built on first use: Triton needs a GPU to run them)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_max(x_ptr, out_ptr, m, k, ROWS: tl.constexpr, COLS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        acc = tl.zeros([ROWS], dtype=tl.int32)
        for k0 in range(0, k, COLS):
            cols = k0 + tl.arange(0, COLS)
            mask = (rows[:, None] < m) & (cols[None, :] < k)
            v = tl.load(x_ptr + rows[:, None] * k + cols[None, :], mask=mask, other=0)
            acc = tl.maximum(acc, tl.max(v.to(tl.int32) & 0x7FFF, axis=1))
        tl.store(out_ptr + rows, acc.to(tl.int16), mask=rows < m)

    @triton.jit
    def col_max(x_ptr, s_ptr, part_ptr, m, k, BAND: tl.constexpr, ROWS: tl.constexpr,
                COLS: tl.constexpr):  # fmt: skip
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        acc = tl.zeros([COLS], dtype=tl.int32)
        for r0 in range(0, BAND, ROWS):
            rows = tl.program_id(0) * BAND + r0 + tl.arange(0, ROWS)
            mask = (rows[:, None] < m) & (cols[None, :] < k)
            v = tl.load(x_ptr + rows[:, None] * k + cols[None, :], mask=mask, other=0.0)
            s = tl.load(s_ptr + rows, mask=rows < m, other=0.0)
            bits = (v.to(tl.float32) * s[:, None]).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            acc = tl.maximum(acc, tl.max(bits, axis=0))
        tl.store(part_ptr + tl.program_id(0) * k + cols, acc, mask=cols < k)

    return row_max, col_max


def _runs(fn, form: str) -> bool:
    """Whether `fn` compiles and runs; a tiling Triton rejects is reported and skipped."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - a probe reports a bad tiling and goes on
        print(f"{form}: {type(err).__name__}: {str(err)[:200]}", flush=True)
        return False
    return True


def _bench(fn) -> float:
    from torch._inductor.utils import do_bench_using_profiling

    return do_bench_using_profiling(fn) * 1e3  # us


def _record(shape, kind, form, us, nbytes, bw, copies, exact) -> dict:
    gb = nbytes / 1e9
    rec = dict(shape=shape, kind=kind, form=form, us=round(us, 2), gb=round(gb, 4),
               frac_of_copy=gb / us * 1e6 / bw,
               frac_of_same_copy=same_size_copy_us(gb, copies) / us, exact=exact)  # fmt: skip
    print(rec, flush=True)
    return rec


def _launch_row(row_max, x_bits, out, rows, cols, warps) -> None:
    m, k = x_bits.shape
    row_max[(-(-m // rows),)](x_bits, out, m, k, ROWS=rows, COLS=cols, num_warps=warps)


def _launch_col(col_max, x, s, part, band, rows, cols, warps) -> torch.Tensor:
    m, k = x.shape
    grid = (part.shape[0], -(-k // cols))
    col_max[grid](x, s, part, m, k, BAND=band, ROWS=rows, COLS=cols, num_warps=warps)
    return part.amax(dim=0)


def _prescaled_column_amax(v: torch.Tensor, r: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """The wgrad fold's column maxima: of v's rows times r, float32, in bands of `rows`."""
    return operand._column_amax(v.float() * r, rows)


def shape_records(m: int, k: int, bw: float, copies: dict) -> list[dict]:
    """Inductor's and every Triton tiling's row and column maxima of a random bf16 [m, k]."""
    row_max, col_max = _kernels()
    shape = f"{m}x{k}"
    x = torch.randn(m, k, device="cuda").bfloat16()
    s = torch.rand(m, 1, device="cuda") + 0.5
    torch._dynamo.reset()
    row_ref = torch.compile(operand.row_amax, fullgraph=True)
    col_ref = torch.compile(_prescaled_column_amax, fullgraph=True)
    want_row, want_col = row_ref(x).view(-1), col_ref(x, s).view(-1)  # float32 maxima
    row_bytes, col_bytes = 2 * x.numel() + 2 * m, 2 * x.numel() + 4 * m + 4 * k
    records = [
        _record(shape, "row", "inductor (row_amax)", _bench(lambda: row_ref(x)), row_bytes, bw,
                copies, True),
        _record(shape, "col", "inductor (_column_amax of x*s)", _bench(lambda: col_ref(x, s)),
                col_bytes, bw, copies, True),
    ]  # fmt: skip
    records += _partial_records(shape, x, s, want_row, want_col, (row_bytes, col_bytes), bw, copies)
    out = torch.empty(m, dtype=torch.int16, device="cuda")
    for rows, cols, warps in ROW_TILES:
        run = functools.partial(_launch_row, row_max, x.view(torch.int16), out, rows, cols, warps)
        form = f"triton rows={rows} cols={cols} warps={warps}"
        if _runs(run, form):
            exact = torch.equal(operand.from_magnitude_bits(out, torch.bfloat16), want_row)
            records.append(_record(shape, "row", form, _bench(run), row_bytes, bw, copies, exact))
    for band, rows, cols, warps in COL_TILES:
        part = torch.empty(-(-m // band), k, dtype=torch.int32, device="cuda")
        run = functools.partial(_launch_col, col_max, x, s, part, band, rows, cols, warps)
        form = f"triton band={band} rows={rows} cols={cols} warps={warps}"
        if _runs(run, form):
            exact = torch.equal(run().view(torch.float32), want_col)
            records.append(_record(shape, "col", form, _bench(run), col_bytes, bw, copies, exact))
    return records


def _partial_records(shape, x, s, want_row, want_col, nbytes, bw, copies) -> list[dict]:
    """Inductor's row and column maxima with each of `PARTIALS`' first-stage widths."""
    records = []
    for n in PARTIALS:
        form = f"inductor partials={n}" if n else "inductor no partials"
        # a width that does not divide the dim falls back to no partials: timed once, as such
        rows_n, cols_n = n or x.shape[0], n or x.shape[1]
        torch._dynamo.reset()
        if not (n and one_stage(x.shape[1], n)):
            row = functools.partial(torch.compile(operand.row_amax, fullgraph=True), x, cols_n)
            exact = torch.equal(row().view(-1), want_row)
            records.append(_record(shape, "row", form, _bench(row), nbytes[0], bw, copies, exact))
        if not (n and one_stage(x.shape[0], n)):
            col = functools.partial(
                torch.compile(_prescaled_column_amax, fullgraph=True), x, s, rows_n
            )
            exact = torch.equal(col().view(-1), want_col)
            records.append(_record(shape, "col", form, _bench(col), nbytes[1], bw, copies, exact))
    return records


def form_lines(records: list[dict], bw: float, kind: str = "maxima") -> list[str]:
    """The copy bandwidth, then a table row per `_record` (`kind`: the kind column's title)."""
    lines = [f"Copy bandwidth {bw:.0f} GB/s (256 MiB copy, read + write).", "",
             f"| shape | {kind} | form | us | % of copy | % of a same-size copy | bit-exact |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        lines.append(f"| {r['shape']} | {r['kind']} | {r['form']} | {r['us']:.1f} | "
                     f"{r['frac_of_copy']:.0%} | {r['frac_of_same_copy']:.0%} | "
                     f"{'yes' if r['exact'] else '**no**'} |")  # fmt: skip
    return lines


def table(records: list[dict], bw: float) -> str:
    """Every form's row, then per shape inductor's maxima against the best bit-exact other
    first-stage width and the best bit-exact Triton tiling."""
    lines = form_lines(records, bw)
    best: dict[tuple, dict] = {}
    for r in records:
        if r["form"].startswith("inductor (") or not r["exact"]:
            continue
        family = "triton" if r["form"].startswith("triton") else "partials"
        key = (r["shape"], r["kind"], family)
        if key not in best or r["frac_of_copy"] > best[key]["frac_of_copy"]:
            best[key] = r
    lines += ["", "| shape | maxima | inductor, % of copy | best other first-stage width, % of "
              "copy | best Triton tiling, % of copy |", "|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        if r["form"].startswith("inductor ("):
            part = best.get((r["shape"], r["kind"], "partials"))
            tri = best.get((r["shape"], r["kind"], "triton"))
            width = part["form"].removeprefix("inductor ") if part else ""
            part_cell = f"{part['frac_of_copy']:.0%} ({width})" if part else "—"
            tri_cell = f"{tri['frac_of_copy']:.0%}" if tri else "—"
            lines.append(f"| {r['shape']} | {r['kind']} | {r['frac_of_copy']:.0%} | {part_cell} | "
                         f"{tri_cell} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    args = probe_parser(__doc__).parse_args()
    require_cuda("maxima_ceiling_probe")
    bw = copy_bandwidth()
    records, copies = [], {}
    for m, k in SHAPES:
        records += shape_records(m, k, bw, copies)
    write_probe("maxima_ceiling_probe", args, records, table(records, bw))


if __name__ == "__main__":
    main()
