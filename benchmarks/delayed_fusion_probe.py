"""Does a delayed scale let inductor cast an operand in the pass that produces it? (issue 13)

    PYTHONPATH=src python benchmarks/delayed_fusion_probe.py [--out-dir DIR] [--date D]

With a current (this step's) tensor scale every operand is read twice: its amax must be known
before its first value is cast (docs/hopper_sessions.md, session 9: the floor that keeps
fp8-tensorwise from 1.30x at 1.3B). With a scale from past steps the cast does not wait for the
amax, so the amax (for the history) and the cast could share one read, in the kernel that
produces the operand. fp8-delayed does not get that today: its scale falls back to the current
amax while the history is empty (`delayed.history_scale`), a `torch.where` that makes every
cast depend on the current amax in the graph.

This times, compiled, three producers at 1.3B sizes (the RMSNorm before q/k/v, the SwiGLU
forward's h, a plain bf16 gradient) followed by an E4M3 / E5M2 tensor-scaled cast, as:
- `current`: `quantize_operand` with the current amax (fp8-tensorwise);
- `delayed_now`: fp8-delayed as shipped (history scale, current amax when the history is empty);
- `delayed`: the history scale only (Transformer Engine's: scale 1 while the history is empty),
  the amax computed for the history beside the cast;
- `delayed_rows`: the same with the amax as row maxima of 256-column chunks, then their maximum
  (a reduction whose first stage has the cast's shape);
each against the producer alone writing bf16 (what bf16 training does; the gradient has no
producer here, so no bf16 row). GPU kernel time, launches
and the bytes of the ideal single pass over that time. Writes
`delayed_fusion_probe_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import RESULTS_DIR, copy_bandwidth, kernel_profile, write_results  # noqa: E402
from minifloat import delayed, formats  # noqa: E402
from minifloat.exact import div_rn_by_scale  # noqa: E402
from minifloat.kernels.operand import (  # noqa: E402
    quantize_operand,
    round_to_storage,
    row_amax,
    scale_from_amax,
)
from minifloat.recipes import DelayedScaling  # noqa: E402

VARIANTS = ("bf16", "current", "delayed_now", "delayed", "delayed_rows")
_CFG = DelayedScaling()


def _produce(kind: str, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The operand before quantization, bf16: RMSNorm(a) * w, silu(a) * b, or a itself."""
    if kind == "rmsnorm":
        af = a.float()
        return (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + 1e-5)).to(a.dtype) * w
    if kind == "swiglu":
        return F.silu(a) * b
    return a


def step(kind: str, variant: str, fmt: str, a, b, w, history):
    """One producer and its cast: (bf16 or FP8 values, and the amax for the history if any)."""
    y = _produce(kind, a, b, w)
    if variant == "bf16":
        return (y,)
    if variant == "current":
        return quantize_operand(y, fmt, "tensor")
    if variant == "delayed_now":
        amax = delayed.amax(y)
        s = delayed.history_scale(history, delayed.INPUT, amax, fmt, _CFG)
        return quantize_operand(y, fmt, "tensor", scale=s)[0], amax
    amax = row_amax(y).amax() if variant == "delayed_rows" else y.abs().amax()
    past = torch.where(history[0] < torch.inf, history[0], 0.0).amax()
    s = scale_from_amax(past.reshape(1, 1), formats.get(fmt).max)
    return round_to_storage(div_rn_by_scale(y.float(), s), fmt), amax.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    args = ap.parse_args()
    copy_gbs = copy_bandwidth()
    history = torch.rand(3, 16, device="cuda") + 1.0
    cases = [("rmsnorm", 16384, 2048, "e4m3"), ("swiglu", 16384, 5632, "e4m3"),
             ("grad", 16384, 5632, "e5m2")]  # fmt: skip
    records, lines = [], []
    for kind, m, n, fmt in cases:
        a, b = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        reads = 2 if kind == "swiglu" else 1
        for variant in VARIANTS if kind != "grad" else VARIANTS[1:]:  # bf16: no kernel
            torch._dynamo.reset()
            call = functools.partial(torch.compile(step), kind, variant, fmt, a, b, w, history)
            out = call()
            prof = kernel_profile(call, reps=10, top=6)
            moved = m * n * (2 * reads + (2 if variant == "bf16" else 1))  # one pass
            rec = dict(kind=kind, shape=[m, n], fmt=fmt, variant=variant,
                       kernel_us=prof["kernel_ms"] * 1e3, kernels=prof["kernels"],
                       pct_of_copy=100 * moved / (prof["kernel_ms"] * 1e-3) / 1e9 / copy_gbs,
                       top_kernels=prof["top_kernels"])  # fmt: skip
            if variant.startswith("delayed"):
                want = y_abs_max(kind, a, b, w)
                rec["amax_exact"] = bool(torch.equal(out[1].float().reshape(()), want))
            records.append(rec)
            print(kind, variant, f"{rec['kernel_us']:.1f} us", rec["kernels"], flush=True)
            lines.append(
                f"| {kind} {m}x{n} {fmt} | {variant} | {rec['kernel_us']:.1f} | "
                f"{rec['kernels']:.0f} | {rec['pct_of_copy']:.0f}% | "
                f"{rec.get('amax_exact', '—')} |"
            )
    body = (
        f"`{' '.join(sys.argv)}`\n\nCopy bandwidth {copy_gbs:.0f} GB/s. GPU kernel time per "
        "call (profiler), launches, and the bytes of one ideal pass (inputs read once, the "
        "output written once) over that time as a share of copy; for the delayed variants, "
        "whether the amax recorded for the history equals the eager one.\n\n"
        "| producer | variant | kernel us | kernels | one pass vs copy | amax exact |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    md, _ = write_results(
        "delayed_fusion_probe", records, body, out_dir=Path(args.out_dir), day=args.date
    )
    print(md)


def y_abs_max(kind: str, a, b, w) -> torch.Tensor:
    """The eager amax of the producer's output (float32, 0-dim)."""
    return _produce(kind, a, b, w).abs().amax().float()


if __name__ == "__main__":
    main()
