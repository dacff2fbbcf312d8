"""OCC's clamp bounds without a sort: the radix-select kernel against the sort it replaces.

    PYTHONPATH=src python benchmarks/quantile_select.py [--tiles 'BITS,CHUNK,WARPS;...']
        [--sizes N,N,...] [--dtype float32|bfloat16] [--out-dir DIR] [--tag NAME]

CUDA only. For each size (a threshold sample holds ~65536 entries; larger sizes find where the
select stops paying) the [1-alpha, alpha] quantiles of a
heavy-tailed float32 vector, alpha = 0.99, by:
- "sort (compiled)": `quantize.tensor_quantiles` under torch.compile, what a compiled OCC
  layer ran before (CUB's sort, a count, an index kernel);
- "select B,C,W": kernels/quantiles_triton.py's kernels with digit BITS B, CHUNK C, W warps,
  then `quantize.interpolate`, eagerly, launched as compiled kernels after the first call;
  "select B,C,W (JIT)" the same kernels with every launch through Triton's JIT, as before
  session 71 (whose kernels were also specialised on the entry count and alignment);
- "op": the Library op (`torch.ops.minifloat.order_statistics`, what a compiled step's code
  calls) and the eager interpolation;
- "clip_bounds (compiled)": kernels/quantiles.py's entry point under torch.compile (the path
  a compiled layer takes: the select's Library op, or a `triton_op` in session 67's first
  results), with the default configuration;
- "clip_bounds (eager)": the same entry point eagerly (the Library op and the interpolation's
  eager ops): its host time is what the op costs the host in a compiled step, plus the
  interpolation's (a 1.3B fp4 step's profile put the op at 356 us a call in session 68,
  111 in session 71).
Each is timed by the profiler's kernel time per call (and launches), by CUDA events, by
the host's time to enqueue one call from an idle GPU (`common.host_ms`) and by the host's time
a call in a loop of 100 calls (`common.loop_host_ms`, the steady state); every
result is checked equal to the sort's, bit for bit up to the sign of a zero quantile, on four
kinds of data (heavy-tailed, many ties, bf16 values, non-finite entries mixed in), held in
`--dtype` (bfloat16: the select's 16-bit keys, half the passes; session 74).
Results: benchmarks/results/quantile_select[_<tag>]_<gpu>_<date>.{md,json}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    host_ms,
    kernel_profile,
    loop_host_ms,
    parse_tiles,
    probe_parser,
    require_cuda,
    time_ms,
    write_probe,
)
from minifloat.kernels.quantiles import _q_bits, clip_bounds  # noqa: E402
from minifloat.quantize import interpolate, tensor_quantiles  # noqa: E402

ALPHA = 0.99
SIZES = "4096,16384,65536,262144,1048576,4194304"
TILES = "8,2048,4;8,1024,4;8,4096,8;8,2048,8;4,2048,4;8,512,4;8,4096,4"


def inputs(n: int, device: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The data kinds checked at size n (seeded), in `dtype` on `device`."""
    g = torch.Generator(device="cpu").manual_seed(n)
    heavy = torch.distributions.StudentT(3.0).sample((n,)) * 0.5
    heavy[torch.randint(0, n, (max(1, n // 500),), generator=g)] *= 40.0
    nonfinite = heavy.clone()
    idx = torch.randperm(n, generator=g)[: max(3, n // 1000)]
    nonfinite[idx[0::3]] = float("inf")
    nonfinite[idx[1::3]] = float("-inf")
    nonfinite[idx[2::3]] = float("nan")
    kinds = {
        "heavy": heavy,
        "ties": (heavy * 2).round() / 2,
        "bf16": heavy.bfloat16().float(),
        "nonfinite": nonfinite,
    }
    return {k: v.to(device, dtype) for k, v in kinds.items()}


def same_up_to_zero_sign(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a zero may have either sign and a NaN any payload."""
    loose = (a.isnan() & b.isnan()) | ((a == 0) & (b == 0))
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | loose).all())


def main() -> None:
    """Every variant at every size: equality with the sort, kernel and event times."""
    ap = probe_parser(__doc__, TILES, "select configurations BITS,CHUNK,WARPS")
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    require_cuda("quantile_select.py")
    from minifloat.kernels.quantiles_triton import order_statistics

    q_bits = (_q_bits(1.0 - ALPHA), _q_bits(ALPHA))
    sort_c = torch.compile(lambda f: torch.stack(tensor_quantiles(f, ALPHA)), dynamic=False)
    bounds_c = torch.compile(lambda f: clip_bounds(f, ALPHA), dynamic=False)

    def select(f: torch.Tensor, cfg: tuple[int, ...], cached: bool = True) -> torch.Tensor:
        s = order_statistics(f, *q_bits, config=cfg, cached=cached)
        return interpolate(s[:, 0], s[:, 1], s[:, 2])

    def op(f: torch.Tensor) -> torch.Tensor:
        s = torch.ops.minifloat.order_statistics.default(f, *q_bits)
        return interpolate(s[:, 0], s[:, 1], s[:, 2])

    records, lines = [], []
    for n in (int(v) for v in args.sizes.split(",")):
        data = inputs(n, "cuda", getattr(torch, args.dtype))
        variants = {
            "sort (compiled)": sort_c,
            "clip_bounds (compiled)": bounds_c,
            "clip_bounds (eager)": lambda f: clip_bounds(f, ALPHA),
            "op": op,
        }
        for cfg in parse_tiles(args.tiles):
            name = "select " + ",".join(map(str, cfg))
            variants[name] = lambda f, cfg=cfg: select(f, cfg)
            variants[name + " (JIT)"] = lambda f, cfg=cfg: select(f, cfg, cached=False)
        for name, fn in variants.items():
            equal = all(same_up_to_zero_sign(fn(x), sort_c(x)) for x in data.values())
            x = data["heavy"]
            prof = kernel_profile(lambda fn=fn, x=x: fn(x), reps=20)
            ms = time_ms(lambda fn=fn, x=x: fn(x), reps=20)
            host = host_ms(lambda fn=fn, x=x: fn(x), reps=20)
            loop = loop_host_ms(lambda fn=fn, x=x: fn(x))
            rec = {
                "n": n,
                "dtype": args.dtype,
                "variant": name,
                "equal": equal,
                "event_ms": ms,
                "host_ms": host,
                "loop_host_ms": loop,
                **prof,
            }
            records.append(rec)
            lines.append(
                f"| {n:,} | {name} | {equal} | {1000 * (prof['kernel_ms'] or 0):.1f} "
                f"| {prof['kernels']:.0f} | {1000 * ms:.1f} | {1000 * host:.1f} "
                f"| {1000 * loop:.1f} |"
            )
            print(lines[-1], flush=True)
    body = (
        f"alpha = {ALPHA}, entries in {args.dtype}; kernel us: the profiler's kernel time per "
        "call; launches per call; "
        "event us: CUDA events around one call after an L2 flush (host launch cost included); "
        "host us: the host's time to enqueue one call from an idle GPU; loop us: the host's time "
        "a call in a loop of 100 calls.\n\n"
        "| n | variant | equal to sort | kernel us | launches | event us | host us | loop us |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    write_probe("quantile_select", args, records, body)


if __name__ == "__main__":
    main()
