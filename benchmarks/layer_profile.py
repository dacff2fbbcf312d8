"""One compiled QuantLinear fwd+bwd under the profiler: its kernels, and the inductor source of the
slowest ones (to see what the compiler made of the quantizers).

    PYTHONPATH=src python benchmarks/layer_profile.py --recipe fp8-rowwise --k 5632 --n 2048 \
        [--m 16384] [--dump DIR] [--top 3]

Prints every GPU kernel of one step with its time, and copies the generated Triton source of the
`--top` slowest non-GEMM kernels into `--dump` (found by kernel name in inductor's cache).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dump_kernel_sources, step_fn, time_ms  # noqa: E402
from minifloat.linear import QuantLinear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="fp8-rowwise")
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    if args.recipe == "bf16":
        layer: nn.Module = nn.Linear(args.k, args.n, bias=False, device="cuda")
    else:
        layer = QuantLinear(args.k, args.n, bias=False, recipe=args.recipe, device="cuda")
    step_mod = torch.compile(layer)
    x = torch.randn(args.m, args.k, device="cuda").bfloat16().requires_grad_(True)
    dy = torch.randn(args.m, args.n, device="cuda").bfloat16()
    step = step_fn(step_mod, x, dy)  # fresh gradients, as a training step has
    ms = time_ms(step)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            totals[ev.name] += ev.device_time_total / 1000.0
    print(f"{args.recipe} M={args.m} K={args.k} N={args.n}: step {ms:.3f} ms, kernels "
          f"{sum(totals.values()):.3f} ms")  # fmt: skip
    ranked = sorted(totals, key=totals.get, reverse=True)
    for name in ranked:
        print(f"  {totals[name]:8.3f} ms  {name[:150]}")
    if args.dump:
        dump_kernel_sources(ranked, Path(args.dump), args.recipe, args.top)


if __name__ == "__main__":
    main()
