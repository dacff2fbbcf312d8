"""Training throughput of a few rows timed in alternation, so that each sees the same GPU state.

    PYTHONPATH=src python benchmarks/train_interleaved.py --model 1.3B \
        [--rows bf16,torchao-tensorwise,fp8-tensorwise] [--rounds 8] [--steps 5] [--tag NAME]

`train_e2e.py` times its rows one after another, and a GPU's clocks follow its power draw and
temperature: in one session-29 run the output head's bf16 GEMMs, the same work in every row, took
8.30 ms a step in the second row and 8.76-9.16 ms in the fourth to sixth (memory-bound kernels
did not move), a few per cent of bias by a row's place in the run, as much as a target's margin
(fp8-tensorwise >= 1.05x torchao). Here every row is built, converted, compiled and warmed up
first and all are held on the GPU together (five 1.3B rows fit an H200: 15.3 GiB each between
steps plus one step's transient; an 80 GB H100 holds bf16's step beside one other 1.3B row, not
three: session 101), then timed in `--rounds` rounds of `--steps` steps, the rows'
order rotating each round, so every row runs early and late alike. Each round times the steps
one by one (CUDA events, a synchronization after each) and then as many back to back
("streamed", as `train_e2e.py`); a row's step time is the median over all its rounds' steps.

Rows, model presets, data, optimizer, loss and compilation are `train_e2e.py`'s (`--compile-scope
none` skips compilation: a CPU smoke test); a row `ROW~eager`, `ROW~compiled` or `ROW~chunked`
runs ROW with that loss in place of `--loss`'s (e.g. `bf16,bf16~eager`: the loss's own cost,
timed in alternation). Peak memory is a row's own: the most allocated while
it warmed up, less what the rows built before it held. While a row's steps run, a thread samples
the GPU's power draw, SM clock, temperature and clock-limit reasons (NVML, where available;
`gpu_sampler.py`), every 20 ms. Writes `train_interleaved_<model>_<impl>[_<tag>]_<gpu>_
<date>.{md,json}`; records hold `train_e2e.py`'s keys (`model`, `impl`, `recipe`, `tokens_per_s`,
`speedup_vs_bf16`, `speedup_vs_torchao_tensorwise`, `peak_mem_gib`, `mem_vs_bf16`, `gpu`,
`date`, `step_ms`, `stream_step_ms`, `loss`) plus `interleaved`, `rounds`, `round_ms` (each round's
median), `sm_clock_mhz` (the samples' median, None without NVML), and `gpu_samples` (medians of
power, clock and temperature, and the share of samples under each limit reason).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_e2e as e2e  # noqa: E402
from common import gpu_tag, write_results  # noqa: E402
from gpu_sampler import GpuSampler  # noqa: E402


def split_loss(row: str, default: str) -> tuple[str, str]:
    """`RECIPE[~LOSS]` -> (RECIPE, LOSS or `default`)."""
    recipe, _, loss = row.partition("~")
    return recipe, loss or default


def build_row(args, row: str, batches: list[torch.Tensor]) -> dict:
    """Row `row` converted, compiled and warmed up, with its own peak and resident memory."""
    cuda = args.device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    recipe, loss = split_loss(row, args.loss)
    net = e2e.prepare(
        e2e.build_model(args.model, args.impl, args.vocab, args.seq, args.device, args.layers),
        recipe,
    )
    if args.compile_scope != "none":
        net = e2e.compile_model(net, args.compile_scope, args.compile_mode, args.compile_options)
    chunks = "eager" if args.compile_scope == "none" else "compiled"  # none: nothing compiled
    step = e2e.make_step(net, e2e.make_optimizer(net, "fp32"), loss=loss, chunks=chunks)
    for i in range(args.warmup):
        step(batches[i % len(batches)])
        if i == 0:
            print(f"{row}: first step done", flush=True)
    e2e.sync_device(args.device)
    gib = 2.0**30
    return {
        "recipe": row, "loss": loss, "step": step, "times": [], "streamed": [],
        "round_ms": [], "samples": [],
        "peak_mem_gib": (torch.cuda.max_memory_allocated() - before) / gib if cuda else 0.0,
        "resident_gib": (torch.cuda.memory_allocated() - before) / gib if cuda else 0.0,
    }  # fmt: skip


def _failed(row: str, exc: Exception) -> dict:
    """An error record (as train_e2e.py's): the run goes on with the other rows."""
    traceback.print_exc()
    print(f"{row}: FAILED", flush=True)
    return {"recipe": row, "error": f"{type(exc).__name__}: {exc}"[-3000:]}


def time_rounds(
    args, rows: list[dict], batches: list[torch.Tensor], sampler: GpuSampler
) -> list[dict]:
    """`args.rounds` rounds of `args.steps` steps per row, the order rotating every round, the
    GPU sampled while each row steps. A row that fails leaves the rounds (its error record is
    returned); the others go on."""
    errors = []
    for r in range(args.rounds):
        if not rows:
            break
        k = r % len(rows)
        order = rows[k:] + rows[:k]
        for row in order:
            step = row["step"]
            try:
                with sampler.collect() as samples:
                    ms = [e2e.timed_step(step, batches[i % len(batches)])[0]
                          for i in range(args.steps)]  # fmt: skip
                    cuda = args.device == "cuda"
                    streamed = e2e.timed_stream(step, batches, args.steps) if cuda else []
            except Exception as exc:  # e.g. out of memory with every row held
                errors.append(_failed(row["recipe"], exc))
                rows.remove(row)
                continue
            row["times"] += ms
            row["streamed"] += streamed
            row["round_ms"].append(statistics.median(ms))
            row["samples"] += samples
        done = ", ".join(f"{w['recipe']} {w['round_ms'][-1]:.1f} ms" for w in order if w in rows)
        print(f"round {r + 1}/{args.rounds}: {done}", flush=True)
    return errors


def record(args, row: dict) -> dict:
    step_ms = statistics.median(row["times"])
    streamed = statistics.median(row["streamed"]) if row["streamed"] else None
    gpu = GpuSampler.summary(row["samples"])
    tokens = args.batch * args.seq
    return {
        "model": args.model, "impl": args.impl, "recipe": row["recipe"], "optim_states": "fp32",
        "batch": args.batch, "seq": args.seq, "vocab": args.vocab,
        "tokens_per_s": tokens / step_ms * 1000.0, "step_ms": step_ms,
        "step_ms_min": min(row["times"]), "step_ms_max": max(row["times"]),
        "stream_step_ms": streamed,
        "stream_tokens_per_s": tokens / streamed * 1000.0 if streamed else None,
        "peak_mem_gib": row["peak_mem_gib"], "resident_gib": row["resident_gib"],
        "interleaved": True, "rounds": args.rounds, "steps_per_round": args.steps,
        "round_ms": row["round_ms"], "sm_clock_mhz": gpu.get("sm_mhz"), "gpu_samples": gpu,
        "compile_scope": args.compile_scope, "compile_mode": args.compile_mode or "default",
        "compile_options": args.compile_options or {}, "loss": row["loss"],
        "gpu": gpu_tag(), "date": args.date or date.today().isoformat(),
    }  # fmt: skip


def ratios_by_loss(records: list[dict]) -> list[dict]:
    """`train_e2e.with_ratios` within each loss: a `ROW~eager` row against `bf16~eager` (and
    `torchao-tensorwise~eager`), the others against the plain rows, so that no ratio mixes the
    two cross entropies (a group without its bf16 row gets none)."""
    for loss in {r["loss"] for r in records}:
        group = [r for r in records if r["loss"] == loss]
        plain = [r | {"recipe": split_loss(r["recipe"], loss)[0]} for r in group]
        for r, done in zip(group, e2e.with_ratios(plain), strict=True):
            r |= {k: v for k, v in done.items() if k != "recipe"}
    return records


def _gpu_cells(gpu: dict) -> str:
    """SM clock, power (median / 90th percentile), temperature and the power-cap share."""
    if not gpu:
        return "— | — | — | —"
    return (f"{gpu['sm_mhz']:.0f} | {gpu['power_w']:.0f} / {gpu['power_p90_w']:.0f} | "
            f"{gpu['temp_c']:.0f} | {100 * gpu['share_sw_power_cap']:.0f}%")  # fmt: skip


def markdown(records: list[dict], args) -> str:
    lines = [
        f"`{' '.join(sys.argv)}`",
        "",
        f"{e2e.shape_words(args)}, compile scope {args.compile_scope}"
        f"{f', options {args.compile_options}' if args.compile_options else ''}, bf16 autocast, "
        f"cross entropy {args.loss} (a row ~LOSS: that one, its ratios against "
        "the bf16 row with the same loss), "
        "torch's fused AdamW; every row "
        f"held at once and timed in {args.rounds} rounds of {args.steps} steps, the order "
        "rotating each round; medians over all rounds (round medians: min-max).",
        "",
        "| recipe | step ms (rounds) | vs bf16 | vs torchao tensorwise | streamed ms (vs bf16) "
        "| peak GiB | mem vs bf16 | SM clock MHz | power W (p90) | temp C | at power cap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        streamed, ratio = r["stream_step_ms"], r.get("stream_speedup_vs_bf16")
        lines.append(
            f"| {r['recipe']} | {r['step_ms']:.1f} ({min(r['round_ms']):.1f}-"
            f"{max(r['round_ms']):.1f}) | {e2e.ratio_cell(r['speedup_vs_bf16'])} | "
            f"{e2e.ratio_cell(r['speedup_vs_torchao_tensorwise'])} | "
            f"{'—' if streamed is None else f'{streamed:.1f}'}"
            f"{f' ({ratio:.2f}x)' if ratio else ''} | {r['peak_mem_gib']:.1f} | "
            f"{e2e.ratio_cell(r['mem_vs_bf16'])} | "
            f"{_gpu_cells(r['gpu_samples'])} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.3B", choices=sorted(e2e.PRESETS))
    ap.add_argument("--impl", default="ours", choices=("ours", "hf"))
    ap.add_argument("--rows", default="bf16,torchao-tensorwise,fp8-tensorwise")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="steps per row and round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--compile-scope", default="block", choices=("model", "block", "none"))
    ap.add_argument("--compile-mode", default=None)
    ap.add_argument(
        "--compile-options", default="",
        help="inductor options for every row, KEY=VALUE[,KEY=VALUE...] (train_e2e.py's)",
    )  # fmt: skip
    ap.add_argument("--loss", default=None, choices=e2e.LOSSES,
                    help="every row's cross entropy (train_e2e.py's; default compiled, eager "
                    "under --compile-scope none)")  # fmt: skip
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    args.batch, args.seq, args.vocab = e2e.PRESETS[args.model]
    args.loss = args.loss or ("eager" if args.compile_scope == "none" else "compiled")
    args.rows = args.rows.split(",")
    args.compile_options = e2e.parse_compile_options(args.compile_options, args.compile_mode)
    setups = [split_loss(row, args.loss) for row in args.rows]
    if len(set(setups)) != len(setups):  # bf16 and bf16~compiled are one setup by default
        raise SystemExit(f"--rows {','.join(args.rows)}: each row once")
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("--rounds and --steps must be at least 1")
    for row in args.rows:  # a typo fails here, before any GPU time
        bare_tilde = row.endswith("~")
        row, loss = split_loss(row, args.loss)
        if bare_tilde or loss not in e2e.LOSSES:
            raise SystemExit(f"row {row}~{loss}: the loss after ~ is one of {e2e.LOSSES}")
        name, mode = e2e.split_row(row)
        if mode or "@" in name:
            raise SystemExit(f"row {row}: plain recipes and torchao rows only")
        if name not in e2e.TORCHAO_ROWS:
            e2e.recipes.get(name)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        for _ in range(4)
    ]
    rows, errors = [], []
    for name in args.rows:
        try:
            rows.append(build_row(args, name, batches))
        except Exception as exc:  # one failing row must not lose the others
            errors.append(_failed(name, exc))
            e2e.release_memory()
    sampler = GpuSampler.for_device(args.device)
    errors += time_rounds(args, rows, batches, sampler) if rows else []
    records = ratios_by_loss([record(args, row) for row in rows])
    body = markdown(records, args)
    body += "".join(f"\n\n{e['recipe']}: error `{e['error'][-300:]}`" for e in errors)
    name = f"train_interleaved_{args.model}_{args.impl}" + (f"_{args.tag}" if args.tag else "")
    out = {"day": args.date} | ({"out_dir": Path(args.out_dir)} if args.out_dir else {})
    md, _ = write_results(name, records + errors, body, **out)
    print(md.read_text())


if __name__ == "__main__":
    main()
