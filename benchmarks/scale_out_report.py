"""The report of the scale-out benchmark: steady-state speed, MFU, memory and loss curves.

Reads the run directories `benchmarks/scale_out.py run` wrote (the trainer's metrics.jsonl and
the chunk records of scale_out.jsonl) and writes `scale_out_<gpu>_<date>.md`, its `.json` twin
and an overlaid loss-curve PNG. `python benchmarks/scale_out.py report` is the entry point.

A run with the quantized weight all-gather (`run --quantized-all-gather`, directory
`<model>_<recipe>+qag`) is a row of its own; where the plain run of the same model, GPU count
and recipe is there too, the row gives its tokens/s and all-gather bytes relative to that run.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minifloat.train import TrainResult  # noqa: E402
from minifloat.train.metrics import mfu  # noqa: E402

__all__ = [
    "BASELINE_RECIPE",
    "DONE_NAME",
    "QAG_SUFFIX",
    "RECORDS_NAME",
    "TORCHAO_RECIPE",
    "add_qag_ratios",
    "load_run",
    "summarize",
    "timed_steps",
    "write_report",
]

RECORDS_NAME = "scale_out.jsonl"  # one "start" and one "end" record per chunk (rank 0 writes)
DONE_NAME = "DONE"  # written into a run directory when the run has all its steps
BASELINE_RECIPE = "bf16"
TORCHAO_RECIPE = "torchao-float8-tensorwise"  # bf16 + torchao's float8 layers (scale_out.py)
QAG_SUFFIX = "+qag"  # run directory and label of a run with the quantized weight all-gather


def load_run(path: Path) -> dict[str, Any]:
    """A run directory's chunk records and per-step metrics."""
    records = [json.loads(x) for x in (path / RECORDS_NAME).read_text().splitlines() if x.strip()]
    log = path / "metrics.jsonl"  # absent when the first chunk died before its first step
    metrics = [json.loads(x) for x in log.read_text().splitlines() if x] if log.is_file() else []
    starts = [r for r in records if r["event"] == "start"]
    if not starts:
        raise ValueError(f"{path}: no chunk records")
    steps: dict[int, dict[str, Any]] = {}
    for rec in metrics:  # one per step (log_every=1), skipped steps too; others are diagnostics
        if "loss" in rec and "tokens_per_s" in rec:
            steps[rec["step"]] = rec
    return {
        "name": path.name,
        "info": starts[0],
        "starts": starts,
        "ends": [r for r in records if r["event"] == "end"],
        "steps": steps,
        "done": (path / DONE_NAME).is_file(),
    }


def timed_steps(steps: Sequence[int], chunk_starts: Sequence[int], *, warmup: int,
                rewarm: int) -> list[int]:  # fmt: skip
    """The steady-state steps: after ``warmup``, and not among the first ``rewarm`` steps of a
    chunk that resumed from a checkpoint (its process compiles again).

    A step is attributed to the last chunk that started before it: a chunk cut off by a time
    limit leaves no records behind (the next chunk repeats its steps from the checkpoint).
    """
    out = []
    for step in steps:
        if step <= warmup:
            continue
        owner = max((s for s in chunk_starts if s < step), default=0)
        if owner > 0 and step <= owner + rewarm:
            continue
        out.append(step)
    return out


def summarize(run: dict[str, Any], *, rewarm: int) -> dict[str, Any]:
    """One results record: steady-state speed, MFU, peak memory, losses of one run."""
    info, steps = run["info"], run["steps"]
    starts = [s["start_step"] for s in run["starts"]]
    timed = timed_steps(sorted(steps), starts, warmup=info["warmup_steps"], rewarm=rewarm)
    tokens_per_step = info["tokens_per_step_per_gpu"] * info["gpus"]
    # The trainer logs tokens per step over the step's wall time; invert it for the time.
    times = [tokens_per_step / steps[s]["tokens_per_s"] for s in timed]
    per_gpu = info["tokens_per_step_per_gpu"] * len(times) / sum(times) if times else None
    peaks = [e["peak_mem_bytes"] for e in run["ends"] if e.get("peak_mem_bytes") is not None]
    last_end = run["ends"][-1] if run["ends"] else {}
    last_step = max(steps) if steps else 0
    return {
        "model": info["model"],
        "recipe": info["recipe"],
        "gpus": info["gpus"],
        "device": info["device"],
        "batch_size_per_gpu": info["batch_size"],
        "seq_len": info["seq_len"],
        "tokens_per_s_per_gpu": per_gpu,
        "mfu": mfu(info["flops_per_token"], per_gpu, info["peak_flops"]) if per_gpu else None,
        "peak_mem_gib": max(peaks) / 2**30 if peaks else None,
        "steps": last_step,
        "total_steps": info["total_steps"],
        "complete": run["done"],
        "steps_measured": len(times),
        "step_ms_median": 1000 * statistics.median(times) if times else None,
        "final_loss": last_end.get("final_loss"),
        "final_val_loss": last_end.get("final_val_loss"),
        "skipped_steps": steps[last_step].get("skipped", 0) if steps else 0,
        "chunks": len(run["ends"]),
        "chunk_wall_s": [round(e["wall_s"], 1) for e in run["ends"]],
        "float8_layers": last_end.get("float8_layers"),
        # Runs recorded before these fields existed: plain all-gather, bytes unknown.
        "quantized_allgather": bool(info.get("quantized_allgather", False)),
        "allgather_bytes_per_step": last_end.get("allgather_bytes_per_step"),
        "allgather_model_bytes": last_end.get("allgather_model_bytes"),
    }


