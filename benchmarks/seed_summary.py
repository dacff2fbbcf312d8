"""Combine one study's reports over several seeds: each run's gap to the reference per seed, mean,
spread, and the target it is judged against.

A gap below ~0.5 % at 125M is within what the reference itself moves between seeds (bf16's
validation loss moved 0.55 % between seeds 0 and 1 of the 100M-token switch study), so a single
seed cannot say whether a recipe meets a 0.3-0.5 % target. Each input is the JSON that
`benchmarks/convergence_report.py` writes for one seed (all against the same reference, bf16);
runs missing from a seed's report are left out of that seed's column, not counted as zero:

    python benchmarks/seed_summary.py benchmarks/results/switch_125M_100M_h200_2026-11-24.json \
        benchmarks/results/switch_125M_100M_seed1_h200_2026-11-24.json \
        benchmarks/results/switch_125M_100M_seed2_h200_2026-11-24.json \
        --name switch_125M_100M_seeds_h200_2026-11-24
    -> benchmarks/results/<name>.{md,json}

Targets are issue 15's (fp4 within 1.5 % of bf16, fp4 with the final-phase switch within 0.5 %,
fp8-* within 0.3 %); a run meets its target when its mean gap is at most the target.
`std` is the sample standard deviation over seeds (None with one seed). A switched run
(`fp4+switch=...`) also gets its paired gain over its plain run (`fp4`) per seed, the difference
of their validation losses in % of the plain run's: both share every step before the switch, so
this comparison does not carry the reference's seed-to-seed spread. The reference's own
validation loss per seed is listed under the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def target_pct(recipe: str) -> float | None:
    """Issue 15's target for a run name (its gap to bf16 in %), or None for runs without one."""
    if "+switch=bf16" in recipe and recipe.startswith("fp4"):
        return 0.5
    if recipe.startswith("fp8-"):
        return 0.3
    if recipe == "fp4":
        return 1.5
    return None


def summarize(reports: list[list[dict]], *, key: str = "gap_pct") -> list[dict]:
    """One record per run name (in first-seen order) with its gaps per seed (None where a seed did
    not run it), their mean and sample std, the target, and whether the mean meets it."""
    names: list[str] = []
    for records in reports:
        names += [r["recipe"] for r in records if r["recipe"] not in names]
    out = []
    for name in names:
        gaps = [next((r[key] for r in records if r["recipe"] == name), None) for records in reports]
        ran = [g for g in gaps if g is not None]
        mean = statistics.fmean(ran) if ran else None
        target = target_pct(name)
        out.append({
            "recipe": name, "gaps_pct": gaps, "seeds": len(ran), "mean_gap_pct": mean,
            "std_gap_pct": statistics.stdev(ran) if len(ran) > 1 else None,
            "min_gap_pct": min(ran) if ran else None, "max_gap_pct": max(ran) if ran else None,
            "target_pct": target,
            "meets_target": None if target is None or mean is None else mean <= target,
        })  # fmt: skip
        if "+switch=" in name:
            out[-1]["vs_plain_pct"] = _paired(reports, name, name.split("+", 1)[0])
    return out


def _paired(reports: list[list[dict]], name: str, plain: str) -> list[float | None]:
    """Per seed, `name`'s validation loss against `plain`'s in % (None where one is missing)."""
    gains = []
    for records in reports:
        by = {r["recipe"]: r.get("val_loss") for r in records}
        a, b = by.get(name), by.get(plain)
        gains.append(None if a is None or b is None else 100.0 * (a / b - 1.0))
    return gains


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f} %"


def markdown(rows: list[dict], sources: list[tuple[str, float]]) -> str:
    """The table: one column per seed, then mean ± std, range and the target. `sources`: each
    seed's report file name and its reference's validation loss."""
    head = [f"seed {i}" for i in range(len(sources))]
    lines = [
        "| run | " + " | ".join(head) + " | mean (± std) | range | target | met |",
        "|---|" + "---:|" * len(head) + "---:|---:|---:|---|",
    ]
    for r in rows:
        std = "" if r["std_gap_pct"] is None else f" (± {r['std_gap_pct']:.2f})"
        met = {None: "—", True: "yes", False: "no"}[r["meets_target"]]
        target = "—" if r["target_pct"] is None else f"{r['target_pct']:.1f} %"
        lines.append(
            f"| {r['recipe']} | " + " | ".join(_pct(g) for g in r["gaps_pct"])
            + f" | {_pct(r['mean_gap_pct'])}{std} | {_pct(r['min_gap_pct'])} .. "
            f"{_pct(r['max_gap_pct'])} | {target} | {met} |"
        )  # fmt: skip
    for r in rows:
        if "vs_plain_pct" in r:
            plain = r["recipe"].split("+", 1)[0]
            lines += ["", f"{r['recipe']} against {plain}, paired per seed: "
                      + ", ".join(_pct(g) for g in r["vs_plain_pct"])]  # fmt: skip
    lines += ["", "Seeds, in column order (validation-loss gap to the reference at the last "
              "evaluation; the reference's validation loss):"]  # fmt: skip
    lines += [f"- seed {i}: `{s}` ({ref:.4f})" for i, (s, ref) in enumerate(sources)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="convergence_report JSON, one per seed")
    ap.add_argument("--name", required=True, help="output file stem under --out-dir")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--key", default="gap_pct", help="the record field to combine")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        ap.error(f"no such report: {', '.join(missing)}")
    reports = [json.loads(p.read_text()) for p in args.reports]
    rows = summarize(reports, key=args.key)
    sources = [(p.name, r[0]["val_loss"]) for p, r in zip(args.reports, reports, strict=True)]
    text = markdown(rows, sources)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out_dir / f"{args.name}.md").write_text(text)
    print(text, end="")
    return rows


if __name__ == "__main__":
    main()
