"""OCC on real activations: y's SQNR under each compensation, from a trained run's layer inputs.

Issue 13 asks OCC's cheap forms to keep y's SQNR within 0.5 dB of the exact fp32 compensation
on `recipe_sqnr.py`'s inputs (synthetic, measured since session 26) *and* on real activations
of a 125M model mid-training. This script takes the second: it rebuilds a `minifloat train`
run's model from its newest checkpoint (a run stopped part-way, `--stop-after`, is "mid-
training"), converts it to the run's recipe as the trainer does, runs one validation batch of
the run's shape under bf16 autocast and keeps every quantized layer's input. On each input and
its layer's weight it then measures, against the float64 product x·wᵀ:
- y's SQNR for each variant (fp4 without OCC, OCC without compensation, the fp32 reference
  compensation, the E4M3 compensation as a separate GEMM, fp4's default one GEMM over 2K, exact
  thresholds), each layer a fresh `QuantLinear` of that recipe, float32, no autocast;
- where the clipped entries lie: their fraction, the channels that hold any, the share of the
  remainder's energy in the top 1 % and 5 % of channels (whether a compensation restricted to
  outlier channels could hold them: `occ_columns.py` asked it of synthetic inputs only);
- the sampled thresholds' relative error against the exact quantiles;
- y's SQNR with the remainder compensated only in the top 1-12.5 % of channels by remainder
  energy (float64, on top of the uncompensated y): whether a compensation GEMM over a few
  channels, a fraction of the dense one's cost, could hold OCC's accuracy on real inputs
  (session 68: it cannot, the clipped entries spread over the channels);
- the same for the top 1-25 % of rows (tokens) by the remainder's largest magnitude, and for
  the top 3 and 12.5 % by its energy, and the rows' shares of its energy: whether a
  compensation GEMM over a few rows ([R, K] · [K, N], added into y's rows) could (session 70:
  it cannot either; the `occ.rows` option that tried it in training was removed).

    python benchmarks/occ_real_activations.py RUN_DIR [--tokens N] [--variants a,b,...]
        [--device cuda] [--out-dir DIR] [--tag TAG] [--date DATE]

Writes occ_real_activations[_TAG]_<gpu>_<date>.{md,json} (one JSON record per layer and
variant).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, write_results  # noqa: E402
from minifloat import recipes  # noqa: E402
from minifloat.errors import first_line  # noqa: E402
from minifloat.linear import QuantLinear  # noqa: E402
from minifloat.occ import remainder, thresholds  # noqa: E402
from minifloat.sqnr import sqnr_db  # noqa: E402
from minifloat.train.errors import CheckpointError  # noqa: E402

REFERENCE = "fp4:occ.compensation_format=fp32"
DEFAULT = "fp4"
VARIANTS = (
    "fp4-dge",  # fp4's fprop without OCC: the direct E2M1 cast
    "fp4:occ.compensate=off",  # UNCOMPENSATED
    REFERENCE,
    "fp4:occ.one_gemm=off",
    DEFAULT,
    "fp4:occ.threshold=exact",
)
UNCOMPENSATED = "fp4:occ.compensate=off"
TARGET_DB = 0.5  # issue 13: within 0.5 dB of the exact fp32 compensation
# the restricted compensation's channel counts, as shares of K, and row counts, as shares of M
# (`restricted`)
CHANNEL_SHARES = (0.01, 0.03, 0.06, 0.125)
ROW_SHARES = (0.01, 0.03, 0.06, 0.125, 0.25)
# ... and the rows by the remainder's energy instead (what a pass over x could rank them by)
ENERGY_ROW_SHARES = (0.03, 0.125)


def capture_inputs(run_dir: Path, tokens: int | None, device: torch.device) -> tuple[dict, dict]:
    """{layer name: (x [M, K] float32, weight [N, K] float32)} of every quantized layer on one
    validation batch, and a description of the run."""
    from minifloat.convert import convert
    from minifloat.size_rule import SizeRule
    from minifloat.train.build import load_dataset
    from minifloat.train.export import load_run

    run = load_run(run_dir)
    cfg = run.config.resolved()
    if cfg.switch_recipe is not None:  # which recipe its layers ran at run.step is not kept here
        raise SystemExit(
            f"{run_dir}: a run that switches recipes (to {cfg.switch_recipe}) is not supported"
        )
    seq = cfg.seq_len
    if tokens is not None and tokens < seq:
        raise SystemExit(f"--tokens {tokens} is less than one sequence of the run ({seq} tokens)")
    model = run.model.to(device)
    if recipes.get(cfg.recipe).quantized:
        rule = SizeRule.parse(cfg.size_rule) if cfg.size_rule else None
        convert(model, cfg.recipe, size_rule=rule)
    model.eval()
    val = load_dataset(run.config, progress=False).val_tokens
    rows = (tokens or cfg.batch_size * seq) // seq
    if len(val) < rows * seq:
        raise SystemExit(f"{run_dir}: {len(val)} validation tokens, fewer than {rows} x {seq}")
    batch = torch.from_numpy(np.asarray(val[: rows * seq], dtype=np.int64)).view(rows, seq)
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Callable[[torch.nn.Module, tuple], None]:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().float()
            captured[name] = (x.reshape(-1, x.shape[-1]), module.weight.detach().float())

        return hook

    handles = [
        m.register_forward_pre_hook(keep(n))
        for n, m in model.named_modules()
        if isinstance(m, QuantLinear)
    ]
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        model(batch.to(device))
    for h in handles:
        h.remove()
    if not captured:
        raise SystemExit(f"{run_dir}: its model ({cfg.recipe}) has no quantized layer to measure")
    about = {
        "run": str(run_dir),
        "checkpoint": str(run.path),
        "recipe": cfg.recipe,
        "model": cfg.model,
        "step": run.step,
        "steps": cfg.total_steps(),  # as one process would run it
        "tokens_per_layer": rows * seq,
    }
    return captured, about


class Clipped(NamedTuple):
    """OCC's clip of one input x [M, K] (fp4's thresholds), computed once per layer."""

    lo: torch.Tensor
    hi: torch.Tensor
    delta: torch.Tensor  # the remainder x - clamp(x), float64 [M, K]
    order: torch.Tensor  # the channels by the remainder's energy, most first [K]
    row_order: torch.Tensor  # the rows (tokens) by the remainder's largest |entry|, most first
    row_energy_order: torch.Tensor  # the rows by the remainder's energy, most first


def clip(x: torch.Tensor) -> Clipped:
    """fp4's thresholds of x, its remainder, its channels by remainder energy and its rows by
    the remainder's largest magnitude and by its energy."""
    lo, hi = thresholds(x, recipes.get(DEFAULT).occ)
    delta = remainder(x, lo, hi).double()
    energy = delta.square()
    most_first = lambda v: v.argsort(descending=True)  # noqa: E731
    return Clipped(
        lo,
        hi,
        delta,
        most_first(energy.sum(dim=0)),
        most_first(delta.abs().amax(dim=1)),
        most_first(energy.sum(dim=1)),
    )