def _label(record: dict[str, Any]) -> str:
    return record["recipe"] + (QAG_SUFFIX if record["quantized_allgather"] else "")


def add_qag_ratios(records: list[dict[str, Any]]) -> None:
    """Give every record ``qag_tokens_per_s_vs_plain`` and ``qag_allgather_bytes_vs_plain``:
    a quantized all-gather run's tokens/s per GPU and all-gather bytes per step over those of
    the plain run of the same model, GPU count and recipe; None for plain runs and where
    either run lacks the number."""
    ratios = {
        "qag_tokens_per_s_vs_plain": "tokens_per_s_per_gpu",
        "qag_allgather_bytes_vs_plain": "allgather_bytes_per_step",
    }
    plain = {(r["model"], r["gpus"], r["recipe"]): r for r in records
             if not r["quantized_allgather"]}  # fmt: skip
    for r in records:
        ref = plain.get((r["model"], r["gpus"], r["recipe"])) if r["quantized_allgather"] else None
        for key, field in ratios.items():
            mine, theirs = r[field], ref[field] if ref else None
            r[key] = mine / theirs if mine and theirs else None


def _curve(run: dict[str, Any], record: dict[str, Any]) -> TrainResult:
    """A TrainResult holding a run's per-step losses, for minifloat.train.compare.plot_losses."""
    steps = run["steps"]
    losses = tuple(steps[s]["loss"] for s in sorted(steps))
    vals = tuple((s, steps[s]["val_loss"]) for s in sorted(steps) if "val_loss" in steps[s])
    out_dir = Path(run["name"])
    return TrainResult(
        recipe=f"{_label(record)} ({record['model']}, {record['gpus']} GPUs)",
        model=record["model"],
        num_params=run["info"]["num_params"],
        steps=record["steps"],
        tokens=record["steps"] * run["info"]["tokens_per_step_per_gpu"] * record["gpus"],
        final_loss=record["final_loss"] if record["final_loss"] is not None else float("nan"),
        final_val_loss=record["final_val_loss"],
        tokens_per_s=(record["tokens_per_s_per_gpu"] or 0.0) * record["gpus"],
        peak_memory_bytes=None,
        skipped_steps=record["skipped_steps"],
        losses=losses,
        val_losses=vals,
        out_dir=out_dir,
        metrics_path=out_dir / "metrics.jsonl",
        checkpoint_path=None,
    )


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if value is None else format(value * scale, spec) + suffix


def _table(records: list[dict[str, Any]]) -> str:
    base = {
        (r["model"], r["gpus"]): r["tokens_per_s_per_gpu"]
        for r in records
        if r["recipe"] == BASELINE_RECIPE and not r["quantized_allgather"]
    }
    lines = [
        "| model | recipe | GPUs | tokens/s per GPU | vs bf16 | QAG | QAG vs plain | MFU "
        "| peak memory GiB | all-gather MB/step | steps | steps timed | step ms (median) "
        "| final loss | val loss | skipped | chunks |",
        "|---|---|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        ref = base.get((r["model"], r["gpus"]))
        speed = r["tokens_per_s_per_gpu"]
        ratio = speed / ref if speed and ref else None
        qag_ratio = r.get("qag_tokens_per_s_vs_plain")
        qag = "yes" if r["quantized_allgather"] else "no"
        steps = f"{r['steps']}" + ("" if r["complete"] else f" of {r['total_steps']}, incomplete")
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['gpus']} | {_fmt(speed, ',.0f')} "
            f"| {_fmt(ratio, '.2f', suffix='x')} | {qag} "
            f"| {_fmt(qag_ratio, '.2f', suffix='x') if r['quantized_allgather'] else '—'} "
            f"| {_fmt(r['mfu'], '.1f', 100, ' %')} | {_fmt(r['peak_mem_gib'], '.1f')} "
            f"| {_fmt(r['allgather_bytes_per_step'], ',.1f', 1e-6)} "
            f"| {steps} | {r['steps_measured']} "
            f"| {_fmt(r['step_ms_median'], '.0f')} | {_fmt(r['final_loss'], '.4f')} "
            f"| {_fmt(r['final_val_loss'], '.4f')} | {r['skipped_steps']} "
            f"| {r['chunks']} |"
        )
    return "\n".join(lines)


