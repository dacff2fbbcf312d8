"""Would one pass over a gradient make both of fp8-rowwise's backward maxima? A Triton kernel of
this probe's own that reads dy once and writes its row maxima (dgrad's scales, one a token) and
its column maxima (wgrad's, one a channel), timed against the library's two reductions under
torch.compile (`kernels/operand.row_amax` and `_column_amax`, what training runs today).

    PYTHONPATH=src python benchmarks/dual_amax_probe.py [--shapes 16384x2048,16384x5632]
        [--tiles '32,128,4;64,128,8']

Why (session 64): in session 63's 6-layer 1.3B profile (`train_e2e_1.3B_ours_s63_blockprof_l6_...`)
fp8-rowwise ran ~1.9 ms a step of kernels that do nothing but maxima (of every operand); its
backward quantizes each linear's dy twice, by rows for dgrad and by columns for wgrad, and
each quantizer reads dy for its maxima. Inductor cannot fuse two reductions along different
axes of one tensor into one read; a 2-D tile can reduce both ways at once. The maxima are
integer maxima of the magnitude bits (`operand.magnitude_bits`), which are exact and
order-independent: the kernel must give the same bits, and is checked on random and on
adversarial inputs (±inf, NaN, zeros) before it is timed.

Two forms of the kernel. Rows: each program reads BLOCK_R whole rows in BLOCK_C-wide chunks,
keeps its rows' maxima in registers and stores each chunk's column maxima as a partial
([R / BLOCK_R, C]). Tile (a fourth tile number 1): one BLOCK_R x BLOCK_C tile a program, a 2-D
grid, both maxima stored as partials. The partials' maximum (a small torch.amax, compiled)
finishes them. Session 64's first run (`dual_amax_probe_s64_...`, rows form only): 0.046-0.162
against inductor's 0.048-0.170 ms, mixed (0.067 against 0.048 at 16384 x 2048), ~1 TB/s: 512
programs each walking its rows chunk by chunk. The tile form (`dual_amax_probe_s64_tile_...`,
128 x 64 tiles) took 0.034-0.064 ms against 0.048-0.170. Built into fp8-rowwise's backward
(commit df459ce), it made the 1.3B step 3.1 ms slower on both GPUs of an A/B
(`train_interleaved_1.3B_ours_s64_dual_*`) and was reverted: docs/hopper_sessions.md, session
64. Reported per shape and tile: the GPU kernel time of each side (profiler, all kernels of a
call) and their bandwidth at dy's bytes. `--device cpu` runs the reference and, with
TRITON_INTERPRET=1, the kernel on a small shape (a smoke test). Writes
`dual_amax_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    copy_bandwidth,
    kernel_profile,
    parse_tiles,
    probe_parser,
    same_bytes,
    write_probe,
)
from minifloat.kernels.operand import _column_amax, row_amax  # noqa: E402

TILES = "32,128,4;64,128,8;64,128,4,1;128,128,8,1;64,256,8,1;128,64,4,1"

try:  # CUDA machines have Triton; the CPU smoke run uses its interpreter when installed
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _dual_amax_kernel(
        x, colp, rowmax, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr
    ):
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        in_r = r < R
        acc = tl.zeros([BLOCK_R], dtype=tl.int32)  # the bits widen to int32 under the mask
        for j in range(CHUNKS):
            c = j * BLOCK_C + tl.arange(0, BLOCK_C)
            in_c = c < C
            m = in_r[:, None] & in_c[None, :]
            bits = tl.load(x + r[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0) & 0x7FFF
            acc = tl.maximum(acc, tl.max(bits, axis=1))
            tl.store(colp + pid * C + c, tl.max(bits, axis=0).to(tl.int16), mask=in_c)
        tl.store(rowmax + r, acc.to(tl.int16), mask=in_r)

    @triton.jit
    def _dual_amax_tile_kernel(x, colp, rowp, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # one BLOCK_R x BLOCK_C tile a program: its row maxima as partials [C / BLOCK_C, R],
        # its column maxima as partials [R / BLOCK_R, C]
        pr, pc = tl.program_id(0), tl.program_id(1)
        r = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        m = (r < R)[:, None] & (c < C)[None, :]
        bits = tl.load(x + r[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0) & 0x7FFF
        tl.store(rowp + pc * R + r, tl.max(bits, axis=1).to(tl.int16), mask=r < R)
        tl.store(colp + pr * C + c, tl.max(bits, axis=0).to(tl.int16), mask=c < C)


def reference(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, 1], [1, C]) float32 row and column maxima of |v|, as the library's quantizers."""
    return row_amax(v), _column_amax(v)


def _column_partials_max(colp: torch.Tensor) -> torch.Tensor:
    return colp.amax(dim=0, keepdim=True)