def _top_shares(energy: torch.Tensor, shares: tuple[float, ...]) -> dict[float, float]:
    """{p: the share of the total in the top p % of `energy` (sorted, most first)}."""
    share = energy.cumsum(0) / energy.sum().clamp(min=1e-300)
    return {p: float(share[max(1, round(len(energy) * p / 100)) - 1]) for p in shares}


def channel_stats(x: torch.Tensor, c: Clipped) -> dict:
    """Where OCC's clipped entries lie, and the sampled thresholds against the exact ones."""
    exact = thresholds(x, dataclasses.replace(recipes.get(DEFAULT).occ, threshold="exact"))
    clipped = c.delta != 0
    energy = c.delta.square()
    top = _top_shares(energy.sum(dim=0)[c.order], (1, 5))
    top_rows = _top_shares(energy.sum(dim=1).sort(descending=True).values, (1, 5))
    rel = lambda got, want: abs(float(got) - float(want)) / max(abs(float(want)), 1e-30)  # noqa: E731
    return {
        "clipped_fraction": float(clipped.float().mean()),
        "channels_clipped": int(clipped.any(dim=0).sum()),
        "channels": x.shape[1],
        "energy_top1pct": top[1],
        "energy_top5pct": top[5],
        "rows_clipped": int(clipped.any(dim=1).sum()),
        "row_energy_top1pct": top_rows[1],
        "row_energy_top5pct": top_rows[5],
        "threshold_rel_err": max(rel(c.lo, exact[0]), rel(c.hi, exact[1])),
    }


