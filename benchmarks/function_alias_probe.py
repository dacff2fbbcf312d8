"""Each autograd Function of ours, compiled against eager, with float32 and bf16 inputs.

Why: torch 2.11's dynamo returns every intermediate of a Function's forward from the traced
forward. Where the Function's float32 output was the last intermediate itself (a `.to` of the
same dtype returns its input), AOTAutograd handed the backward zeros for the upstream gradient:
RoPE's and SwiGLU's compiled float32 gradients were all zeros on the GPU (session 80). Each row
says whether a compiled gradient is all zeros and its relative error against eager.

    PYTHONPATH=src python benchmarks/function_alias_probe.py [--device cuda] [--no-linear]
        [--out-dir DIR]

Writes DIR/function_alias_probe_<device>.json (with --out-dir; on the device, $OUT).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from torch import nn

import minifloat
from minifloat.models.rope import apply_rope, rope_cos_sin
from minifloat.models.swiglu import swiglu

RECIPES = ("fp8-tensorwise", "fp8-rowwise", "fp4-dge", "fp4")


def compare(fn, *inputs: torch.Tensor) -> dict | str:
    """fn eager and compiled on copies of inputs, one upstream gradient: the compiled
    gradients' zero flags and relative errors, and the output's relative error."""
    torch._dynamo.reset()
    try:
        runs = []
        for f in (fn, torch.compile(fn)):
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            y = f(*leaves)
            gen = torch.Generator().manual_seed(1)
            y.backward(torch.randn(y.shape, generator=gen).to(y.device, y.dtype))
            runs.append((y.detach(), [leaf.grad for leaf in leaves]))
    except Exception as e:  # a row's failure is its result
        return repr(e)[:400]
    (y0, g0), (y1, g1) = runs
    return {
        "zero_grads": [bool((b == 0).all()) for b in g1],
        "rel_err": [
            float((a - b).norm() / a.norm().clamp_min(1e-30)) for a, b in zip(g0, g1, strict=True)
        ],
        "out_rel_err": float((y0 - y1).norm() / y0.norm()),
    }


def rows(device: str, linear: bool):
    """(name, fn, inputs) for each probe."""
    gen = torch.Generator().manual_seed(0)
    cos, sin = (t.to(device) for t in rope_cos_sin(33, 64, 10000.0))
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        x = torch.randn(2, 3, 33, 64, generator=gen).to(device, dtype)
        yield f"rope_{name}", lambda x: apply_rope(x, cos, sin), (x,)
        g, u = (torch.randn(2, 64, 256, generator=gen).to(device, dtype) for _ in range(2))
        yield f"swiglu_{name}", swiglu, (g, u)
    for recipe in RECIPES if linear else ():
        torch.manual_seed(0)
        layer = minifloat.convert(nn.Sequential(nn.Linear(256, 512)), recipe).to(device)
        x = torch.randn(128, 256, generator=gen).to(device)
        yield f"linear_{recipe}_float32", layer, (x,)

        def autocast(x, layer=layer):
            with torch.autocast(device, torch.bfloat16):
                return layer(x)  # bf16: the upstream gradient is bf16, as in training

        yield f"linear_{recipe}_bf16_autocast", autocast, (x,)


def main(argv: list[str] | None = None) -> dict:
    """Every row's result, printed as it comes; also written as JSON with --out-dir."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-linear", action="store_true", help="RoPE and SwiGLU only")
    parser.add_argument("--out-dir", type=pathlib.Path, help="where the JSON goes")
    args = parser.parse_args(argv)
    results = {"torch": torch.__version__, "device": args.device}
    for name, fn, inputs in rows(args.device, not args.no_linear):
        results[name] = compare(fn, *inputs)
        print(name, results[name], flush=True)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"function_alias_probe_{args.device}.json"
        path.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