def dual_amax(v: torch.Tensor, tile: tuple[int, int, int], finish=_column_partials_max):
    """`reference(v)` for bf16 `v` [R, C] in one read: (row maxima [R, 1], column maxima [1, C])
    float32; `tile` is (BLOCK_R, BLOCK_C, num_warps[, 1 for the tile form]); `finish` reduces
    the partials."""
    if v.dtype != torch.bfloat16 or v.dim() != 2:
        raise ValueError(f"dual_amax takes a 2-D bfloat16 tensor, got {v.dtype} {tuple(v.shape)}")
    block_r, block_c, warps, *grid2d = tile
    r, c = v.shape
    if grid2d and grid2d[0]:  # the tile form: a 2-D grid, both maxima as partials
        rowp = torch.empty((triton.cdiv(c, block_c), r), dtype=torch.int16, device=v.device)
        colp = torch.empty((triton.cdiv(r, block_r), c), dtype=torch.int16, device=v.device)
        grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c))
        _dual_amax_tile_kernel[grid](v.contiguous().view(torch.int16), colp, rowp, r, c,
                                     BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)  # fmt: skip
        rows = finish(rowp).view(torch.bfloat16).float().reshape(r, 1)
        return rows, finish(colp).view(torch.bfloat16).float()
    programs = triton.cdiv(r, block_r)
    colp = torch.empty((programs, c), dtype=torch.int16, device=v.device)
    rowmax = torch.empty((r,), dtype=torch.int16, device=v.device)
    _dual_amax_kernel[(programs,)](
        v.contiguous().view(torch.int16), colp, rowmax, r, c,
        BLOCK_R=block_r, BLOCK_C=block_c, CHUNKS=triton.cdiv(c, block_c), num_warps=warps,
    )  # fmt: skip
    rows = rowmax.view(torch.bfloat16).float().reshape(r, 1)
    return rows, finish(colp).view(torch.bfloat16).float()


def inputs(r: int, c: int, device: str, adversarial: bool) -> torch.Tensor:
    """bf16 [r, c] gradient-like values; adversarial: with zero rows and columns, ±inf, a NaN."""
    gen = torch.Generator(device=device).manual_seed(r * 7 + c)
    v = torch.randn(r, c, device=device, generator=gen) * 1e-3
    if adversarial:
        v[1], v[:, 2] = 0.0, 0.0
        v[3, 5], v[6, 7], v[r - 1, c - 1] = float("inf"), float("-inf"), float("nan")
        v[r // 2, c // 3] = -3.0e38
    return v.to(torch.bfloat16)


def same_maxima(got, want) -> bool:
    """Both pairs equal bit for bit (a NaN's payload included: the maxima keep one bit pattern)."""
    return same_bytes(tuple(got), tuple(want))


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__, TILES, "';'-separated BLOCK_R,BLOCK_C,num_warps[,1: tile form]")
    ap.add_argument("--shapes", default="16384x2048,16384x5632,32768x768,16384x4096")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    tiles = parse_tiles(args.tiles)
    if args.device == "cpu":
        # Triton's kernels run on CPU tensors only in its interpreter
        interpreted = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
        for adversarial in (False, True):
            v = inputs(300, 520, "cpu", adversarial)
            want = reference(v)
            if interpreted:
                for tile in tiles:
                    assert same_maxima(dual_amax(v, tile), want), tile
        print("cpu smoke run:", "kernel checked" if interpreted else "reference only", flush=True)
        return
    if triton is None:
        raise SystemExit("dual_amax_probe needs Triton on CUDA")
    compiled_ref = torch.compile(reference, fullgraph=True)
    finish = torch.compile(_column_partials_max)
    copy = copy_bandwidth()
    records = []
    for shape in args.shapes.split(","):
        r, c = (int(n) for n in shape.split("x"))
        for adversarial in (True, False):  # checked on both, timed on the random one
            v = inputs(r, c, "cuda", adversarial)
            want = compiled_ref(v)
            if not same_maxima(want, reference(v)):
                raise SystemExit(f"{shape}: compiled and eager reference maxima differ")
            bad = [t for t in tiles if not same_maxima(dual_amax(v, t, finish), want)]
            if bad:
                raise SystemExit(f"{shape}: tiles {bad} give other maxima")
        forms = {"inductor (two reductions)": lambda v=v: compiled_ref(v)}
        forms |= {f"one pass {t}": (lambda v=v, t=t: dual_amax(v, t, finish)) for t in tiles}
        for name, fn in forms.items():
            prof = kernel_profile(fn, reps=20, top=4)
            gbs = 2 * r * c / (prof["kernel_ms"] * 1e-3) / 1e9
            rec = {"shape": [r, c], "form": name, "kernel_ms": prof["kernel_ms"],
                   "kernels": prof["kernels"], "gb_s_at_dy_bytes": gbs, "of_copy": gbs / copy,
                   "top_kernels": prof["top_kernels"]}  # fmt: skip
            records.append(rec)
            print(shape, name, f"{prof['kernel_ms']:.4f} ms", flush=True)
    lines = [f"Copy bandwidth {copy:.0f} GB/s. Kernel ms a call (profiler, every kernel of the "
             "call), bandwidth at dy's bytes (2 an element, read once). Maxima bit-equal to "
             "the compiled reference on random and adversarial inputs for every tile.", "",
             "| shape | form | kernel ms | kernels | GB/s at dy's bytes | of copy |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for rec in records:
        lines.append(f"| {rec['shape'][0]}x{rec['shape'][1]} | {rec['form']} | "
                     f"{rec['kernel_ms']:.4f} | {rec['kernels']:.0f} | "
                     f"{rec['gb_s_at_dy_bytes']:.0f} | {rec['of_copy']:.0%} |")  # fmt: skip
    write_probe("dual_amax_probe", args, records, "\n".join(lines))


if __name__ == "__main__":
    main()