def layer_y(variant: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y of a fresh float32 QuantLinear of `variant` holding weight w."""
    backend = "emulated" if x.device.type == "cpu" else "auto"
    layer = QuantLinear(
        w.shape[1], w.shape[0], bias=False, recipe=variant, backend=backend, device=x.device
    )
    with torch.no_grad():
        layer.weight.copy_(w)
        return layer(x)


def restricted_labels() -> tuple[str, ...]:
    """The restricted compensation's variant names, one per share of `CHANNEL_SHARES` and of
    `ROW_SHARES` (rows by their largest remainder) and of `ENERGY_ROW_SHARES` (by its energy)."""
    return (
        tuple(f"top {100 * p:g} % channels" for p in CHANNEL_SHARES)
        + tuple(f"top {100 * p:g} % rows" for p in ROW_SHARES)
        + tuple(f"top {100 * p:g} % rows by energy" for p in ENERGY_ROW_SHARES)
    )


def _kept(n: int, share: float) -> int:
    """share·n rounded up to a multiple of 16 (a GEMM's tile), at most n (the product first
    rounded to 9 decimals: 1600 x 0.07 is 112.00000000000001 in float64, and 112 rows)."""
    return min(n, 16 * math.ceil(round(n * share, 9) / 16))


def restricted(c: Clipped, w: torch.Tensor, y_off: torch.Tensor, ref: torch.Tensor) -> dict:
    """{label: (y's SQNR, C or R)} with the remainder compensated only in the C channels of most
    remainder energy, or the R rows of largest remainder (exactly, in float64, on top of the
    uncompensated layer's y): what a compensation GEMM over [M, C], or over [R, K] added into
    y's rows, could hold at best. C and R: each share of K in `CHANNEL_SHARES` and of M in
    `ROW_SHARES`, rounded up to a multiple of 16; the channels and rows are this batch's own
    (a top-k, as a training step could pick them)."""
    (m, k), w64, y64 = c.delta.shape, w.double(), y_off.double()
    labels = iter(restricted_labels())
    out = {}
    for share in CHANNEL_SHARES:
        idx = c.order[: _kept(k, share)]
        y = y64 + c.delta[:, idx] @ w64[:, idx].t()
        out[next(labels)] = (sqnr_db(ref, y), len(idx))
    for order, shares in ((c.row_order, ROW_SHARES), (c.row_energy_order, ENERGY_ROW_SHARES)):
        for share in shares:
            idx = order[: _kept(m, share)]
            y = y64.index_add(0, idx, c.delta[idx] @ w64.t())
            out[next(labels)] = (sqnr_db(ref, y), len(idx))
    return out


def measure(captured: dict, variants: tuple[str, ...]) -> list[dict]:
    """One record per layer and variant (and restricted compensation, with `UNCOMPENSATED`
    among the variants): y's SQNR against float64 and the layer's `channel_stats`."""
    records = []
    for i, (name, (x, w)) in enumerate(captured.items()):
        print(f"[{i + 1}/{len(captured)}] {name} {tuple(x.shape)}", flush=True)
        ref = x.double() @ w.double().t()
        c = clip(x)
        row = {
            "layer": name,
            "m": x.shape[0],
            "k": x.shape[1],
            "n": w.shape[0],
            **channel_stats(x, c),
        }
        for variant in variants:
            records.append(
                {**row, "variant": variant, "y_sqnr_db": sqnr_db(ref, layer_y(variant, x, w))}
            )
        if UNCOMPENSATED in variants:
            y_off = layer_y(UNCOMPENSATED, x, w)
            for label, (db, kept) in restricted(c, w, y_off, ref).items():
                what = "channels_kept" if label.endswith("channels") else "rows_kept"
                records.append({**row, "variant": label, "y_sqnr_db": db, what: kept})
    return records


def summary(records: list[dict]) -> str:
    """Markdown: each variant's mean and least y SQNR over the layers and its difference from
    `REFERENCE`, and the issue's verdict (`DEFAULT` within `TARGET_DB` of it in every layer)."""
    variants = tuple(dict.fromkeys(r["variant"] for r in records))
    by = {(r["layer"], r["variant"]): r["y_sqnr_db"] for r in records}
    layers = list(dict.fromkeys(r["layer"] for r in records))
    lines = [
        "| variant | mean y SQNR (dB) | min | vs fp32 compensation: mean | worst |",
        "|---|---|---|---|---|",
    ]
    for v in variants:
        vals = [by[(n, v)] for n in layers]
        cell = "— | —"
        if REFERENCE in variants:
            d = [by[(n, v)] - by[(n, REFERENCE)] for n in layers]
            cell = f"{statistics.fmean(d):+.2f} | {min(d):+.2f}"
        lines.append(f"| {v} | {statistics.fmean(vals):.2f} | {min(vals):.2f} | {cell} |")
    if REFERENCE in variants and DEFAULT in variants:
        worst = min(by[(n, DEFAULT)] - by[(n, REFERENCE)] for n in layers)
        held = sum(by[(n, DEFAULT)] >= by[(n, REFERENCE)] - TARGET_DB for n in layers)
        verdict = "met" if held == len(layers) else "missed"
        lines += [
            "",
            f"Target (issue 13: {DEFAULT}'s y within {TARGET_DB} dB of {REFERENCE}): "
            f"**{verdict}**, {held} of {len(layers)} layers, the worst {worst:+.2f} dB.",
        ]
    return "\n".join(lines)


def layer_table(records: list[dict]) -> str:
    """Markdown: a row per layer, its channel statistics and every variant's y SQNR."""
    variants = tuple(dict.fromkeys(r["variant"] for r in records))
    head = (
        "| layer | M x K -> N | clipped | channels clipped | energy top 1 % / 5 % ch. "
        "| rows clipped | energy top 1 % / 5 % rows | thr. err |"
    )
    lines = [head + "".join(f" {v} |" for v in variants), "|---" * (8 + len(variants)) + "|"]
    by_layer: dict[str, list[dict]] = {}
    for r in records:
        by_layer.setdefault(r["layer"], []).append(r)
    for name, rs in by_layer.items():
        r = rs[0]
        cells = [
            name,
            f"{r['m']} x {r['k']} -> {r['n']}",
            f"{100 * r['clipped_fraction']:.2f} %",
            f"{r['channels_clipped']} / {r['channels']}",
            f"{100 * r['energy_top1pct']:.0f} / {100 * r['energy_top5pct']:.0f} %",
            f"{r['rows_clipped']} / {r['m']}",
            f"{100 * r['row_energy_top1pct']:.0f} / {100 * r['row_energy_top5pct']:.0f} %",
            f"{100 * r['threshold_rel_err']:.2f} %",
        ]
        cells += [f"{x['y_sqnr_db']:.2f}" for x in rs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    """Measure the run named on the command line; returns the results .md. Bad arguments, a
    missing or unreadable run, and a run without quantized layers exit with one line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, help="a `minifloat train --out` directory")
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens of the validation batch (default: the run's batch x seq_len)",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--tag", default="")
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    try:
        if not variants:
            raise ValueError("--variants names no recipe")
        for v in variants:
            recipes.get(v)  # a bad name fails here, before the run is read
        captured, about = capture_inputs(args.run_dir, args.tokens, torch.device(args.device))
    except (CheckpointError, ValueError) as exc:
        raise SystemExit(first_line(exc)) from exc
    records = [{**about, **r} for r in measure(captured, variants)]
    body = (
        f"`{' '.join(sys.argv)}`\n\nRun: {about['recipe']} {about['model']}, step "
        f"{about['step']} of {about['steps']}; one validation batch of "
        f"{about['tokens_per_layer']} tokens under bf16 autocast, every quantized layer's "
        "input kept; each variant a fresh float32 QuantLinear, y's SQNR against float64 "
        "x·wᵀ. Columns: clipped = OCC's clipped fraction; channels clipped = input "
        "channels holding a clipped entry; energy = share of the remainder's energy in the "
        "top 1 % / 5 % of channels; thr. err = the sampled thresholds' largest relative "
        "error against the exact quantiles; rows clipped and energy: the same over rows "
        "(tokens). 'top p % channels' ('rows'): the remainder compensated exactly (float64) "
        "only in the C channels of most remainder energy (the R rows of largest |remainder|, "
        "or of most remainder energy: 'rows by energy'), on top of "
        f"{UNCOMPENSATED}'s y (C, R = p % of K, M in multiples of 16, at least 16): what a "
        "compensation GEMM over [M, C] (over [R, K], added into y's rows) could hold at "
        "best.\n\n" + summary(records) + "\n\n" + layer_table(records)
    )
    name = "_".join(filter(None, ("occ_real_activations", args.tag)))
    md, _ = write_results(name, records, body, out_dir=Path(args.out_dir), day=args.date)
    print(md)
    return md


if __name__ == "__main__":
    main()
