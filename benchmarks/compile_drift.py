"""Where compiled-vs-eager gradient differences of a converted `transformers` Llama come from.

Issue 13 saw, on CPU under bf16 autocast, fp8-tensorwise gradients of a compiled LlamaForCausalLM
differ ~8 % (relative L2) from eager, where the unconverted model differs 0.5 %. This measures,
for a tiny LlamaForCausalLM (random weights, no downloads), the relative L2 difference of all
parameter gradients against eager:

- `linears`: only the linear layers compiled (each its own `torch.compile`), everything else
  eager. If minifloat's layers were not exact under compilation, this would differ.
- `whole`: the whole model compiled (norms, rotary embeddings, attention, SiLU too).
- `whole, casts` (with `--emulate-precision-casts`): the same, compiled with inductor's
  `emulate_precision_casts`, which rounds fused bf16 intermediates where eager rounds them (by
  default inductor keeps them in float32 inside a kernel): how much of `whole` under bf16 autocast
  is that.
- `perturbed`: no compilation; eager with the token embeddings multiplied by (1 + 2^-8 u),
  u uniform in [-1, 1]: a bf16-rounding-sized change of the first layer's input. It shows how much
  the recipe amplifies a perturbation of that size, whatever its origin. `--perturb 8,23` adds
  `perturbed 2^-23` (a float32-rounding-sized change, the size of the unconverted model's own
  compiled-vs-eager differences in fp32): where that one is as large as `whole`, the recipe's
  rounding amplifies last-bit differences, wherever they come from. Whether a perturbation
  crosses a rounding boundary (a flipped E2M1 value, a moved tensor scale) is a matter of luck:
  `--seeds N` draws each from N seeds and gives the median, and how many seeds moved the
  gradients at least half as far as compiling did.
- `quantization error`: the eager gradients against the unconverted model's in fp32: the noise
  the recipe adds on purpose, the scale any difference between two runs of it saturates at.

    PYTHONPATH=src python benchmarks/compile_drift.py [--recipes none,fp8-tensorwise,fp4]
        [--layers 2] [--precisions bf16,fp32] [--perturb 8] [--emulate-precision-casts]
        [--seeds N] [--tag T] [--date D]

Recipes may be variants (`fp4:occ.one_gemm=off`). Writes
benchmarks/results/compile_drift[_<tag>]_cpu_<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch import nn
from torch._dynamo.utils import counters

import minifloat

VOCAB = 512


def build(layers: int) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg).float()


def grads(model: nn.Module, ids: torch.Tensor, amp: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {
        name.replace("_orig_mod.", ""): p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def rel_diff(got: dict, want: dict) -> float:
    num = sum(((got[k].double() - want[k].double()) ** 2).sum() for k in want)
    den = sum((want[k].double() ** 2).sum() for k in want)
    return float((num / den).sqrt())


def variant(model: nn.Module, mode: str, exponent: int = 8, seed: int = 1) -> nn.Module:
    """A copy of `model` compiled as `mode` says, or perturbed ("perturbed": the token
    embeddings times 1 + 2^-exponent u, u drawn from `seed`)."""
    m = copy.deepcopy(model)
    if mode == "whole":
        return torch.compile(m)
    if mode == "whole, casts":
        return torch.compile(m, options={"emulate_precision_casts": True})
    if mode == "linears":
        for parent in list(m.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, torch.compile(child))
        return m
    gen = torch.Generator().manual_seed(seed)
    emb = m.get_input_embeddings().weight
    with torch.no_grad():
        emb.mul_(1 + 2.0**-exponent * (2 * torch.rand(emb.shape, generator=gen) - 1))
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipes", default="none,fp8-tensorwise,fp4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--precisions", default="bf16,fp32", help="bf16 (autocast) and/or fp32")
    ap.add_argument("--perturb", default="8", help="exponents k of the 2^-k perturbations")
    ap.add_argument(
        "--emulate-precision-casts",
        action="store_true",
        help="add the mode 'whole, casts': compiled with inductor's emulate_precision_casts",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="draw each perturbation from seeds 1..N (the table gives their median and how many "
        "moved the gradients at least half as far as compiling the whole model did)",
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--tag", default="", help="results file suffix")
    ap.add_argument("--date", default=None, help="the results' date (default today)")
    args = ap.parse_args()
    precisions = list(dict.fromkeys(args.precisions.split(",")))
    if set(precisions) - {"bf16", "fp32"}:
        raise SystemExit(f"--precisions takes bf16 and/or fp32, got {args.precisions!r}")
    try:
        exponents = list(dict.fromkeys(int(k) for k in args.perturb.split(",")))
    except ValueError:
        raise SystemExit(f"--perturb takes integers, got {args.perturb!r}") from None
    if not all(1 <= k <= 24 for k in exponents):  # 1 + 2^-k u rounds to 1 in float32 past 24
        raise SystemExit(f"--perturb exponents must lie in 1..24, got {args.perturb!r}")
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    modes = [("linears", 0), ("whole", 0)]
    modes += [("whole, casts", 0)] if args.emulate_precision_casts else []
    modes += [("perturbed", k) for k in exponents]
    # Compiled linears may recompile per shape and module: room for all of them, so that no
    # layer silently falls back to eager at dynamo's recompile limit (8 by default).
    torch._dynamo.config.cache_size_limit = 64
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(2))
    base = build(args.layers)
    exact = grads(base, ids, amp=False)
    rows = []
    for recipe in args.recipes.split(","):
        model = copy.deepcopy(base)
        if recipe != "none":
            model = minifloat.convert(model, recipe)
        for amp in [p == "bf16" for p in precisions]:
            rows += _recipe_rows(model, ids, amp, modes, args.seeds, exact, recipe)
    write(rows, args)


def _recipe_rows(
    model: nn.Module, ids: torch.Tensor, amp: bool, modes: list, seeds: int, exact: dict,
    recipe: str,
) -> list[dict]:  # fmt: skip
    """The quantization error and every mode's difference from eager for one converted model
    and precision; each perturbation once per seed 1..`seeds`."""
    precision = "bf16 autocast" if amp else "fp32"
    eager = grads(model, ids, amp)
    rows = [dict(recipe=recipe, precision=precision, mode="quantization error",
                 grad_rel_diff=rel_diff(eager, exact))]  # fmt: skip
    for mode, exponent in modes:
        for seed in range(1, (seeds if mode == "perturbed" else 1) + 1):
            torch._dynamo.reset()
            counters.clear()
            start = time.time()
            diff = rel_diff(grads(variant(model, mode, exponent, seed), ids, amp), eager)
            rows.append(dict(recipe=recipe, precision=precision,
                             mode=_mode_name(mode, exponent), grad_rel_diff=diff,
                             graphs=counters["stats"].get("unique_graphs", 0),
                             seconds=round(time.time() - start, 1)))  # fmt: skip
            if mode == "perturbed":
                rows[-1]["seed"] = seed
            print(rows[-1], flush=True)
    return rows


def _mode_name(mode: str, exponent: int) -> str:
    """'perturbed' for the 2^-8 perturbation (the column's name before --perturb), else
    'perturbed 2^-k'; other modes as they are."""
    return mode if mode != "perturbed" or exponent == 8 else f"perturbed 2^-{exponent}"


def write(rows: list[dict], args: argparse.Namespace) -> None:
    """`compile_drift[_<tag>]_cpu_<date>.{md,json}` under --out-dir: the table, a row per
    recipe and precision, a column per mode."""
    date = args.date or datetime.date.today().isoformat()
    name = "_".join(filter(None, ("compile_drift", args.tag, "cpu", date)))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Compiled vs eager gradients of a converted LlamaForCausalLM, CPU, {date}",
        "",
        f"`PYTHONPATH=src python {shlex.join(sys.argv)}`; "
        f"torch {torch.__version__}, transformers "
        f"{transformers.__version__}. Relative L2 difference of all parameter gradients against "
        "eager (module docstring: linears = only the linear layers compiled; whole = the whole "
        "model"
        + (
            "; whole, casts = the same with emulate_precision_casts"
            if args.emulate_precision_casts
            else ""
        )
        + "; perturbed = eager, token embeddings x (1 + 2^-8 u)"
        + (
            "; perturbed 2^-k: x (1 + 2^-k u)"
            if any(r["mode"].startswith("perturbed 2^") for r in rows)
            else ""
        )
        + ").",
        "",
    ]
    columns = list(dict.fromkeys(r["mode"] for r in rows if r["mode"] != "quantization error"))
    columns.append("quantization error")
    lines += ["| recipe | precision | " + " | ".join(columns) + " |",
              "|---|---|" + "---|" * len(columns)]  # fmt: skip
    by_key: dict[tuple, dict] = {}
    for r in rows:
        modes = by_key.setdefault((r["recipe"], r["precision"]), {})
        modes.setdefault(r["mode"], []).append(r["grad_rel_diff"])
    for (recipe, precision), d in by_key.items():
        cells = " | ".join(_cell(d[c], d.get("whole", [None])[0]) for c in columns)
        lines.append(f"| {recipe} | {precision} | {cells} |")
    if args.seeds > 1:
        lines += ["", f"Perturbed cells: the median of {args.seeds} seeds, and how many of "
                  "them moved the gradients at least half as far as compiling the whole model "
                  "did."]  # fmt: skip
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


def _cell(values: list[float], whole: float | None) -> str:
    """One value as it is; several (a perturbation's seeds) as their median and the count at or
    above half of `whole` (the whole model's compiled difference), when that was measured."""
    if len(values) == 1:
        return f"{values[0]:.2e}"
    text = f"{statistics.median(values):.2e}"
    if whole is not None:
        text += f", {sum(v >= whole / 2 for v in values)}/{len(values)} >= whole/2"
    return text


if __name__ == "__main__":
    main()
