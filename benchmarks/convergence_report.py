"""Summarize recipe runs from their metrics.jsonl files, including runs that stopped early.

`minifloat compare` writes its table only when every recipe finishes; a GPU job cut off by its
time limit still leaves one metrics.jsonl per recipe. This compares all recipes at the last step
every run reached (and at each run's own last step), with gaps in % against the first recipe.

    python benchmarks/convergence_report.py RUN_DIR --model 50M --name convergence_h200_2026-11-22

`--layer-sqnr` adds each run's per-layer quantization SQNR summary (first and last `layer_sqnr`
record of `--sqnr-every`; mean, minimum and worst layer per operand) to the JSON records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load(run_dir: Path) -> dict[str, list[dict]]:
    runs = {}
    for path in sorted(run_dir.glob("*/metrics.jsonl")):
        # Skipped-step events are extra one-step records and layer_sqnr records carry no loss;
        # keep the regular log-window means.
        rows = [r for r in _rows(path) if "loss" in r and "skip_reason" not in r]
        if rows:
            runs[path.parent.name] = rows
    if not runs:
        raise SystemExit(f"no */metrics.jsonl with loss records under {run_dir}")
    return runs


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
    return next((r for r in rows if r["step"] == step), None)


def summarize(runs: dict[str, list[dict]], order: list[str], tokens_per_step: int, model: str):
    common = min(rows[-1]["step"] for rows in runs.values())
    ref = at_step(runs[order[0]], common)
    records = []
    for name in order:
        rows = runs[name]
        mid, last = at_step(rows, common), rows[-1]
        val = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
        rec = {
            "recipe": name,
            "model": model,
            "tokens": last["step"] * tokens_per_step,
            "train_loss": last["loss"],
            "val_loss": val,
            "common_step": common,
            "train_loss_at_common_step": mid["loss"],
            "gap_pct": 100.0 * (mid["loss"] - ref["loss"]) / ref["loss"],
            "tokens_per_s": last["tokens_per_s"],
            "skipped": last.get("skipped", 0),
        }
        records.append(rec)
    ref_val = records[0]["val_loss"]
    for rec in records:
        both = rec["val_loss"] is not None and ref_val is not None
        rec["val_gap_pct"] = 100.0 * (rec["val_loss"] - ref_val) / ref_val if both else None
    return records


def plot(runs: dict[str, list[dict]], order: list[str], path: Path, title: str) -> None:
    """Left: train loss per recipe. Right: its gap in % to the first recipe at the same step."""
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab20" if len(order) > 10 else "tab10")
    ref = {r["step"]: r["loss"] for r in runs[order[0]]}
    for i, name in enumerate(order):
        rows = runs[name]
        color = colors(i)
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o", markersize=3,
                color=color, label=name)  # fmt: skip
        common = [r for r in rows if r["step"] in ref]
        gap.plot([r["step"] for r in common],
                 [100.0 * (r["loss"] - ref[r["step"]]) / ref[r["step"]] for r in common],
                 color=color, label=name)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (mean over the log window)")
    ax.set_title(title)
    gap.set_xlabel("step")
    gap.set_ylabel(f"train-loss gap to {order[0]} (%)")
    gap.axhline(0.0, color="black", linewidth=0.8)
    for a in (ax, gap):
        a.grid(alpha=0.3)
    gap.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(records: list[dict]) -> str:
    def num(v, fmt, unit=""):
        return "n/a" if v is None else format(v, fmt) + unit

    lines = [
        "| recipe | tokens | train loss (last) | val loss | val gap | train loss @ common step |"
        " gap @ common step | tokens/s | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['recipe']} | {r['tokens'] / 1e6:.1f}M | {r['train_loss']:.4f} | "
            f"{num(r['val_loss'], '.4f')} | {num(r['val_gap_pct'], '+.2f', '%')} | "
            f"{r['train_loss_at_common_step']:.4f} (step {r['common_step']}) | "
            f"{r['gap_pct']:+.2f}% | {r['tokens_per_s']:,.0f} | {r['skipped']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens-per-step", type=int, default=32 * 1024)
    ap.add_argument("--order", default=None, help="comma-separated recipes, reference first")
    ap.add_argument("--name", required=True, help="output file stem under --out-dir")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--layer-sqnr", action="store_true", help="add layer SQNR summaries")
    args = ap.parse_args()
    runs = load(args.run_dir)
    order = args.order.split(",") if args.order else list(runs)
    records = summarize(runs, order, args.tokens_per_step, args.model)
    if args.layer_sqnr:
        for rec in records:
            rec["layer_sqnr"] = layer_sqnr(args.run_dir, rec["recipe"])
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, order, out / f"{args.name}.png", f"{args.model}: train loss by recipe")
    (out / f"{args.name}.json").write_text(json.dumps(records, indent=1) + "\n")
    table = markdown(records)
    print(table)
    (out / f"{args.name}_table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
