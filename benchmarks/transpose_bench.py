"""Transposed copies of FP8 GEMM operands: the opaque tiled kernel against the alternatives.

    PYTHONPATH=src python benchmarks/transpose_bench.py [--out-dir DIR] [--tag NAME]

Two tables, CUDA only:
1. A transposed copy on its own, at the 1.3B / 7B operand shapes, 1- and 2-byte elements: ATen's
   `x.t().contiguous()`, inductor's kernel for the same (compiled alone), and the Triton kernel of
   kernels/transpose_triton.py with each candidate tile; GB/s = bytes read + written over the
   median CUDA-event time, against a measured device-to-device copy.
2. The case that motivated it: a SwiGLU backward (gate and up gradients of a [16384, 5504] MLP)
   whose two gradients are quantized tensor-wise to E4M3 for dgrad (row-major) and wgrad
   (transposed), compiled as one function: the transposed copies left to inductor (fused into
   the SwiGLU kernel) against `transpose_copy` (opaque, after it). Both are checked equal.
Results: benchmarks/results/transpose_<gpu>_<date>[_<tag>].{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, raw_bits, same_bits, time_ms, write_results  # noqa: E402
from minifloat.kernels.operand import quantize_operand  # noqa: E402
from minifloat.kernels.transpose import transpose_copy  # noqa: E402

SHAPES = ((16384, 2048), (16384, 5504), (2048, 5504), (16384, 4096), (16384, 11008))
TILE_CANDIDATES = ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 4), (128, 128, 8),
                   (256, 128, 8))  # fmt: skip


def _gbps(nbytes: int, ms: float) -> float:
    return 2 * nbytes / ms / 1e6


def copy_table(bw: float) -> list[dict]:
    """Every transposed-copy variant at every shape and element size."""
    from minifloat.kernels.transpose_triton import transpose_2d

    inductor = torch.compile(lambda t: t.t().contiguous(), fullgraph=True)
    records = []
    for rows, cols in SHAPES:
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            x = torch.randn(rows, cols, device="cuda").to(dtype)
            want = raw_bits(x.t().contiguous())
            variants = {"aten": lambda x=x: x.t().contiguous(), "inductor": lambda x=x: inductor(x)}
            for tile in TILE_CANDIDATES:
                name = f"triton {tile[0]}x{tile[1]} w{tile[2]}"
                variants[name] = lambda x=x, tile=tile: transpose_2d(x, tile)
            for name, fn in variants.items():
                equal = torch.equal(raw_bits(fn()), want)
                ms = time_ms(fn)
                gbps = _gbps(x.numel() * x.element_size(), ms)
                records.append(
                    dict(kind="copy", shape=[rows, cols], dtype=str(dtype), variant=name, ms=ms,
                         gbps=gbps, of_copy_bw=gbps / bw, equal=equal)
                )  # fmt: skip
                print(f"{rows}x{cols} {dtype} {name}: {ms:.4f} ms {gbps:.0f} GB/s "
                      f"({gbps / bw:.0%} of copy) equal={equal}", flush=True)  # fmt: skip
    return records


def _swiglu_backward(g, u, dh, opaque: bool):
    """dgate, dup of h = silu(g) * u, each quantized to E4M3 (tensor scale) row-major and
    transposed, as QuantLinear's backward asks for them (dgrad and wgrad operands)."""
    gf, uf, dhf = g.float(), u.float(), dh.float()
    sig = torch.sigmoid(gf)
    dgate = (dhf * uf * sig * (1 + gf * (1 - sig))).to(torch.bfloat16)
    dup = (dhf * gf * sig).to(torch.bfloat16)
    out = []
    for grad in (dgate, dup):
        values, scale = quantize_operand(grad, "e4m3", "tensor")
        values_t = transpose_copy(values) if opaque else values.t().contiguous()
        out += [values, values_t, scale]
    return out


def swiglu_table() -> list[dict]:
    m, f = 16384, 5504
    g, u, dh = (torch.randn(m, f, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fused = torch.compile(lambda *a: _swiglu_backward(*a, opaque=False), fullgraph=True)
    opaque = torch.compile(lambda *a: _swiglu_backward(*a, opaque=True), fullgraph=True)
    want = fused(g, u, dh)
    got = opaque(g, u, dh)
    equal = same_bits(want, got)
    records = []
    for name, fn in (("fused by inductor", fused), ("transpose_copy", opaque)):
        ms = time_ms(lambda fn=fn: fn(g, u, dh))
        records.append(dict(kind="swiglu", shape=[m, f], variant=name, ms=ms, equal=equal))
        print(f"swiglu backward + E4M3 both layouts, {name}: {ms:.4f} ms equal={equal}")
    return records


def markdown(records: list[dict], bw: float) -> str:
    lines = [
        f"Device-to-device copy: {bw:.0f} GB/s. Median CUDA-event time, L2 flushed.",
        "",
        "| shape | dtype | variant | ms | GB/s | of copy | equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["kind"] == "copy":
            lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype'].split('.')[-1]} | "
                         f"{r['variant']} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                         f"{r['of_copy_bw']:.0%} | {r['equal']} |")  # fmt: skip
    lines += ["", "SwiGLU backward, both gradients quantized to E4M3 in both layouts (compiled):",
              "", "| variant | ms | equal |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {r['variant']} | {r['ms']:.4f} | {r['equal']} |" for r in records
              if r["kind"] == "swiglu"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--date", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("transpose_bench.py needs a CUDA GPU")
    bw = copy_bandwidth()
    records = copy_table(bw) + swiglu_table()
    for r in records:
        r["copy_gbps"] = bw
    name = "transpose" + (f"_{args.tag}" if args.tag else "")
    kwargs = {"out_dir": Path(args.out_dir)} if args.out_dir else {}
    md, _ = write_results(name, records, markdown(records, bw), day=args.date, **kwargs)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
