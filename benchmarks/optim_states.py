"""Loss of low-precision optimizer states against fp32-state AdamW on a small LM (CPU).

Trains minifloat.models.llama "tiny" on byte-level text of the Python standard library for a
few hundred steps with each optimizer-state configuration and a few seeds, and reports the final
validation loss, its difference from fp32 states with the same seed, and the seed-to-seed
spread of fp32 states (the run-to-run noise the low-precision states are judged against).

    python benchmarks/optim_states.py [--steps 300] [--seeds 0,1,2]

Writes benchmarks/results/optim_states_cpu_<date>.md and .json.

Step-time mode: milliseconds per optimizer step on --device for the parameters of a LLaMA preset,
low-precision states fused (optim/fused.py: on CUDA the Triton kernel where it applies, else
the compiled function), fused through the compiled function only (--fused-inductor) and unfused
(decode, foreach update, encode per tensor), against fp32 states as the baseline: minifloat's
foreach path and, on CUDA, torch.optim.AdamW(fused=True), what the trainer uses for fp32 states:

    python benchmarks/optim_states.py --step-time --device cuda --model 1.3B \
        [--fused --fused-inductor --unfused]

Writes benchmarks/results/optim_step_<gpu>_<date>.md and .json (--out to change the folder).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from minifloat.models.llama import Llama, get_config
from minifloat.optim import OPTIM_STATE_PRESETS, AdamW, bytes_per_param, preset_param_dtype
from minifloat.sqnr import sqnr_db

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import kernel_profile, write_results  # noqa: E402

# name -> (AdamW state kwargs, parameter dtype)
CONFIGS: dict[str, tuple[dict, torch.dtype]] = {
    "fp32": ({}, torch.float32),
    "bf16": ({"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}, torch.float32),
    "fp8-fp16": ({"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16"}, torch.float32),
    "m-fp8/v-fp8": ({"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}, torch.float32),
    "m-fp8/v-fp8-sqrt": ({"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8-sqrt"}, torch.float32),
    "m-fp8/v-fp8-sqrt-sr": (
        {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8-sqrt-sr"},
        torch.float32,
    ),
    "bf16-weights-fp32-states": ({"master_weights": "none"}, torch.bfloat16),
    "lean (fp8-sqrt)": (
        {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8-sqrt", "master_weights": "none"},
        torch.bfloat16,
    ),
    "lean (fp8-sqrt-sr)": (
        {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8-sqrt-sr", "master_weights": "none"},
        torch.bfloat16,
    ),
}


SECOND_MOMENT_FORMATS = ("fp32", "bf16", "fp16", "fp8", "fp8-sqrt", "fp8-sqrt-sr")


def update_fidelity(steps: int = 300, numel: int = 64 * 1024) -> dict[str, dict[str, float]]:
    """SQNR (dB) of the Adam update direction m_hat / (sqrt(v_hat) + eps) with each exp_avg_sq
    format (exp_avg fp32) against fp32 states, on one synthetic gradient stream.

    Gradients: per-coordinate scales log-normal over ~16 binades, fresh noise each step; from
    step steps/3 on, a quarter of the coordinates go quiet (gradient x 1e-3), which tests whether
    v can decay (round-to-nearest 8-bit v stalls: a 5 % decay per step is below half an ulp).
    lr=0 so every optimizer sees the same gradients; only the stored states differ.
    """
    gen = torch.Generator().manual_seed(0)
    scales = torch.exp(2.0 * torch.randn(numel, generator=gen)) * 1e-3
    quiet = torch.rand(numel, generator=gen) < 0.25
    params = {
        name: torch.zeros(256, numel // 256, requires_grad=True) for name in SECOND_MOMENT_FORMATS
    }
    opts = {name: AdamW([p], lr=0.0, exp_avg_sq_dtype=name) for name, p in params.items()}
    sqnr: dict[str, list[float]] = {name: [] for name in SECOND_MOMENT_FORMATS}
    for step in range(1, steps + 1):
        g = torch.randn(numel, generator=gen) * scales
        if step > steps // 3:
            g = torch.where(quiet, g * 1e-3, g)
        updates = {}
        for name, p in params.items():
            p.grad = g.view_as(p).clone()
            opts[name].step()
            st = opts[name].state[p]
            m = opts[name]._load_moment(st, "exp_avg", p.shape)
            v = opts[name]._load_moment(st, "exp_avg_sq", p.shape)
            b1, b2 = 0.9, 0.95
            updates[name] = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + 1e-8)
        if step % 10 == 0:
            ref = updates["fp32"].double()
            for name, u in updates.items():
                sqnr[name].append(sqnr_db(ref, u))
    return {
        name: {"mean_sqnr_db": statistics.mean(v), "min_sqnr_db": min(v)}
        for name, v in sqnr.items()
        if name != "fp32"
    }


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Byte tokens of the standard library's .py sources, sorted by path (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def run(name: str, seed: int, tokens: torch.Tensor, val: torch.Tensor, args) -> float:
    kwargs, param_dtype = CONFIGS[name]
    config = get_config("tiny", vocab_size=256, max_seq_len=args.seq_len)
    torch.manual_seed(seed)
    model = Llama(config)
    model.init_weights(seed)
    model.to(param_dtype)
    opt = AdamW(model.parameters(), lr=args.lr, seed=seed, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, args.steps // 20)
    for step in range(args.steps):
        lr_scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (args.steps - warmup)))
        )
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([tokens[s : s + args.seq_len] for s in starts])
        y = torch.stack([tokens[s + 1 : s + args.seq_len + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return evaluate(model, val, args)


@torch.no_grad()
def evaluate(model: Llama, val: torch.Tensor, args) -> float:
    n = (len(val) - 1) // args.seq_len
    x = val[: n * args.seq_len].view(n, args.seq_len)
    y = val[1 : n * args.seq_len + 1].view(n, args.seq_len)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--fp32-seeds", default="0,1,2,3", help="more seeds for the noise floor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--fidelity-only", action="store_true", help="skip the LM runs")
    timing = parser.add_argument_group("step-time mode")
    timing.add_argument("--step-time", action="store_true", help="time optimizer steps instead")
    timing.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    timing.add_argument("--model", default="1.3B", help="LLaMA preset whose parameters to step")
    timing.add_argument("--layers", type=int, help="override the preset's n_layers")
    timing.add_argument("--dim", type=int, help="override dim (ffn_dim scales with it)")
    timing.add_argument("--presets", default="fp32,fp8-fp16,lean", help="optimizer-state presets")
    timing.add_argument("--fused", action="store_true", help="time the fused path")
    timing.add_argument(
        "--fused-inductor", action="store_true",
        help="time the fused path through the compiled function only (no Triton kernel)",
    )  # fmt: skip
    timing.add_argument("--unfused", action="store_true", help="time the unfused path")
    timing.add_argument("--warmup", type=int, default=3, help="untimed steps (compile included)")
    timing.add_argument("--repeats", type=int, default=20, help="timed steps")
    timing.add_argument(
        "--inductor", action="append", default=[], metavar="KEY=VALUE",
        help="an inductor config value for this process (repeatable), e.g. "
        "realize_reads_threshold=64: how the fused step's kernels are cut is inductor's choice",
    )  # fmt: skip
    timing.add_argument("--tag", default="", help="suffix of the results files")
    args = parser.parse_args(argv)
    # a fixed thread count for the timings, restored after: a caller's process (a test calling
    # main) must not keep it
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _run_mode(args)
    finally:
        torch.set_num_threads(previous)


def _run_mode(args: argparse.Namespace) -> None:
    """The mode `args` names: --step-time, or fidelity and the training runs."""
    if args.step_time:
        chosen = {"fused": args.fused, "fused-inductor": args.fused_inductor,
                  "unfused": args.unfused}  # fmt: skip
        paths = [p for p, on in chosen.items() if on] or ["fused", "unfused"]
        with inductor_config.patch(inductor_options(args.inductor)):
            records = step_time(args, paths)
        for r in records:
            r["inductor"] = args.inductor
        name = "optim_step" + (f"_{args.tag}" if args.tag else "")
        md, js = write_results(name, records, step_time_table(records), out_dir=args.out)
        print(md.read_text())
        print(f"wrote {md} and {js}")
        return
    fidelity = update_fidelity()
    for name, stats in fidelity.items():
        mean, low = stats["mean_sqnr_db"], stats["min_sqnr_db"]
        print(f"exp_avg_sq={name:12s} update SQNR mean {mean:.1f} dB, min {low:.1f} dB")
    if args.fidelity_only:
        return
    data = stdlib_bytes(2_000_000)
    tokens, val = data[:-32_768], data[-32_768:]
    seeds = [int(s) for s in args.seeds.split(",")]
    records = []
    for name in args.configs.split(","):
        for seed in [int(s) for s in args.fp32_seeds.split(",")] if name == "fp32" else seeds:
            t0 = time.perf_counter()
            loss = run(name, seed, tokens, val, args)
            records.append({"config": name, "seed": seed, "val_loss": loss})
            print(f"{name:28s} seed={seed} val_loss={loss:.4f} ({time.perf_counter() - t0:.0f}s)")
    write_report(records, fidelity, args)


# ---- step-time mode ------------------------------------------------------------------------


def inductor_options(pairs: list[str]) -> dict[str, object]:
    """`KEY=VALUE` strings as inductor config values (VALUE a Python literal, else a string);
    an unknown key fails here, before any GPU time is spent. Dotted keys name nested values
    (`triton.cudagraphs=True`)."""
    known = inductor_config.get_config_copy()
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--inductor {pair!r}: expected KEY=VALUE")
        if key not in known:
            raise SystemExit(f"--inductor {pair!r}: no inductor config named {key!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def param_shapes(args) -> list[torch.Size]:
    """Parameter shapes of the LLaMA preset `args.model` (with --layers/--dim overrides)."""
    overrides = {}
    if args.layers:
        overrides["n_layers"] = args.layers
    if args.dim:
        base = get_config(args.model)
        overrides.update(dim=args.dim, ffn_dim=base.ffn_dim * args.dim // base.dim)
        overrides["n_heads"] = max(1, args.dim // (base.dim // base.n_heads))
    with torch.device("meta"):
        model = Llama(get_config(args.model, **overrides))
    return [p.shape for p in model.parameters()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_optimizer(preset: str, path: str, shapes: list[torch.Size], args) -> dict:
    """Median milliseconds of one AdamW step over parameters of `shapes` on args.device (steps
    after `args.warmup` untimed ones; the first step, with compilation, is reported apart);
    on CUDA also the profiler's kernel time, launches and top kernels per step (a step much
    longer than its kernels is bound by the host, one close to them by the kernels)."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if preset_param_dtype(preset) == "bf16" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, device=device) * 1e-3).to(dtype)
    opt = make_optimizer(params, preset, path)
    torch._dynamo.utils.counters.clear()
    times = []
    for i in range(args.warmup + args.repeats):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if i == 0 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    timed = times[args.warmup :] or times
    numel = sum(p.numel() for p in params)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    profiled = kernel_profile(opt.step, reps=3) if device.type == "cuda" else {}
    return {
        "preset": preset,
        "path": path,
        "kernel_ms": profiled.get("kernel_ms"),
        "kernels_per_step": profiled.get("kernels", 0),
        "top_kernels": profiled.get("top_kernels", []),
        "device": str(device),
        "model": args.model,
        "params": numel,
        "tensors": len(params),
        "step_ms": statistics.median(timed),
        "step_ms_min": min(timed),
        "first_step_ms": times[0],
        "compiled_graphs": graphs,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9
        if device.type == "cuda"
        else None,
    }


