"""Summarize recipe runs from their metrics.jsonl files, including runs that stopped early.

`minifloat compare` writes its table only when every recipe finishes; a GPU job cut off by its
time limit still leaves one metrics.jsonl per run (`RUN_DIR/<run name>/metrics.jsonl`, as
`benchmarks/convergence.sh` and `minifloat compare` lay them out). This compares every run with
the first of `--order` (the reference, bf16), and writes `<name>.json`, `<name>_table.md` and
`<name>.png` under `--out-dir`:

    python benchmarks/convergence_report.py RUN_DIR --model 125M --name convergence_h200_2026-12-01

One JSON record per run (issue 15's report):
- `recipe` (the run's name: `fp4`, or `fp4+switch=bf16+at=0.9` for a run with a final-phase
  switch, which also gets `switch_recipe`, `switch_at` and `switch_step`, the last step before
  the switch once the run reached it), `model`, `tokens` (trained so far);
- `train_loss`: the last logged train loss (mean over its log window); `val_loss` and `val_step`:
  the last validation loss and its step;
- `gap_pct`: validation-loss gap to the reference in %, at `gap_step`, the last evaluation step
  both runs reached (the same held-out tokens, the same weights' age); None without one;
- `train_gap_pct`: train-loss gap at `common_step`, the last step every run logged
  (`train_loss_at_common_step`);
- `best_gap_pct`: validation-loss gap at `best_step`, the reference's lowest validation loss
  among the steps both runs evaluated. It differs from `gap_pct` when the reference overfits
  (validation loss rising again while train loss falls, as when a small corpus is seen many
  times over): the final gap then measures memorization as much as the recipe;
- `min_val_loss` and `min_val_step`: the run's own lowest validation loss, and `min_gap_pct`,
  its gap to the reference's lowest (each at its own step, all evaluations counted): the
  comparison early stopping would make, fair to a run that overfits later than the reference;
- `tokens_per_s`: the median over the run's log windows; `peak_mem_gib`: the largest peak any
  chunk of the run logged (None on the CPU); `skipped_steps`: steps the step guard skipped;
- for a run branched from another (`train --branch-from`, docs/training.md: it trained only the
  steps after `branch_step`, the records up to it are the other run's) `branched_from` (that
  run's directory name) and `branch_step`.

The plot shows the train-loss curves (validation losses as markers) over tokens, and beside
them each run's relative gap to the reference over tokens (train loss as lines, validation loss
as markers): the curves alone hide a 1 % gap. A switched run's switch is a dotted line; a grey
dashed line marks the reference's lowest validation loss.
`--layer-sqnr` adds each run's per-layer quantization SQNR summary (first and last `layer_sqnr`
record of `--sqnr-every`; mean, minimum and worst layer per operand) to its record.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minifloat.train.switch import parse_run_name  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load(run_dir: Path) -> dict[str, list[dict]]:
    """{run name: its metrics records} of every ``run_dir/*/metrics.jsonl`` with loss records."""
    runs = {}
    for path in sorted(run_dir.glob("*/metrics.jsonl")):
        rows = _rows(path)
        if any("loss" in r for r in rows):
            runs[path.parent.name] = rows
    if not runs:
        raise SystemExit(f"no */metrics.jsonl with loss records under {run_dir}")
    return runs


def _train(rows: list[dict]) -> list[dict]:
    """The log-window records (layer_sqnr records carry no loss)."""
    return [r for r in rows if "loss" in r]


def val_losses(rows: list[dict]) -> dict[int, float]:
    """{step: validation loss} of a run's metrics records (records without one skipped)."""
    return {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}


def layer_sqnr(run_dir: Path, name: str) -> dict | None:
    """First and last per-layer SQNR summaries of a run (None if it logged none)."""
    from minifloat.diagnostics import summarize

    records = [r for r in _rows(run_dir / name / "metrics.jsonl") if "layer_sqnr" in r]
    if not records:
        return None
    first, last = records[0], records[-1]
    return {
        "first_step": first["step"],
        "last_step": last["step"],
        "first": summarize(first["layer_sqnr"]),
        "last": summarize(last["layer_sqnr"]),
    }


def at_step(rows: list[dict], step: int) -> dict | None:
    return next((r for r in _train(rows) if r["step"] == step), None)