def _merged_env(runs: list[dict[str, Any]]) -> dict[str, str]:
    """Versions over all runs (e.g. torchao is on the path only for its own run)."""
    keys = dict.fromkeys(k for run in runs for k in run["info"]["env"])
    values = {k: sorted({str(run["info"]["env"].get(k)) for run in runs}) for k in keys}
    return {k: " / ".join(v for v in vals if v != "none") or "none" for k, vals in values.items()}


def _markdown(runs: list[dict[str, Any]], records: list[dict[str, Any]], *, rewarm: int,
              png: str, jobs: list[str], day: str) -> str:  # fmt: skip
    info = runs[0]["info"]
    env = "; ".join(f"{k}: {v}" for k, v in _merged_env(runs).items())
    commands = sorted({s["command"] for run in runs for s in run["starts"]})
    setup = (
        f"FSDP2 (fp32 weights, optimizer states and gradient reduce-scatter), "
        f"{'torch.compile' if info['compile'] else 'eager'}, sequence {info['seq_len']}, "
        f"{info['warmup_steps']} warm-up + {info['measure_steps']} measured steps per run; "
        f"steps timed = steps after the warm-up minus the first {rewarm} steps of every resumed "
        "chunk (recompilation). tokens/s per GPU = tokens of the timed steps / their summed "
        "step times; MFU = model FLOPs (6N + attention) x tokens/s per GPU / dense bf16 peak "
        "(989 TFLOP/s on H100/H200), for every recipe; peak memory = max_memory_allocated, "
        "maximum over ranks and chunks. Final loss: mean of the last 10 steps. "
        "QAG: FSDP2 all-gathers the QuantLinear weights quantized (`--quantized-all-gather`; "
        "1 byte a parameter for FP8, 0.5 for E2M1, plus travelling scales) instead of in fp32; "
        "QAG vs plain = its tokens/s per GPU over the plain run of the recipe. all-gather "
        "MB/step = 10^6 bytes the weight all-gathers of one step move, summed over the ranks' "
        "inputs: each block's parameters twice per micro-batch (forward, and again in backward: "
        "FSDP2 reshards after forward), the root's (embedding, final norm, head) once; other "
        "parameters at their stored dtype (fp32)."
    )
    parts = [
        f"# Scale-out training benchmark ({day})",
        "",
        f"{info['device']}; {env}",
        "",
        setup,
        "",
        _table(records),
        "",
        f"![loss curves]({png})",
        "",
        "## Commands",
        "",
        "Each run directory continues from its checkpoint, so every chunk of a run is the same "
        "command:",
        "",
        "```",
        *commands,
        "```",
    ]
    if jobs:
        parts += ["", "Device jobs (`benchmarks/scale_out.sh`):", "", "```", *jobs, "```"]
    return "\n".join(parts) + "\n"


def write_report(runs_root: Path, results_dir: Path, *, rewarm: int,
                 day: str | None = None) -> tuple[Path, Path, Path]:  # fmt: skip
    """Summarize every run under ``runs_root``; write <stem>.md, .json and .png."""
    from minifloat.train.compare import plot_losses

    paths = sorted(p.parent for p in Path(runs_root).glob(f"*/{RECORDS_NAME}"))
    if not paths:
        raise SystemExit(f"scale_out report: no runs under {runs_root}")
    runs = [load_run(p) for p in paths]
    # bf16 first (the reference), then the order the recipes are usually listed in.
    order = ["bf16", "fp8-tensorwise", "fp8-rowwise", "fp4", "fp4-dge", TORCHAO_RECIPE]
    runs.sort(key=lambda r: (r["info"]["model"], r["info"]["gpus"],
                             order.index(r["info"]["recipe"]) if r["info"]["recipe"] in order
                             else len(order), r["info"]["recipe"],
                             bool(r["info"].get("quantized_allgather"))))  # fmt: skip
    records = [summarize(run, rewarm=rewarm) for run in runs]
    add_qag_ratios(records)
    day = day or datetime.date.today().isoformat()
    stem = f"scale_out_{runs[0]['info']['gpu_tag']}_{day}"
    results_dir.mkdir(parents=True, exist_ok=True)
    png = plot_losses(
        [_curve(run, rec) for run, rec in zip(runs, records, strict=True)],
        results_dir / f"{stem}.png",
        title=f"training loss, {runs[0]['info']['device']}, sequence {runs[0]['info']['seq_len']}",
    )
    jobs_file = Path(runs_root) / "jobs.txt"
    jobs = jobs_file.read_text().splitlines() if jobs_file.is_file() else []
    md = results_dir / f"{stem}.md"
    md.write_text(_markdown(runs, records, rewarm=rewarm, png=png.name, jobs=jobs, day=day))
    twin = {
        "env": _merged_env(runs),
        "rewarm_steps": rewarm,
        "records": records,
        "commands": sorted({s["command"] for run in runs for s in run["starts"]}),
        "jobs": jobs,
        "losses": {r["name"]: [r["steps"][s]["loss"] for s in sorted(r["steps"])] for r in runs},
    }
    js = results_dir / f"{stem}.json"
    js.write_text(json.dumps(twin, indent=1) + "\n")
    return md, js, png
