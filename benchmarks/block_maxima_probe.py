"""The block quantizers' maxima pass: which form reaches the copy's bandwidth? (GPU only)

Issue 13 asks every quantization pass for >= 80 % of copy bandwidth. fp8-blockwise's 128 x 1
quantizer (the transposed operands of wgrad: 1 x 128 blocks of xᵀ, i.e. 128-row column blocks
of x) reads x in its maxima pass at 72 % and 65 % of the copy at 16384 x 2048 and 32768 x 768
on an H200 (`kernels_s94_...`); on an H100 at 60 % and 69 %, there the only activation pass short
of a copy of its own bytes (65 %, 79 %; `kernels_s101_...`).
This times, at quantizer_bandwidth.py's shapes, for the 128 x 1 and 1 x 128 blocks of a bf16 x:

- `quantizer, float32 bits (HEAD)`: the whole compiled quantizer as `quantize_operand` runs it,
  its block maxima over x.float()'s magnitude bits (int32); each inductor pass alone
  (quantizer_bandwidth.py's `inductor_passes`), the maxima pass rated;
- `quantizer, bf16 bits`: the same with the maxima over x's own bits (int16,
  `own_bits_blocks`), as the tensor and row quantizers take theirs: the same maxima
  (bf16 -> float32 is exact and keeps the magnitudes' order), one conversion less an element in a
  kernel bound by its instructions (session 58);
- `maxima alone, ...`: the maxima of each form without the cast (profiler time, L2 flushed);
- `triton rows=R cols=C warps=W` (128 x 1 only): a Triton kernel that reads nothing but x, a
  program per 128-row band and C columns, R rows a load, for the read's ceiling at that shape.

Every form's maxima, and both quantizers' values and scales, equal HEAD's (eager
`quantize_operand`'s) bit for bit (checked).
Rated against a 256 MiB copy's bandwidth and a copy of the same bytes (quantizer_bandwidth.py's
`same_size_copy_us`).

Session 102, one H200 (`block_maxima_probe_s102_h200_2026-12-05.md`): the maxima over bf16 bits
take HEAD's time (the 128 x 1 quantizer's maxima pass within 0.2 us at four shapes and 3.8 us
slower at 32768 x 2048, the 1 x 128 one within 1.1 us either way; all 30 timings together 0.4 us
less), so they are not adopted. No Triton tiling beats inductor's kernel: at best 57 % and 54 %
of the copy at 16384 x 2048 and 32768 x 768 against inductor's 71 % and 64 % (79 % and 75 % of
a copy of their own bytes).

    PYTHONPATH=src python benchmarks/block_maxima_probe.py [--tag T] [--out-dir D]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import copy_bandwidth, probe_parser, require_cuda, same_bits, write_probe  # noqa: E402
from maxima_ceiling_probe import _bench, _record, _runs, form_lines  # noqa: E402
from minifloat import formats  # noqa: E402
from minifloat.kernels import operand  # noqa: E402
from quantizer_bandwidth import SHAPES, SMALL_PASS, inductor_passes  # noqa: E402

BLOCK = 128
# (rows a load, columns a program, warps)
TILES = [(8, 128, 4), (16, 128, 4), (32, 128, 4), (32, 64, 4), (16, 256, 4), (32, 256, 8),
         (64, 128, 8), (128, 64, 8), (8, 256, 4), (64, 64, 4)]  # fmt: skip


@functools.cache
def _kernel():
    """The Triton kernel (built on first use: Triton needs a GPU to run it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def band_max(x_ptr, out_ptr, m, k, BAND: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        acc = tl.zeros([COLS], dtype=tl.int32)
        for r0 in range(0, BAND, ROWS):
            rows = tl.program_id(0) * BAND + r0 + tl.arange(0, ROWS)
            mask = (rows[:, None] < m) & (cols[None, :] < k)
            v = tl.load(x_ptr + rows[:, None] * k + cols[None, :], mask=mask, other=0)
            acc = tl.maximum(acc, tl.max(v.to(tl.int32) & 0x7FFF, axis=0))
        tl.store(out_ptr + tl.program_id(0) * k + cols, acc.to(tl.int16), mask=cols < k)

    return band_max


def own_bits_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`operand._quantize_blocks(x.float(), "e4m3", block, inv=True)` with the maxima over x's
    own bits (R and C multiples of the block): the form probed here, not adopted (no faster,
    session 102)."""
    (r, c), (br, bc) = x.shape, block
    shape = (r // br, br, c // bc, bc)
    amax = operand.abs_amax(x.reshape(shape), dim=(1, 3))
    q, _, scale = operand.times_multiplier(
        x.float().reshape(shape), amax[:, None, :, None], formats.get("e4m3").max
    )
    return operand.round_to_storage(q.reshape(r, c), "e4m3", saturate=False), scale[:, 0, :, 0]


def quantizer(x: torch.Tensor, block: tuple[int, int], own_bits: bool, transpose: bool):
    """`quantize_operand(x, "e4m3", granularity, transpose=..., scale_format="inv")`'s values
    and scales for a 2-D block `block` in x's layout, the maxima over x's own bits
    (`own_bits_blocks`) or, as HEAD takes them, over x.float()'s."""
    if own_bits:
        values, s = own_bits_blocks(x, block)
    else:
        values, s = operand._quantize_blocks(x.float(), "e4m3", block, True)
    return (values.t(), s.t().contiguous()) if transpose else (values, s)


def block_maxima(x: torch.Tensor, block: tuple[int, int], own_bits: bool) -> torch.Tensor:
    """The float32 maxima [R / br, C / bc] that `quantizer` takes (R and C multiples)."""
    (r, c), (br, bc) = x.shape, block
    src = x if own_bits else x.float()
    return operand.abs_amax(src.reshape(r // br, br, c // bc, bc), dim=(1, 3))


def kind_records(x: torch.Tensor, kind: str, bw: float, copies: dict) -> list[dict]:
    """Every form of one block kind ("128x1" or "1x128") at x's shape."""
    shape, records = "x".join(map(str, x.shape)), []
    block, transpose = ((BLOCK, 1), True) if kind == "128x1" else ((1, BLOCK), False)
    head = operand.quantize_operand(x, "e4m3", (1, BLOCK), transpose=transpose,
                                    scale_format="inv")[:2]  # fmt: skip
    want = block_maxima(x, block, own_bits=False)
    for own, label in ((False, "float32 bits (HEAD)"), (True, "bf16 bits")):
        fn = functools.partial(quantizer, block=block, own_bits=own, transpose=transpose)
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True)(x)
        exact = same_bits(head, got)
        passes = inductor_passes(fn, x)
        total = sum(gb for _, _, gb in passes)
        for kernel, ms, gb in passes:
            if gb >= SMALL_PASS * total:
                records.append(_record(shape, kind, f"quantizer, {label}: {kernel[:40]}",
                                       ms * 1e3, gb * 1e9, bw, copies, exact))  # fmt: skip
        torch._dynamo.reset()
        amax = torch.compile(functools.partial(block_maxima, block=block, own_bits=own),
                             fullgraph=True)  # fmt: skip
        exact = torch.equal(amax(x), want)
        nbytes = 2 * x.numel() + 4 * want.numel()
        us = _bench(lambda: amax(x))  # noqa: B023
        form = f"maxima alone, {label}"
        records.append(_record(shape, kind, form, us, nbytes, bw, copies, exact))
    if kind == "128x1":
        records += _triton_records(x, want, bw, copies)
    return records


def _triton_records(x: torch.Tensor, want: torch.Tensor, bw: float, copies: dict) -> list[dict]:
    band_max, (m, k), shape = _kernel(), x.shape, "x".join(map(str, x.shape))
    out = torch.empty(m // BLOCK, k, dtype=torch.int16, device=x.device)
    bits, records = x.view(torch.int16), []
    for rows, cols, warps in TILES:
        grid = (m // BLOCK, -(-k // cols))

        def run(rows=rows, cols=cols, warps=warps, grid=grid) -> None:
            band_max[grid](bits, out, m, k, BAND=BLOCK, ROWS=rows, COLS=cols, num_warps=warps)

        form = f"triton rows={rows} cols={cols} warps={warps}"
        if _runs(run, form):
            exact = torch.equal(operand.from_magnitude_bits(out, torch.bfloat16), want)
            nbytes = 2 * x.numel() + 2 * out.numel()
            records.append(_record(shape, "128x1", form, _bench(run), nbytes, bw, copies, exact))
    return records


def table(records: list[dict], bw: float) -> str:
    return "\n".join(form_lines(records, bw, kind="blocks"))


def main() -> None:
    args = probe_parser(__doc__).parse_args()
    require_cuda("block_maxima_probe")
    bw = copy_bandwidth()
    records, copies = [], {}
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        for kind in ("128x1", "1x128"):
            records += kind_records(x, kind, bw, copies)
    write_probe("block_maxima_probe", args, records, table(records, bw))


if __name__ == "__main__":
    main()