def _gap(value: float | None, ref: float | None) -> float | None:
    return None if value is None or not ref else 100.0 * (value - ref) / ref


def switch_info(name: str, rows: list[dict]) -> dict[str, Any]:
    """``switch_recipe``, ``switch_at`` and ``switch_step`` of a switched run ({} otherwise);
    the step is the last one logged under the run's own recipe, once a later one was not."""
    fields = parse_run_name(name)
    if fields["switch_recipe"] is None:
        return {}
    recipes = [(r["step"], r.get("recipe")) for r in _train(rows)]
    switched = any(recipe == fields["switch_recipe"] for _, recipe in recipes)
    before = [step for step, recipe in recipes if recipe == fields["recipe"]]
    return {
        "switch_recipe": fields["switch_recipe"],
        "switch_at": fields["switch_at"],
        "switch_step": max(before) if switched and before else None,
    }


def branch_info(rows: list[dict]) -> dict[str, Any]:
    """``branched_from`` (the source run's directory name) and ``branch_step`` of a branched
    run, from the record its branch wrote ({} for a run trained from step 0)."""
    marker = next((r for r in rows if "branched_from" in r), None)
    if marker is None:
        return {}
    return {"branched_from": Path(marker["branched_from"]).name, "branch_step": marker["step"]}


def best_step(ref_val: dict[int, float], steps: list[int]) -> int | None:
    """The step of `steps` where the reference's validation loss is lowest (None if none)."""
    return min(steps, key=lambda s: ref_val[s]) if steps else None


def record(name: str, rows: list[dict], ref_rows: list[dict], common: int, model: str,
           tokens_per_step: int) -> dict[str, Any]:  # fmt: skip
    """The JSON record of one run (see the module docstring)."""
    train, val, ref_val = _train(rows), val_losses(rows), val_losses(ref_rows)
    both = sorted(set(val) & set(ref_val))
    gap_step = both[-1] if both else None
    best = best_step(ref_val, both)
    mid, ref_mid = at_step(rows, common), at_step(ref_rows, common)
    speeds = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    peaks = [r["peak_mem_gib"] for r in rows if r.get("peak_mem_gib") is not None]
    return {
        "recipe": name,
        "model": model,
        "tokens": train[-1]["step"] * tokens_per_step,
        "train_loss": train[-1]["loss"],
        "val_loss": val[max(val)] if val else None,
        "val_step": max(val) if val else None,
        "gap_pct": None if gap_step is None else _gap(val[gap_step], ref_val[gap_step]),
        "gap_step": gap_step,
        "best_gap_pct": None if best is None else _gap(val[best], ref_val[best]),
        "best_step": best,
        "min_val_loss": min(val.values()) if val else None,
        "min_val_step": min(val, key=val.get) if val else None,
        "min_gap_pct": _gap(min(val.values()), min(ref_val.values())) if val and ref_val else None,
        "train_gap_pct": _gap(mid and mid["loss"], ref_mid and ref_mid["loss"]),
        "common_step": common,
        "train_loss_at_common_step": mid and mid["loss"],
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "peak_mem_gib": max(peaks) if peaks else None,
        "skipped_steps": max((r.get("skipped", 0) for r in train), default=0),
        **switch_info(name, rows),
        **branch_info(rows),
    }


def summarize(runs: dict[str, list[dict]], order: list[str], tokens_per_step: int, model: str):
    """One record per run of ``order`` (the first is the reference)."""
    # The last step every run logged: a run stopped by a time limit logs its last step off
    # the others' logging grid, so the smallest last step alone may match no other run's row.
    logged = [{r["step"] for r in _train(rows)} for rows in runs.values()]
    shared = set.intersection(*logged)
    common = max(shared) if shared else min(max(steps) for steps in logged)
    ref = runs[order[0]]
    return [record(n, runs[n], ref, common, model, tokens_per_step) for n in order]