def make_optimizer(params: list[torch.Tensor], preset: str, path: str) -> torch.optim.Optimizer:
    """The optimizer a step-time row times: `path` is fused, fused-inductor or unfused for
    low-precision presets; foreach (minifloat's) or torch-fused for fp32 states."""
    if path == "torch-fused":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    kernel = "inductor" if path == "fused-inductor" else "auto"
    fused = path in ("fused", "fused-inductor")
    return AdamW(params, lr=1e-4, fused=fused, fused_kernel=kernel, **OPTIM_STATE_PRESETS[preset])


def step_time(args, paths: list[str]) -> list[dict]:
    """Time every preset on every path; fp32 states (minifloat's foreach path, and torch's
    fused AdamW on CUDA) are the baselines of the `vs_fp32` and `vs_torch_fused` ratios."""
    shapes = param_shapes(args)
    records = []
    fp32_paths = ["foreach", "torch-fused"] if args.device.startswith("cuda") else ["foreach"]
    for preset in args.presets.split(","):
        low_precision = OPTIM_STATE_PRESETS[preset]["exp_avg_dtype"] != "fp32"
        for path in paths if low_precision else fp32_paths:
            rec = time_optimizer(preset, path, shapes, args)
            records.append(rec)
            print(f"{preset:10s} {path:8s} {rec['step_ms']:9.2f} ms/step "
                  f"(first {rec['first_step_ms']:.0f} ms)")  # fmt: skip
    base = {r["path"]: r["step_ms"] for r in records if r["preset"] == "fp32"}
    for r in records:
        r["vs_fp32"] = r["step_ms"] / base["foreach"] if "foreach" in base else None
        r["vs_torch_fused"] = r["step_ms"] / base["torch-fused"] if "torch-fused" in base else None
    return records


