"""Does DGE change the effective step size? Weight updates under fp4-direct and fp4-dge.

Issue 15's 50M runs put both DGE recipes 2-3 % *ahead* of bf16 early and behind later, while
direct casting trails from the start (results/ablations_50M_h200_2026-11-23.md). DGE multiplies
each weight's gradient by f'(w/s), 0.2 on a grid point up to 3 near a midpoint; AdamW divides by
a running RMS, so a constant factor would change nothing, but a changing one might. This trains
the same model from the same initialization on the same batches under each recipe (CPU, the
exact emulation) and records, per step and per quantized layer: the update's RMS relative to the
weight's RMS, the fraction of weights whose E2M1 value (row-scaled, the fprop operand) flips,
and the update's size in grid units by where the weight sat in its E2M1 interval (|t| < 0.25:
near a midpoint, where f' is large; |t| > 0.75: near a grid point, where f' is 1/k..1), to test
whether DGE under AdamW shrinks the steps of weights near grid points.

    python benchmarks/dge_step_size.py [--recipes bf16,fp4-direct,fp4-dge --steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from minifloat.convert import convert
from minifloat.data import BatchIterator, build_dataset
from minifloat.dge import grid_position
from minifloat.models.llama import Llama, get_config
from minifloat.quantize import quantize
from minifloat.train.schedule import lr_at

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402


def _linear_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weight of every linear layer but the head (kept in high precision by `convert`)."""
    return {
        name: m.weight
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "output"  # QuantLinear is an nn.Linear
    }


def _codes(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """E2M1 values of the weights, row-scaled (what fprop multiplies)."""
    return {n: quantize(w.detach().float(), "e2m1", "row").values for n, w in weights.items()}


def _positions(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All weights' |t| in their E2M1 interval and their row scales, flattened (one vector)."""
    ts, scales = [], []
    for w in weights.values():
        w = w.detach().float()
        scale = quantize(w, "e2m1", "row").expand_scale()
        ts.append(grid_position(w / scale).abs().flatten())
        scales.append(scale.flatten())
    return torch.cat(ts), torch.cat(scales)


def _update_by_position(
    before: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], lr: float
) -> tuple[float, float]:
    """Mean |Δw| in grid units (Δw / row scale) per unit of learning rate, for the weights that
    sat near a midpoint (|t| < 0.25) and near a grid point (|t| > 0.75) before the step."""
    t, scale = _positions(before)
    dw = torch.cat([(w.detach() - before[n]).flatten() for n, w in weights.items()])
    units = (dw / scale).abs() / lr
    return units[t < 0.25].mean().item(), units[t > 0.75].mean().item()


def train(recipe: str, args: argparse.Namespace, tokens) -> list[dict]:
    """Per-step records: loss, relative update RMS and E2M1 flip fraction (means over layers)."""
    torch.manual_seed(0)
    model = Llama(get_config(args.model, vocab_size=args.vocab, max_seq_len=args.seq))
    model.init_weights(0)
    if recipe != "bf16":
        convert(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = BatchIterator(tokens, args.batch, args.seq, seed=0)
    named = _linear_weights(model)
    codes = _codes(named)
    rows = []
    for step in range(args.steps):
        inputs, targets = batches.next()
        for group in opt.param_groups:  # the convergence study's schedule
            group["lr"] = lr_at(step, total_steps=args.steps, peak_lr=args.lr)
        before = {n: w.detach().clone() for n, w in named.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        after = _codes(named)
        upd_mid, upd_grid = _update_by_position(before, named, opt.param_groups[0]["lr"])
        rel = [
            ((w.detach() - before[n]).norm() / before[n].norm()).item() for n, w in named.items()
        ]
        flips = [(after[n] != codes[n]).float().mean().item() for n in named]
        rows.append({"recipe": recipe, "step": step + 1, "loss": loss.item(),
                     "rel_update": statistics.fmean(rel),
                     "flip_frac": statistics.fmean(flips),
                     "update_mid": upd_mid, "update_grid": upd_grid})  # fmt: skip
        codes = after
        if args.progress and (step + 1) % 50 == 0:
            print(f"{recipe} step {step + 1}: loss {loss.item():.4f}", flush=True)
    return rows


def markdown(records: list[dict], args: argparse.Namespace) -> str:
    windows = [(1, args.steps // 6), (args.steps // 6 + 1, args.steps // 2),
               (args.steps // 2 + 1, args.steps)]  # fmt: skip
    lines = [
        f"`python benchmarks/dge_step_size.py --steps {args.steps} --model {args.model} "
        f"--batch {args.batch} --seq {args.seq} --lr {args.lr}` (CPU, emulated numerics, bf16 "
        "autocast, AdamW 0.9/0.95, wd 0.1, 5 % warm-up then cosine to 10 %, same init and "
        "batches per recipe). Means over the window's steps and over the linear layers.",
        "",
        "Update near midpoints / grid points: mean |Δw| / row scale / learning rate of the "
        "weights with |t| < 0.25 / |t| > 0.75 before the step (t: the position in the E2M1 "
        "interval, dge.grid_position), and their ratio.",
        "",
        "| recipe | steps | train loss | update RMS / weight RMS | E2M1 values flipped per step "
        "| update near midpoints | near grid points | grid / mid |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for recipe in args.recipes.split(","):
        rows = [r for r in records if r["recipe"] == recipe]
        for lo, hi in windows:
            w = [r for r in rows if lo <= r["step"] <= hi]
            if not w:  # a window shorter than one step (few steps)
                continue
            mid = statistics.fmean(r["update_mid"] for r in w)
            grid = statistics.fmean(r["update_grid"] for r in w)
            lines.append(
                f"| {recipe} | {lo}-{hi} | {statistics.fmean(r['loss'] for r in w):.4f} | "
                f"{statistics.fmean(r['rel_update'] for r in w):.2e} | "
                f"{100 * statistics.fmean(r['flip_frac'] for r in w):.3f} % | "
                f"{mid:.3f} | {grid:.3f} | {grid / mid:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="bf16,fp4-direct,fp4-dge")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=257, help="257: the byte tokenizer")
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--data-max-bytes", type=int, default=2_000_000)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    ds = build_dataset(args.data, tokenizer="byte", max_bytes=args.data_max_bytes, progress=False)
    records = [
        r for recipe in args.recipes.split(",") for r in train(recipe, args, ds.train_tokens)
    ]
    name = "dge_step_size" + (f"_{args.tag}" if args.tag else "")
    kw = {"out_dir": Path(args.out_dir)} if args.out_dir else {}
    md, _ = write_results(name, records, markdown(records, args), **kw)
    print(md.read_text())


if __name__ == "__main__":
    main()
