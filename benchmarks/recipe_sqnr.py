"""Layer-level accuracy of every recipe: SQNR (dB) of y, dx and dw against a float64 nn.Linear.

Inputs are the heavy-tailed tensors of `minifloat.sqnr` (Student-t activations with outlier
channels, weights with log-normal channel norms). Runs on CPU (the emulated backend computes the
same numbers as the GPU path). Stochastic rounding and Hadamard signs are one step's draws of a
fresh layer (salt 0, step 0). Writes benchmarks/results/recipe_sqnr_<date>.md and .json
(`--autocast`: the layer under bf16 autocast, as the trainers run it, y and dx then in bf16;
files recipe_sqnr_autocast_<date>.*). `--device cuda`: the layer on FP8 tensor cores (the Hopper
backend), whose GEMMs may accumulate differently from the emulation's fp32 sums (fast
accumulation: `fast_accum`, `bwd_fast_accum`); files recipe_sqnr_[autocast_]cuda_<date>.*.

    python benchmarks/recipe_sqnr.py [--m 1024 --k 1024 --n 1024] [--autocast] [--recipes fp4,...]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

import torch

from minifloat import recipes
from minifloat.linear import QuantLinear
from minifloat.sqnr import sqnr_db, synthetic_activation, synthetic_weight

# OCC's compensation: off (the released code's behaviour) and the dense fp32 reference (the
# paper's high-precision GEMM) beside the default E4M3 one; fp4-occ (no DGE) shows the wgrad
# compensation's effect on dw, and exact thresholds the cost of the strided sample.
VARIANTS = [
    "fp4:occ.compensate=off",
    "fp4:occ.compensation_format=fp32",
    "fp4-occ:occ.compensate=off",
    "fp4-occ:occ.compensation_format=fp32",
    "fp4-occ:occ.compensation_format=fp32:occ.threshold=exact",
    # The micro-block recipes' ablations (issue 16): without the Hadamard transform, without
    # stochastic rounding, MXFP4 with a 32-point transform.
    "nvfp4:rht=off",
    "nvfp4:sr=off",
    "nvfp4:rht=off:sr=off",
    "mxfp4:rht=on",
    "mxfp4:sr=off",
]


def measure(
    name: str,
    x: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
    autocast: bool = False,
    device: str = "cpu",
) -> dict:
    x, w, dy = x.to(device), w.to(device), dy.to(device)
    ref_x = x.double().requires_grad_()
    ref_w = w.double().requires_grad_()
    ref_y = ref_x @ ref_w.t()
    ref_y.backward(dy.double())
    backend = "emulated" if device == "cpu" else "auto"
    layer = QuantLinear(
        w.shape[1], w.shape[0], bias=False, recipe=name, backend=backend, device=device
    )
    with torch.no_grad():
        layer.weight.copy_(w)
    xq = x.clone().requires_grad_()
    amp = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        y = layer(xq)
    y.backward(dy.to(y.dtype))
    return {
        "recipe": name,
        "y_sqnr_db": sqnr_db(ref_y, y),
        "dx_sqnr_db": sqnr_db(ref_x.grad, xq.grad),
        "dw_sqnr_db": sqnr_db(ref_w.grad, layer.weight.grad),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--autocast", action="store_true", help="the layer under bf16 autocast")
    ap.add_argument("--recipes", default="", help="comma-separated (default: every recipe)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    x = synthetic_activation(args.m, args.k, seed=1)
    w = synthetic_weight(args.n, args.k, seed=2)
    dy = torch.randn(args.m, args.n, generator=torch.Generator().manual_seed(3))
    names = [n for n in recipes.names() if recipes.get(n).quantized] + VARIANTS
    if args.recipes:
        names = args.recipes.split(",")
    rows = [measure(n, x, w, dy, args.autocast, args.device) for n in names]
    date = datetime.date.today().isoformat()
    lines = [
        f"# Recipe accuracy (SQNR vs float64), {date}",
        "",
        "`" + " ".join(["python benchmarks/recipe_sqnr.py", *sys.argv[1:]]) + "`",
        "",
        (
            f"CPU, torch {torch.__version__}, emulated backend"
            if args.device == "cpu"
            else f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Hopper backend"
        )
        + f"; x [{args.m}, {args.k}] Student-t "
        f"(3 dof) with 4 outlier channels x20, w [{args.n}, {args.k}], dy Gaussian"
        + ("; the layer under bf16 autocast (y, dx in bf16)." if args.autocast else "."),
        "",
        "| recipe | y (dB) | dx (dB) | dw (dB) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['y_sqnr_db']:.1f} | {r['dx_sqnr_db']:.1f} | "
            f"{r['dw_sqnr_db']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = "" if args.device == "cpu" else f"{args.device}_"
    stem = f"recipe_sqnr_{'autocast_' if args.autocast else ''}{device}{date}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
