"""Where a training step's time goes, per recipe: step throughput and the top GPU kernels.

    PYTHONPATH=src python benchmarks/train_profile.py --data .carry/english.xz \
        [--model 125M] [--recipes bf16,fp8-rowwise,fp4-dge,fp4] [--compile] [--out-dir DIR]

For each recipe the real Trainer (same data, seed and model) runs `--warmup` steps (compilation
included), then `--steps` timed steps (wall clock between CUDA syncs, so the optimizer, clipping
and the guard's host sync are counted as in training), then `--profile-steps` steps under the
torch profiler. The profile gives the GPU kernel time per step: a step whose wall time is well
above its kernel time is bound by the host (Python, launches, syncs), not by the GPU. The table
lists the kernels that take the most time, grouped by name. Results:
benchmarks/results/train_profile_<gpu>_<date>.md + .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import kernel_times, write_results  # noqa: E402
from minifloat.train import Trainer  # noqa: E402
from minifloat.train.build import load_dataset  # noqa: E402
from minifloat.train.config import TrainConfig  # noqa: E402

TOP_KERNELS = 8


def _kernel_table(prof, steps: int) -> tuple[float, list[tuple[str, float, int]]]:
    """(kernel ms per step, [(kernel name, ms per step, launches per step)] by time)."""
    ms, launches = kernel_times(prof, steps)
    ranked = sorted(ms, key=ms.get, reverse=True)
    return sum(ms.values()), [(name, ms[name], round(launches[name])) for name in ranked]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_recipe(config: TrainConfig, dataset, args: argparse.Namespace) -> dict:
    """Throughput and kernel breakdown of one recipe's training step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trainer = Trainer(config, dataset=dataset, progress=False)
    try:
        for _ in range(args.warmup):
            trainer.train_step()
        _sync(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        _sync(args.device)
        step_ms = (time.perf_counter() - start) * 1000.0 / args.steps
        with profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                trainer.train_step()
            _sync(args.device)
        kernel_ms, kernels = _kernel_table(prof, args.profile_steps)
        tokens = config.batch_size * config.seq_len
        return {
            "recipe": config.recipe,
            "step_ms": step_ms,
            "kernel_ms": kernel_ms,
            "tokens_per_s": tokens / step_ms * 1000.0,
            "launches_per_step": sum(n for _, _, n in kernels),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "top_kernels": kernels[:TOP_KERNELS],
        }
    finally:
        trainer.close()
        if cuda:
            torch.cuda.reset_peak_memory_stats()


def _markdown(records: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"Model {args.model}, batch {args.batch_size} x {args.seq_len} tokens, "
        f"{'compiled' if args.compile else 'eager'}; {args.steps} timed steps after "
        f"{args.warmup} warm-up steps; kernels from {args.profile_steps} profiled steps.",
        "",
        "| recipe | step ms | GPU kernel ms | tokens/s | vs first | kernel launches | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    base = records[0]["tokens_per_s"]
    for r in records:
        lines.append(
            f"| {r['recipe']} | {r['step_ms']:.1f} | {r['kernel_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | "
            f"{r['launches_per_step']} | {r['peak_mem_gib']:.1f} |"
        )
    for r in records:
        lines += ["", f"### {r['recipe']}: top kernels per step", ""]
        lines += ["| kernel | ms | launches |", "|---|---|---|"]
        for name, ms, n in r["top_kernels"]:
            lines.append(f"| `{name[:90]}` | {ms:.2f} | {n} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="125M")
    ap.add_argument("--recipes", default="bf16,fp8-tensorwise,fp8-rowwise,fp4-direct,fp4-dge,fp4")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--device", default="cuda", help="cpu only to check the script itself")
    ap.add_argument(
        "--prepend",
        default=None,
        help="a results .json of an earlier call (same settings) whose "
        "records come first: long recipe lists split over several 10-minute calls",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("train_profile.py needs a CUDA GPU")
    run_dir = tempfile.mkdtemp(prefix="train_profile_")
    common = dict(
        model=args.model,
        data=args.data,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.warmup + args.steps + args.profile_steps,
        compile=args.compile,
        # one graph, as this script's committed results (the trainer's default is per block)
        compile_scope="model" if args.compile else None,
        device=args.device,
        eval_batches=0,
        save_checkpoints=False,
        out_dir=run_dir,
    )
    dataset = load_dataset(TrainConfig(**common), progress=False)
    stem = "train_profile_compiled" if args.compile else "train_profile"
    kwargs = {"out_dir": Path(args.out_dir)} if args.out_dir else {}
    records = json.loads(Path(args.prepend).read_text()) if args.prepend else []
    for name in args.recipes.split(","):
        record = profile_recipe(TrainConfig(recipe=name, **common), dataset, args)
        records.append(record)
        print(
            f"{name}: {record['step_ms']:.1f} ms/step ({record['kernel_ms']:.1f} ms of kernels), "
            f"{record['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
        # Rewritten after every recipe, so a run cut short still leaves what it measured.
        md, js = write_results(stem, records, _markdown(records, args), **kwargs)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
