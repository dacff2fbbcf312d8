"""Data-parallel training throughput: DDP and FSDP2, with fp32 / bf16 / fp8 gradient communication.

One command, on a machine with >= 2 GPUs (it spawns its own processes; no torchrun needed):

    python benchmarks/distributed.py                       # 125M and 1.3B, 1 and 2 GPUs
    python benchmarks/distributed.py --models tiny --device cpu --seq-len 64 --batch 2,2  # smoke

For every model it first measures one GPU alone (plain model, no wrapper), then 2 GPUs with
DDP (grad_comm fp32 / bf16 / fp8) and FSDP2 (reduce fp32 / bf16), each with fp32 optimizer
states, plus DDP/bf16 with the paper's fp8-fp16 states. Synthetic random tokens; bf16 autocast;
AdamW from minifloat.optim. Weak scaling: the per-GPU batch is fixed, so
scaling_efficiency = tokens/s on W GPUs / (W * tokens/s on one GPU with the same optimizer states).

Writes benchmarks/results/distributed_<gpu>_<date>.md and .json (records: model, parallel,
grad_comm, optim_states, gpus, tokens_per_s, scaling_efficiency, peak_mem_gib, step_ms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from minifloat.distributed import apply_fsdp, fsdp_reduce_dtype, register_grad_comm_hook
from minifloat.models.llama import Llama, get_config
from minifloat.optim import OPTIM_STATE_PRESETS, AdamW

# (parallel, grad_comm, optim_states) measured on 2 GPUs for every model.
PARALLEL_CONFIGS = [
    ("ddp", "fp32", "fp32"),
    ("ddp", "bf16", "fp32"),
    ("ddp", "fp8", "fp32"),
    ("fsdp", "fp32", "fp32"),
    ("fsdp", "bf16", "fp32"),
    ("ddp", "bf16", "fp8-fp16"),
]


def build(model_name: str, parallel: str, grad_comm: str, optim_states: str, args, device):  # noqa: ANN001, ANN201
    """Model (wrapped for `parallel`) and optimizer on `device`."""
    config = get_config(model_name, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    with torch.device(device):
        model = Llama(config)
    model.init_weights(0)
    if parallel == "ddp":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        register_grad_comm_hook(model, grad_comm)
    elif parallel == "fsdp":
        model = apply_fsdp(
            model, reduce_dtype=fsdp_reduce_dtype(grad_comm), param_dtype=torch.bfloat16
        )
    opt = AdamW(model.parameters(), lr=1e-4, **OPTIM_STATE_PRESETS[optim_states])
    return model, opt


def train_step(model, opt, tokens: torch.Tensor, device: torch.device) -> None:  # noqa: ANN001
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(model_name: str, parallel: str, grad_comm: str, optim_states: str, args, device):  # noqa: ANN001, ANN201
    world = dist.get_world_size() if dist.is_initialized() else 1
    batch = args.batch[model_name]
    model, opt = build(model_name, parallel, grad_comm, optim_states, args, device)
    gen = torch.Generator(device=device).manual_seed(dist.get_rank() if world > 1 else 0)
    tokens = torch.randint(
        0, args.vocab_size, (batch, args.seq_len + 1), device=device, generator=gen
    )
    for _ in range(args.warmup):
        train_step(model, opt, tokens, device)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(model, opt, tokens, device)
    _sync(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    del model, opt
    return {
        "model": model_name,
        "parallel": parallel,
        "grad_comm": grad_comm,
        "optim_states": optim_states,
        "gpus": world,
        "batch_per_gpu": batch,
        "seq_len": args.seq_len,
        "tokens_per_s": world * batch * args.seq_len * args.steps / elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "peak_mem_gib": peak,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def worker(rank: int, world: int, port: int, jobs: list[tuple], args, out_path: str) -> None:  # noqa: ANN001
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=3),
        )
    for job in jobs:
        try:
            record = measure(*job, args, device)
        except Exception as exc:  # one config failing (e.g. OOM) must not lose the others
            record = dict(zip(("model", "parallel", "grad_comm", "optim_states"), job, strict=True))
            record.update(gpus=world, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps(record), flush=True)
            with open(out_path, "a") as f:
                f.write(json.dumps(record) + "\n")
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(args) -> list[dict]:  # noqa: ANN001
    out_path = Path(tempfile.mkdtemp()) / "records.jsonl"
    optims = sorted({o for *_, o in PARALLEL_CONFIGS})
    single = [(m, "none", "none", o) for m in args.models for o in optims]
    multi = [(m, *c) for m in args.models for c in PARALLEL_CONFIGS]
    mp.spawn(worker, args=(1, _free_port(), single, args, str(out_path)), nprocs=1)
    mp.spawn(worker, args=(args.gpus, _free_port(), multi, args, str(out_path)), nprocs=args.gpus)
    records = [json.loads(line) for line in out_path.read_text().splitlines()]
    base = {(r["model"], r["optim_states"]): r["tokens_per_s"] for r in records if r["gpus"] == 1}
    for r in records:
        ref = base.get((r["model"], r["optim_states"]))
        if "tokens_per_s" in r and ref:
            r["scaling_efficiency"] = r["tokens_per_s"] / (r["gpus"] * ref)
    return records


def write_report(records: list[dict], args) -> Path:  # noqa: ANN001
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.machine()
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    stem = args.out / f"distributed_{slug}_{datetime.date.today()}"
    env = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": str(torch.cuda.nccl.version()) if args.device == "cuda" else None,
        "seq_len": args.seq_len,
        "vocab_size": args.vocab_size,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "batch_per_gpu": args.batch,
    }
    lines = [
        f"# Data-parallel throughput ({datetime.date.today()})",
        "",
        "; ".join(f"{k}: {v}" for k, v in env.items()),
        "",
        "Synthetic tokens, bf16 autocast, minifloat AdamW. Weak scaling (fixed batch per GPU); "
        "efficiency = tokens/s / (GPUs x one-GPU tokens/s with the same optimizer states).",
        "",
        "| model | parallel | grad_comm | optim_states | GPUs | tokens/s | scaling eff. | "
        "step ms | peak mem GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['parallel']} | {r['grad_comm']} | {r['optim_states']} | "
                f"{r['gpus']} | failed: {r['error']} | | | |"
            )
            continue
        eff = r.get("scaling_efficiency")
        lines.append(
            f"| {r['model']} | {r['parallel']} | {r['grad_comm']} | {r['optim_states']} | "
            f"{r['gpus']} | {r['tokens_per_s']:,.0f} | "
            f"{'' if eff is None else f'{100 * eff:.1f} %'} | {r['step_ms']:.1f} | "
            f"{r['peak_mem_gib']:.1f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"env": env, "records": records}, indent=1))
    print("\n".join(lines))
    return stem


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="125M,1.3B")
    parser.add_argument("--batch", default="16,8", help="per-GPU batch, one per model")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.models = args.models.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    if len(batches) != len(args.models):
        parser.error("--batch needs one value per model")
    args.batch = dict(zip(args.models, batches, strict=True))
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        parser.error(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    return args


def main() -> None:
    args = parse_args()
    write_report(run_all(args), args)


if __name__ == "__main__":
    main()
