"""Paired numerics variants over seeds: each run's validation-loss gap to a reference run of the
same seed, at every evaluation, from `benchmarks/side_by_side.sh`'s layout
(DIR/seed<S>/<run>/metrics.jsonl).

Runs of one seed share initial weights and data order, so their gap measures the variant alone;
two runs that differ in any numerics still drift apart by up to ~1 % at 125M after 600 steps
(docs/hopper_sessions.md, session 37), so one seed resolves ~1 % and the mean over seeds is
what a default is chosen by:

    python benchmarks/paired_seeds.py benchmarks/results/runs_s39_fp4_direct_fast \
        --ref fp4-direct --name fast_accum_fp4_direct_125M_seeds_h200_2026-11-28
    -> benchmarks/results/<name>.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence_report import load, val_losses  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def paired_gaps(root: Path, ref: str) -> list[dict]:
    """One record per seed and run other than `ref`: its gap in % of the reference's validation
    loss at every step both evaluated, and at the last of them."""
    records = []
    for seed_dir in sorted(root.glob("seed*"), key=lambda p: int(p.name[4:])):
        runs = load(seed_dir)
        if ref not in runs:
            raise SystemExit(f"paired_seeds: {seed_dir} has no run {ref!r}")
        ref_loss = val_losses(runs[ref])
        for name in sorted(n for n in runs if n != ref):
            loss = val_losses(runs[name])
            steps = sorted(set(loss) & set(ref_loss))
            if not steps:
                continue
            gaps = {s: 100 * (loss[s] / ref_loss[s] - 1) for s in steps}
            records.append(
                {
                    "seed": int(seed_dir.name[4:]),
                    "run": name,
                    "ref": ref,
                    "gaps_pct": gaps,
                    "final_step": steps[-1],
                    "final_gap_pct": gaps[steps[-1]],
                    "ref_val_loss": ref_loss[steps[-1]],
                    "val_loss": loss[steps[-1]],
                }
            )
    return records


def summary(records: list[dict]) -> list[dict]:
    """Per run: its final gaps over seeds, their mean and sample standard deviation."""
    out = []
    for run in dict.fromkeys(r["run"] for r in records):
        finals = [r["final_gap_pct"] for r in records if r["run"] == run]
        out.append(
            {
                "run": run,
                "final_gaps_pct": finals,
                "mean_pct": statistics.fmean(finals),
                "std_pct": statistics.stdev(finals) if len(finals) > 1 else None,
            }
        )
    return out


def markdown(records: list[dict], rows: list[dict], ref: str) -> str:
    lines = [
        f"Validation-loss gap of each run to `{ref}` of the same seed, in %"
        " (negative: lower loss).",
        "",
        "| run | seed | val loss (ref) | gap at each evaluation (step: %) | final gap |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        steps = ", ".join(f"{s}: {g:+.2f}" for s, g in r["gaps_pct"].items())
        lines.append(
            f"| {r['run']} | {r['seed']} | {r['val_loss']:.4f} ({r['ref_val_loss']:.4f}) | "
            f"{steps} | {r['final_gap_pct']:+.2f} % |"
        )
    lines += ["", "| run | final gaps | mean | std |", "|---|---|---|---|"]
    for row in rows:
        std = "—" if row["std_pct"] is None else f"{row['std_pct']:.2f} %"
        gaps = ", ".join(f"{g:+.2f}" for g in row["final_gaps_pct"])
        lines.append(f"| {row['run']} | {gaps} | {row['mean_pct']:+.2f} % | {std} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="side_by_side.sh's folder (seed<S>/<run>/...)")
    parser.add_argument("--ref", required=True, help="the run every other is compared with")
    parser.add_argument("--name", required=True, help="results file stem")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    records = paired_gaps(args.root, args.ref)
    if not records:
        raise SystemExit(f"paired_seeds: no run beside {args.ref!r} under {args.root}")
    rows = summary(records)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cmd = f"`python benchmarks/paired_seeds.py {args.root} --ref {args.ref} --name {args.name}`"
    body = f"# {args.name}\n\n{cmd}\n\n{markdown(records, rows, args.ref)}"
    (args.out_dir / f"{args.name}.md").write_text(body)
    payload = {"records": records, "summary": rows}
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    print(body)


if __name__ == "__main__":
    main()
