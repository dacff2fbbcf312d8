"""Two profiled `train_e2e.py` records side by side: what a change did to the step, and in which
kernels.

A change to a quantizer can look faster in its kernel sums and still make the step slower: GEMM
time moves 0.4-0.8 ms between processes (the GPU under its power cap), hiding a quantizer's
0.5 ms; launches added show as GPU idle in the default mode and vanish under CUDA graphs; and
inductor renames its kernels from one tree to the next. Session 98 read session 95's fold kernel
that way by hand (docs/hopper_sessions.md); this prints the same tables:

    python benchmarks/profile_diff.py BASE.json NEW.json [--recipe R] [--min-ms 0.03] [--exact]

BASE and NEW are results files of `train_e2e.py --profile` (e.g. the two trees'
`profile_trees.sh` returns). The step table sets the unprofiled step (median and streamed)
beside the profiled kernel sums, split into GEMMs, attention, inductor's Triton kernels
(`triton_*`), our own Triton kernels (`_*_kernel`) and the rest, with the kernel count and the
GPU's idle time. The kernel table lists, per kernel family (inductor's name without its trailing
number, which changes between trees; `--exact` keeps whole names), ms and launches a step in
each, the families that moved by at least --min-ms or changed their launch count.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_STEP_KEYS = (
    ("step_ms", "step ms (median, unprofiled)"),
    ("stream_step_ms", "streamed step ms"),
    ("host_ms", "host ms"),
    ("kernel_ms", "kernel ms (profiled)"),
    ("gemm_ms", "GEMM ms"),
    ("attention_ms", "attention ms"),
    ("triton_inductor_ms", "inductor Triton ms"),
    ("triton_ours_ms", "our Triton ms"),
    ("rest_ms", "other kernels ms"),
    ("kernels_per_step", "kernels/step"),
    ("idle_ms", "GPU idle ms"),
)


def load(path: str | Path, recipe: str | None = None) -> dict:
    """The profiled record (one with a kernel list) of a train_e2e.py results file; with several,
    the one of `recipe`."""
    records = json.loads(Path(path).read_text())
    records = records if isinstance(records, list) else [records]
    found = [r for r in records if r.get("kernels") and (recipe is None or r["recipe"] == recipe)]
    if len(found) != 1:
        names = [r.get("recipe") for r in records if r.get("kernels")]
        want = f"recipe {recipe!r}" if recipe else "one profiled record (pass --recipe)"
        raise ValueError(f"{path}: want {want}; its profiled records are {names}")
    return found[0]


def family(name: str) -> str:
    """Inductor's kernel name without its trailing number (`triton_..._add_7` -> `..._add`)."""
    return re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name


def step_summary(record: dict) -> dict:
    """The step's times and the profiled kernel time by kind (ms a step)."""
    kernels = record["kernels"]
    inductor = sum(ms for name, ms, _ in kernels if name.startswith("triton_"))
    ours = sum(ms for name, ms, _ in kernels if name.startswith("_") and name.endswith("_kernel"))
    split = record["gemm_ms"] + record["attention_ms"] + inductor + ours
    return {
        "step_ms": record["step_ms"],
        "stream_step_ms": record.get("stream_step_ms"),
        "host_ms": record.get("host_ms"),
        "kernel_ms": record["kernel_ms"],
        "gemm_ms": record["gemm_ms"],
        "attention_ms": record["attention_ms"],
        "triton_inductor_ms": inductor,
        "triton_ours_ms": ours,
        "rest_ms": record["kernel_ms"] - split,
        "kernels_per_step": record["kernels_per_step"],
        "idle_ms": (record.get("timeline") or {}).get("idle_ms"),
    }


def kernel_changes(base: dict, new: dict, *, min_ms: float = 0.03, exact: bool = False) -> list:
    """(key, base ms, base launches, new ms, new launches) a step for each kernel family (or
    name) whose time moved by at least `min_ms` or whose launch count changed, by the change."""

    def grouped(record: dict) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for name, ms, launches in record["kernels"]:
            acc = out.setdefault(name if exact else family(name), [0.0, 0])
            acc[0] += ms
            acc[1] += launches
        return out

    a, b = grouped(base), grouped(new)
    rows = []
    for key in sorted(set(a) | set(b)):
        ams, alaunch = a.get(key, (0.0, 0))
        bms, blaunch = b.get(key, (0.0, 0))
        if abs(bms - ams) >= min_ms or alaunch != blaunch:
            rows.append((key, ams, alaunch, bms, blaunch))
    return sorted(rows, key=lambda r: r[3] - r[1])


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def report(base: dict, new: dict, *, names: tuple[str, str], min_ms: float, exact: bool) -> str:
    """The two tables as markdown."""
    sa, sb = step_summary(base), step_summary(new)
    lines = [
        f"Base: {names[0]} ({base['recipe']}); new: {names[1]} ({new['recipe']}).",
        "",
        "| | base | new | new - base |",
        "|---|---|---|---|",
    ]
    for key, label in _STEP_KEYS:
        a, b = sa[key], sb[key]
        digits = 0 if key == "kernels_per_step" else 2
        diff = None if a is None or b is None else b - a
        sign = "+" if diff is not None and diff > 0 else ""
        lines.append(
            f"| {label} | {_num(a, digits)} | {_num(b, digits)} | {sign}{_num(diff, digits)} |"
        )
    rows = kernel_changes(base, new, min_ms=min_ms, exact=exact)
    what = "kernel" if exact else "kernel family"
    lines += [
        "",
        f"Each {what} whose time moved by >= {min_ms} ms a step or whose launches changed "
        f"({len(rows)}), by the change:",
        "",
        "| new - base ms | base ms (launches) | new ms (launches) | kernel |",
        "|---|---|---|---|",
    ]
    for key, ams, alaunch, bms, blaunch in rows:
        lines.append(
            f"| {bms - ams:+.3f} | {ams:.3f} ({alaunch}) | {bms:.3f} ({blaunch}) | `{key}` |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="train_e2e.py results JSON with a profiled record")
    parser.add_argument("new", help="the same for the change")
    parser.add_argument("--recipe", help="the record's recipe where a file holds several")
    parser.add_argument("--min-ms", type=float, default=0.03, help="smallest move listed (ms)")
    parser.add_argument("--exact", action="store_true", help="whole kernel names, no families")
    args = parser.parse_args(argv)
    if not args.min_ms >= 0:
        parser.error(f"--min-ms must be >= 0, got {args.min_ms}")
    try:
        base, new = load(args.base, args.recipe), load(args.new, args.recipe)
    except (OSError, ValueError) as err:
        print(f"profile_diff: {err}", file=sys.stderr)
        return 2
    names = (Path(args.base).name, Path(args.new).name)
    sys.stdout.write(report(base, new, names=names, min_ms=args.min_ms, exact=args.exact))
    return 0


if __name__ == "__main__":
    sys.exit(main())