def step_time_table(records: list[dict]) -> str:
    """Markdown table of step-time records, fused against unfused per preset."""
    r0 = records[0]
    options = ", ".join(r0.get("inductor") or []) or "defaults"
    lines = [
        f"Optimizer step time, {r0['model']} parameters ({r0['params'] / 1e9:.3f} B in "
        f"{r0['tensors']} tensors) on {r0['device']}; median of timed steps (host clock "
        f"after device sync). Inductor config: {options}.",
        "",
        "| preset | path | ms/step | kernel ms | kernels | vs fp32 states | vs torch fused fp32 "
        "| vs unfused | first step ms | graphs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    unfused = {r["preset"]: r["step_ms"] for r in records if r["path"] == "unfused"}
    for r in records:
        vs_fp32 = f"{r['vs_fp32']:.2f}x" if r["vs_fp32"] else "-"
        vs_torch = f"{r['vs_torch_fused']:.2f}x" if r.get("vs_torch_fused") else "-"
        vs_unfused = (
            f"{r['step_ms'] / unfused[r['preset']]:.2f}x" if r["preset"] in unfused else "-"
        )
        kms = "-" if r.get("kernel_ms") is None else f"{r['kernel_ms']:.2f}"
        lines.append(
            f"| {r['preset']} | {r['path']} | {r['step_ms']:.2f} | {kms} | "
            f"{r.get('kernels_per_step', 0):.0f} | {vs_fp32} | {vs_torch} | {vs_unfused} | "
            f"{r['first_step_ms']:.0f} | {r['compiled_graphs']} |"
        )
    for r in records:
        if r.get("top_kernels"):
            lines += ["", f"Top kernels, {r['preset']} {r['path']} (ms/step, launches/step):", ""]
            lines += [f"- `{n}`: {ms:.2f} ms, {k:.0f}" for n, ms, k in r["top_kernels"]]
    return "\n".join(lines)


def write_report(records: list[dict], fidelity: dict, args) -> None:
    fp32 = {r["seed"]: r["val_loss"] for r in records if r["config"] == "fp32"}
    noise = statistics.stdev(fp32.values()) if len(fp32) > 1 else float("nan")
    lines = [
        f"# Optimizer-state precision vs fp32 AdamW ({datetime.date.today()})",
        "",
        f"Model: llama tiny, byte vocab 256, seq {args.seq_len}, batch {args.batch}, "
        f"{args.steps} steps, lr {args.lr} (5 % warm-up, cosine to 10 %), bf16 autocast, "
        f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}.",
        f"fp32-state seed-to-seed std of val loss: {noise:.4f}.",
        "",
        "| config | B/param | seeds | mean val loss | mean diff vs fp32 (same seed) |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["config"] for r in records):
        rows = [r for r in records if r["config"] == name]
        kwargs, _ = CONFIGS[name]
        bpp = bytes_per_param(kwargs)["total"]
        diffs = [r["val_loss"] - fp32[r["seed"]] for r in rows if r["seed"] in fp32]
        mean = statistics.mean(r["val_loss"] for r in rows)
        diff = statistics.mean(diffs) if diffs else float("nan")
        lines.append(f"| {name} | {bpp:.2f} | {len(rows)} | {mean:.4f} | {diff:+.4f} |")
    lines += [
        "",
        "Adam update direction with each second-moment format vs fp32 states "
        "(synthetic gradient stream, see update_fidelity):",
        "",
        "| exp_avg_sq | mean SQNR dB | min SQNR dB |",
        "|---|---|---|",
    ]
    lines += [
        f"| {n} | {s['mean_sqnr_db']:.1f} | {s['min_sqnr_db']:.1f} |" for n, s in fidelity.items()
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"optim_states_cpu_{datetime.date.today()}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "fp32_seed_std": noise,
                "records": records,
                "update_fidelity": fidelity,
                "args": vars(args),
            },
            default=str,
        )
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
