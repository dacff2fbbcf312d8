"""Per-layer quantization SQNR over training, from the `layer_sqnr` records of runs' metrics.jsonl.

`minifloat train --sqnr-every N` (or `compare`) logs, every N steps, the SQNR in dB of each
quantized operand (input, weight, grad_output, grad_output_t) and of the output of every quantized
layer, measured on a fixed validation batch (src/minifloat/diagnostics.py). This script answers
"which layers and operands suffer, and does it get worse": a markdown table of the mean over
layers and of the worst layer per operand, first -> last measurement; the last measurement's
SQNR by layer type (depth averaged out); a PNG of the mean and worst SQNR over training.

    python benchmarks/layer_sqnr_report.py RUN_DIR [RUN_DIR ...] --name NAME [--out-dir DIR]

A RUN_DIR is a run directory (holding metrics.jsonl) or a directory of runs (*/metrics.jsonl);
runs without layer_sqnr records (bf16) are skipped. Writes NAME.md, NAME.png and NAME.json.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minifloat.diagnostics import OPERANDS, summarize  # noqa: E402

Records = list[tuple[int, dict[str, dict[str, float | None]]]]


def load(paths: list[Path]) -> dict[str, Records]:
    """{run name: [(step, layer_sqnr), ...]} for every run that logged layer SQNR."""
    files = []
    for path in paths:
        files += (
            [path / "metrics.jsonl"]
            if (path / "metrics.jsonl").is_file()
            else sorted(path.glob("*/metrics.jsonl"))
        )
    runs: dict[str, Records] = {}
    for file in files:
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        records = [(r["step"], r["layer_sqnr"]) for r in rows if "layer_sqnr" in r]
        name = file.parent.name
        if name in runs:  # the same recipe under two parents (e.g. 125M/fp4 and 50M/fp4)
            name = f"{file.parent.parent.name}/{name}"
        if records:
            runs[name] = records
    return runs


def layer_type(name: str) -> str:
    """The layer's name without its block prefix: layers.3.attention.wq -> attention.wq."""
    return re.sub(r"^.*?\d+\.", "", name) if re.search(r"\.\d+\.", name) else name


def by_type(layers: dict[str, dict[str, float | None]], operand: str) -> dict[str, float]:
    """Mean SQNR of `operand` per layer type."""
    groups: dict[str, list[float]] = {}
    for name, values in layers.items():
        if values.get(operand) is not None:
            groups.setdefault(layer_type(name), []).append(values[operand])
    return {k: round(sum(v) / len(v), 3) for k, v in groups.items()}


def summary(runs: dict[str, Records]) -> dict[str, dict]:
    """Per run: steps measured, first/last summaries, the last measurement's per-type means."""
    out = {}
    for name, records in runs.items():
        (first_step, first), (last_step, last) = records[0], records[-1]
        out[name] = {
            "steps": [step for step, _ in records],
            "first_step": first_step,
            "last_step": last_step,
            "first": summarize(first),
            "last": summarize(last),
            "last_by_type": {op: by_type(last, op) for op in OPERANDS},
            "worst_last": {op: _worst(first, last, op) for op in OPERANDS},
        }
    return out


def _worst(first: dict, last: dict, operand: str, k: int = 3) -> list[dict]:
    """The k layers with the lowest SQNR at the last measurement, with their first value."""
    values = {n: v[operand] for n, v in last.items() if v.get(operand) is not None}
    names = sorted(values, key=values.get)[:k]
    return [{"layer": n, "first_db": first.get(n, {}).get(operand), "last_db": values[n]}
            for n in names]  # fmt: skip


def _db(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def markdown(stats: dict[str, dict]) -> str:
    lines = [
        "| run | operand | mean over layers, first -> last (dB) | worst layer (last) "
        "| its first -> last (dB) |",
        "|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        for op in OPERANDS:
            if op not in s["last"]:
                continue
            first_mean = s["first"].get(op, {}).get("mean_db")
            worst = s["worst_last"][op][0]
            lines.append(
                f"| {name} | {op} | {_db(first_mean)} -> {_db(s['last'][op]['mean_db'])} "
                f"| {worst['layer']} | {_db(worst['first_db'])} -> {_db(worst['last_db'])} |"
            )
    types = sorted({t for s in stats.values() for t in s["last_by_type"]["output"]})
    lines += [
        "",
        "Output SQNR (dB) at the last measurement, by layer type (mean over depth):",
        "",
        "| run | " + " | ".join(types) + " |",
        "|---|" + "---:|" * len(types),
    ]
    for name, s in stats.items():
        cells = [_db(s["last_by_type"]["output"].get(t)) for t in types]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, Records], path: Path, title: str) -> None:
    """One panel per operand: mean over layers (solid) and worst layer (dotted) per run."""
    fig, axes = plt.subplots(1, len(OPERANDS), figsize=(4 * len(OPERANDS), 4), sharex=True)
    colors = plt.get_cmap("tab20" if len(runs) > 10 else "tab10")
    for i, (name, records) in enumerate(runs.items()):
        steps = [step for step, _ in records]
        sums = [summarize(layers) for _, layers in records]
        for ax, op in zip(axes, OPERANDS, strict=True):
            mean = [s.get(op, {}).get("mean_db") for s in sums]
            low = [s.get(op, {}).get("min_db") for s in sums]
            ax.plot(steps, mean, marker="o", markersize=3, color=colors(i), label=name)
            ax.plot(steps, low, ":", color=colors(i))
    for ax, op in zip(axes, OPERANDS, strict=True):
        ax.set_title(op)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SQNR (dB): mean over layers, dotted: worst layer")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dirs", type=Path, nargs="+")
    ap.add_argument("--name", required=True, help="output file stem")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--title", default="per-layer quantization SQNR over training")
    args = ap.parse_args()
    runs = load(args.run_dirs)
    if not runs:
        raise SystemExit(f"no layer_sqnr records under {', '.join(map(str, args.run_dirs))}")
    stats = summary(runs)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(runs, args.out_dir / f"{args.name}.png", args.title)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(stats, indent=1) + "\n")
    table = markdown(stats)
    (args.out_dir / f"{args.name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