def plot(runs: dict[str, list[dict]], order: list[str], path: Path, *, model: str,
         tokens_per_step: int) -> list[str]:  # fmt: skip
    """Left: train (lines) and validation (markers) loss over tokens. Right: the relative gap
    to the first run over tokens. Returns the panel titles (no machine paths in them)."""
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab20" if len(order) > 10 else "tab10")
    ref_train = {r["step"]: r["loss"] for r in _train(runs[order[0]])}
    ref_val = val_losses(runs[order[0]])
    million = tokens_per_step / 1e6
    for i, name in enumerate(order):
        rows, color = runs[name], colors(i)
        train, val = _train(rows), val_losses(rows)
        ax.plot([r["step"] * million for r in train], [r["loss"] for r in train], color=color,
                label=name, linewidth=1.2)  # fmt: skip
        ax.plot([s * million for s in val], list(val.values()), "o", color=color, markersize=3)
        common = [r for r in train if r["step"] in ref_train]
        gap.plot([r["step"] * million for r in common],
                 [_gap(r["loss"], ref_train[r["step"]]) for r in common], color=color,
                 label=name, linewidth=1.0)  # fmt: skip
        steps = [s for s in val if s in ref_val]
        gap.plot([s * million for s in steps], [_gap(val[s], ref_val[s]) for s in steps], "o",
                 color=color, markersize=4)  # fmt: skip
        switch = switch_info(name, rows).get("switch_step")
        if switch is not None:
            for a in (ax, gap):
                a.axvline(switch * million, color=color, linestyle=":", linewidth=1.0)
    titles = [f"{model}: loss by recipe (lines train, dots validation)",
              f"{model}: gap to {order[0]} (lines train loss, dots validation loss)"]  # fmt: skip
    ax.set_ylabel("cross-entropy loss")
    gap.set_ylabel(f"relative gap to {order[0]} (%)")
    gap.axhline(0.0, color="black", linewidth=0.8)
    best = best_step(ref_val, list(ref_val))  # the reference's lowest validation loss
    if best is not None:
        for a in (ax, gap):
            a.axvline(best * million, color="gray", linestyle="--", linewidth=0.8)
    for a, title in zip((ax, gap), titles, strict=True):
        a.set_xlabel("tokens (millions)")
        a.set_title(title, fontsize=9)
        a.grid(alpha=0.3)
    gap.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return titles


def markdown(records: list[dict]) -> str:
    def num(v, fmt, unit=""):
        return "n/a" if v is None else format(v, fmt) + unit

    lines = [
        "| run | tokens | train loss | val loss (step) | val gap (step) | val gap @ ref's best "
        "(step) | lowest val loss (step): gap to ref's lowest | train gap @ common step | "
        "tokens/s | peak mem | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['recipe']} | {r['tokens'] / 1e6:.1f}M | {r['train_loss']:.4f} | "
            f"{num(r['val_loss'], '.4f')} ({num(r['val_step'], 'd')}) | "
            f"{num(r['gap_pct'], '+.2f', '%')} ({num(r['gap_step'], 'd')}) | "
            f"{num(r['best_gap_pct'], '+.2f', '%')} ({num(r['best_step'], 'd')}) | "
            f"{num(r['min_val_loss'], '.4f')} ({num(r['min_val_step'], 'd')}): "
            f"{num(r['min_gap_pct'], '+.2f', '%')} | "
            f"{num(r['train_gap_pct'], '+.2f', '%')} ({r['common_step']}) | "
            f"{num(r['tokens_per_s'], ',.0f')} | {num(r['peak_mem_gib'], '.1f', ' GiB')} | "
            f"{r['skipped_steps']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens-per-step", type=int, default=32 * 1024)
    ap.add_argument("--order", default=None, help="comma-separated runs, reference first")
    ap.add_argument("--name", required=True, help="output file stem under --out-dir")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--layer-sqnr", action="store_true", help="add layer SQNR summaries")
    args = ap.parse_args(argv)
    runs = load(args.run_dir)
    order = args.order.split(",") if args.order else list(runs)
    records = summarize(runs, order, args.tokens_per_step, args.model)
    if args.layer_sqnr:
        for rec in records:
            rec["layer_sqnr"] = layer_sqnr(args.run_dir, rec["recipe"])
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, order, out / f"{args.name}.png", model=args.model,
         tokens_per_step=args.tokens_per_step)  # fmt: skip
    (out / f"{args.name}.json").write_text(json.dumps(records, indent=1) + "\n")
    table = markdown(records)
    print(table)
    (out / f"{args.name}_table.md").write_text(table + "\n")
    return records


if __name__ == "__main__":
    main()
