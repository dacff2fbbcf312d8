"""Loss of low-precision optimizer states against fp32-state AdamW on a small LM (CPU).

Trains minifloat.models.llama "tiny" on byte-level text of the Python standard library for a
few hundred steps with each optimizer-state configuration and a few seeds, and reports the final
validation loss, its difference from fp32 states with the same seed, and the seed-to-seed
spread of fp32 states (the run-to-run noise the low-precision states are judged against).

    python benchmarks/optim_states.py [--steps 300] [--seeds 0,1,2]

Writes benchmarks/results/optim_states_cpu_<date>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minifloat.models.llama import Llama, get_config
from minifloat.optim import AdamW, bytes_per_param
from minifloat.sqnr import sqnr_db

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
