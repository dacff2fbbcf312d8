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

Several folders pool their seeds (each seed in one folder only), so that a later call's seeds
join a stored run's: `paired_seeds.py runs_s86_fp4_tiefix DIR_OF_SEEDS_6_7_8 --ref ...`. The
summary gives each run's mean final gap with its standard error and t = mean / standard error
(with n - 1 degrees of freedom for n seeds).
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


def pooled_gaps(roots: list[Path], ref: str) -> list[dict]:
    """`paired_gaps` of several folders together, sorted by run, then seed. A folder with no
    seed<S> folder is refused (a mistyped path would silently drop its seeds), and so is a seed
    found in two folders (its pairs would count twice)."""
    records, seen = [], {}
    for root in roots:
        seed_dirs = list(root.glob("seed*"))
        if not seed_dirs:
            raise SystemExit(f"paired_seeds: no seed<S> folder under {root}")
        for seed_dir in seed_dirs:
            seed = int(seed_dir.name[4:])
            if seed in seen:
                raise SystemExit(f"paired_seeds: seed {seed} is in {seen[seed]} and {root}")
            seen[seed] = root
        records += paired_gaps(root, ref)
    return sorted(records, key=lambda r: (r["run"], r["seed"]))


def summary(records: list[dict]) -> list[dict]:
    """Per run: its final gaps over seeds, their mean, sample standard deviation, the mean's
    standard error and t = mean / standard error. The standard deviation and error are None for
    one seed; t is None for one seed or a spread of zero."""
    out = []
    for run in dict.fromkeys(r["run"] for r in records):
        finals = [r["final_gap_pct"] for r in records if r["run"] == run]
        mean = statistics.fmean(finals)
        std = statistics.stdev(finals) if len(finals) > 1 else None
        se = None if std is None else std / len(finals) ** 0.5
        out.append(
            {
                "run": run,
                "final_gaps_pct": finals,
                "mean_pct": mean,
                "std_pct": std,
                "se_pct": se,
                "t": mean / se if se else None,
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
    lines += [
        "",
        "| run | final gaps | mean | std | standard error | t (n - 1 df) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        std = "—" if row["std_pct"] is None else f"{row['std_pct']:.2f} %"
        se = "—" if row["se_pct"] is None else f"{row['se_pct']:.2f} %"
        t = "—" if row["t"] is None else f"{row['t']:+.1f} ({len(row['final_gaps_pct']) - 1})"
        gaps = ", ".join(f"{g:+.2f}" for g in row["final_gaps_pct"])
        lines.append(f"| {row['run']} | {gaps} | {row['mean_pct']:+.2f} % | {std} | {se} | {t} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "roots", type=Path, nargs="+", help="side_by_side.sh's folders (seed<S>/<run>/...)"
    )
    parser.add_argument("--ref", required=True, help="the run every other is compared with")
    parser.add_argument("--name", required=True, help="results file stem")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    roots = " ".join(map(str, args.roots))
    records = pooled_gaps(args.roots, args.ref)
    if not records:
        raise SystemExit(f"paired_seeds: no run beside {args.ref!r} under {roots}")
    rows = summary(records)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cmd = f"`python benchmarks/paired_seeds.py {roots} --ref {args.ref} --name {args.name}`"
    body = f"# {args.name}\n\n{cmd}\n\n{markdown(records, rows, args.ref)}"
    (args.out_dir / f"{args.name}.md").write_text(body)
    payload = {"records": records, "summary": rows}
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    print(body)


if __name__ == "__main__":
    main()
