"""Our autograd Functions compiled against eager, with float32 and bf16 inputs.

Why: torch 2.11's dynamo traces a Function's forward into a body that returns every
intermediate, and where another traced node is the very tensor the forward returns (a no-op
`.to`, `.float()` or `.contiguous()` of the result), AOTAutograd hands the compiled backward
zeros for the upstream gradient (docs/hopper.md, "Two torch versions"). RoPE's and SwiGLU's
Functions did so in float32 (session 80); torch 2.13 returns only the outputs. Each row says
whether a compiled gradient is missing or all zeros, and its relative error against eager.
The linear rows compare the input's gradient only (zeros there would show in dw too).

    PYTHONPATH=src python benchmarks/function_alias_probe.py [--device cuda|cpu] [--no-linear]
        [--out-dir DIR] [--date D] [--tag T]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import minifloat  # noqa: E402
from common import probe_parser, write_probe  # noqa: E402
from minifloat.models.rope import apply_rope, rope_cos_sin  # noqa: E402
from minifloat.models.swiglu import swiglu  # noqa: E402

RECIPES = ("fp8-tensorwise", "fp8-rowwise", "fp4-dge", "fp4")


def compare(fn, *inputs: torch.Tensor) -> dict:
    """fn eager and compiled on copies of inputs, one upstream gradient: whether each compiled
    gradient is missing or all zeros, its relative error, and the output's (or the error)."""
    torch._dynamo.reset()
    try:
        runs = []
        for f in (fn, torch.compile(fn)):
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            y = f(*leaves)
            gen = torch.Generator().manual_seed(1)
            y.backward(torch.randn(y.shape, generator=gen).to(y.device, y.dtype))
            runs.append((y.detach(), [leaf.grad for leaf in leaves]))
        (y0, g0), (y1, g1) = runs
        return {
            "zero_grads": [b is None or bool((b == 0).all()) for b in g1],
            "rel_err": [
                1.0 if b is None else float((a - b).norm() / a.norm().clamp_min(1e-30))
                for a, b in zip(g0, g1, strict=True)
            ],
            "out_rel_err": float((y0 - y1).norm() / y0.norm()),
        }
    except Exception as e:  # a row's failure is its result
        return {"error": repr(e)[:400]}


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


def main(argv: list[str] | None = None) -> list[dict]:
    ap = probe_parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-linear", action="store_true", help="RoPE and SwiGLU only")
    args = ap.parse_args(argv)
    records, lines = [], ["| row | compiled gradients all zero | relative error | output's |",
                          "|---|---|---|---|"]  # fmt: skip
    for name, fn, inputs in rows(args.device, not args.no_linear):
        rec = {"row": name, "device": args.device, "torch": torch.__version__}
        rec.update(compare(fn, *inputs))
        records.append(rec)
        print(rec, flush=True)
        if "error" in rec:
            lines.append(f"| {name} | error: {rec['error'][:80]} | | |")
        else:
            errors = ", ".join(f"{e:.1e}" for e in rec["rel_err"])
            lines.append(f"| {name} | {rec['zero_grads']} | {errors} | {rec['out_rel_err']:.1e} |")
    body = f"{args.device}, torch {torch.__version__}.\n\n" + "\n".join(lines)
    write_probe("function_alias_probe", args, records, body)
    return records


if __name__ == "__main__":
    main()
