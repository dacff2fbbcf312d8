"""Per-bucket cost of the fp8 gradient all-reduce's elementwise passes, without the collectives.

    python benchmarks/grad_comm_codec.py                     # CUDA, one GPU: eager vs compiled
    python benchmarks/grad_comm_codec.py --device cpu --numel 100000 --modes eager --repeats 3

For one DDP bucket (default 6,553,600 elements: DDP's default 25 MiB bucket of fp32 gradients)
and a simulated world of --world ranks, it runs the passes of `distributed._mean_fp8`
(minifloat.grad_comm_fp8: bucket_amax, encode, reduce_chunks_into, decode_into) on inputs of the
shapes and bytes the collectives would hand them (this rank's own payload stands in for what
the all-to-all and all-gather bring). Modes: `eager` (one kernel per op: the unfused hook ran
like this) and `compiled` (the compiled twins the hook uses on CUDA). Per pass and in total:
CUDA kernels launched per call (profiler), GPU kernel ms, event-timed ms (L2 flushed), and the
bandwidth over the pass's minimum memory traffic (every input read once, every output written
once). On CPU only wall ms (median) and that bandwidth.

The >= 93 % weak-scaling target of DDP fp8 at 1.3B is measured end to end by
benchmarks/distributed.py on 2 GPUs; this script isolates what the fusion changed.

Writes benchmarks/results/grad_comm_codec_<gpu>_<date>.md and .json (--out to change the folder).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minifloat import grad_comm_fp8 as fp8c

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import kernel_ms, time_ms, write_results  # noqa: E402

PASSES = ("bucket_amax", "encode", "reduce_chunks_into", "decode_into")


def bucket_calls(numel: int, world: int, fmt: str, dtype: torch.dtype, device: str) -> dict:
    """pass name -> (call, minimum bytes moved), for one bucket on one rank."""
    chunk = math.ceil(numel / world)
    gen = torch.Generator(device=device).manual_seed(0)
    flat = torch.randn(numel, generator=gen, device=device).to(dtype)
    amax = fp8c.bucket_amax(flat, world)
    payload = fp8c.encode(flat, amax, world, fmt, chunk * world)
    received = payload.view(world, chunk)
    send = payload.new_empty(chunk + fp8c.SCALE_BYTES)
    chunk_scale = fp8c.reduce_chunks_into(send, received, amax, fmt)
    send[chunk:] = chunk_scale.view(torch.uint8)
    gathered = send.repeat(world).view(world, -1)
    scales = gathered[:, chunk:].contiguous().view(torch.float32)
    out = torch.empty_like(flat)
    grads = numel * flat.element_size()  # bytes of the bucket
    padded = world * chunk
    return {
        "bucket_amax": (lambda f: f(flat, world), grads),
        "encode": (lambda f: f(flat, amax, world, fmt, padded), grads + padded),
        "reduce_chunks_into": (lambda f: f(send, received, amax, fmt), padded + chunk),
        "decode_into": (lambda f: f(out, gathered, scales, fmt), gathered.numel() + grads),
    }


def kernel_count(fn: Callable[[], object]) -> int:
    """CUDA kernels one call of `fn` launches (after a warm-up call)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(args: argparse.Namespace, mode: str, dtype: torch.dtype) -> list[dict]:
    """One record per pass (and one for the whole bucket) in `mode`."""
    calls = bucket_calls(args.numel, args.world, args.fmt, dtype, args.device)
    records = []
    for name in PASSES:
        fn = getattr(fp8c, name)
        fn = fp8c.twin(fn) if mode == "compiled" else fn
        call, nbytes = calls[name]
        run = lambda call=call, fn=fn: call(fn)  # noqa: E731
        rec = {"mode": mode, "dtype": str(dtype).removeprefix("torch."), "pass": name}
        rec.update(numel=args.numel, world=args.world, fmt=args.fmt, min_bytes=nbytes)
        if args.device == "cuda":
            rec["kernels"] = kernel_count(run)
            rec["kernel_ms"] = kernel_ms(run, reps=args.repeats)
            rec["ms"] = time_ms(run, reps=args.repeats)
        else:
            rec["ms"] = cpu_ms(run, args.repeats)
        records.append(rec)
    total = {k: records[0][k] for k in ("mode", "dtype", "numel", "world", "fmt")}
    total["pass"] = "bucket total"
    for key in ("min_bytes", "kernels", "kernel_ms", "ms"):
        if key in records[0]:
            total[key] = sum(r[key] for r in records if r[key] is not None)
    records.append(total)
    for rec in records:
        rec["gb_per_s"] = rec["min_bytes"] / rec["ms"] / 1e6
    return records


def table(records: list[dict]) -> str:
    lines = [
        "| mode | bucket dtype | pass | kernels | kernel ms | ms | min MB | GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        kms = r.get("kernel_ms")
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {r['pass']} | {r.get('kernels', '-')} | "
            f"{'-' if kms is None else f'{kms:.3f}'} | {r['ms']:.3f} | "
            f"{r['min_bytes'] / 1e6:.1f} | {r['gb_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=25 * 2**20 // 4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--fmt", choices=tuple(fp8c.FP8_DTYPES), default="e4m3")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="bucket (gradient) dtypes")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    records = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            records += measure(args, mode, getattr(torch, dtype))
    body = (
        f"One bucket of {args.numel:,} gradients, {args.world} simulated ranks, fp8 {args.fmt}; "
        "no collectives. kernels: CUDA kernels per call; min MB: each input read and each "
        "output written once; GB/s: min MB over ms.\n\n" + table(records)
    )
    kwargs = {} if args.out is None else {"out_dir": args.out}
    md, js = write_results("grad_comm_codec", records, body, **kwargs)
    print(table(records))
    print(f"wrote {md} and {js}")
    return records


if __name__ == "__main__":
    main()
