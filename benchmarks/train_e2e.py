"""End-to-end training throughput per recipe, against bf16 and torchao in the same process.

    PYTHONPATH=src python benchmarks/train_e2e.py --model 1.3B [--impl ours|hf] \
        [--rows bf16,torchao-tensorwise,torchao-rowwise,fp8-tensorwise,fp4] [--profile fp4] \
        [--out-dir DIR] [--tag NAME]

One process, one GPU, the same model shape, seed and token batches for every row: a LLaMA (`--impl
ours`: minifloat.models.Llama; `hf`: a `transformers` LlamaForCausalLM of the same shape), converted
with `minifloat.convert` (or torchao's `convert_to_float8_training`; the output head stays high
precision in both), compiled with `torch.compile`, trained under bf16 autocast with fp32 master
weights and torch's fused AdamW (`--optim-states fp32,fp8-fp16`: each row with each preset in this
process, minifloat's AdamW for the low-precision ones), the cross entropy compiled (`--loss
eager`: the fp32-upcast eager form every run used before session 54, 4.6-4.7 GiB more at a 1.3B
step's peak; `minifloat/train/loss.py`; `--loss chunked`: the head and the cross entropy a
chunk of tokens at a time, `minifloat/train/head_loss.py`). Each row runs `--warmup` steps
(compilation included) and `--steps` timed steps; the step time is the median of CUDA-event
timings of whole steps (forward, loss, backward, optimizer), each followed by a host
synchronization; the "streamed" step time is the median of the same number of steps run back to
back with CUDA events between them and no synchronization, as a training loop runs (the host may
run ahead, so the GPU does not wait for a step's first launches; `stream_step_ms`,
`stream_speedup_vs_bf16`).
Rows named in `--profile` are then profiled for 3 steps: GPU kernel time per step split into
GEMM / attention / everything else, kernel launches per step, the top kernels and the GPU's idle
time between kernels by gap length (step_profile.idle_gaps). Rows timed one after another can
run at different clocks; `train_interleaved.py` times a few rows in alternation.

Presets (the shapes of shared/ANCHORS.md): `1.3B` batch 8 x 2048, vocab 32000; `125M` batch
32 x 1024, vocab 8192; `7B` batch 8 x 2048, vocab 32000, with fewer layers (`--layers 8`) to fit
one GPU. Records are written after every row (a time limit keeps what ran) to
benchmarks/results/train_e2e_<model>_<impl>[_<tag>]_<gpu>_<date>.{md,json}; JSON records hold
`model`, `impl`, `recipe`, `tokens_per_s`, `speedup_vs_bf16`, `speedup_vs_torchao_tensorwise`,
`peak_mem_gib`, `mem_vs_bf16`, `gpu`, `date` and the step and profile details (`step_peak_gib`:
the peak of the timed steps alone, where `peak_mem_gib` also covers compilation; `resident_gib`:
memory held between steps, so the peak minus it is what a step allocates and frees;
`sm_clock_mhz` and `gpu_samples`: the GPU's SM clock, power and limit reasons while the row's
timed steps ran, `gpu_sampler.py`, where NVML can be read).

FSDP2 rows (issue 17): a row `RECIPE+fsdp` shards the model with `minifloat.distributed.apply_fsdp`
(each block, then the root; fp32 parameters all-gathered, bf16 autocast, fp32 reduce-scatter, the
trainer's setup) and `RECIPE+qag` also all-gathers the quantized weights already quantized
(`apply_fsdp(quantized_all_gather=True)`, then `precompute_quantized_weights` after every optimizer
step, as the trainer does; torchao rows: `enable_fsdp_float8_all_gather` and torchao's
`precompute_float8_dynamic_scale_for_fsdp`). Blocks are compiled in place before sharding
(torchtitan's order). Launched plainly the process group has one rank (the all-gathers are
local copies: what the option costs besides the network); under torchrun each rank trains the
same batches and rank 0 writes the results. Records add `parallel` (none / fsdp),
`quantized_allgather`, `world_size` and, for +qag rows, `speedup_vs_fsdp` (against the same
recipe's +fsdp row of this run).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
import traceback
from datetime import date
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch._dynamo.utils import counters  # noqa: E402

from common import dump_kernel_sources, gpu_tag, write_results  # noqa: E402
from e2e_setup import (  # noqa: E402  (re-exported: train_interleaved.py, qag_equality.py)
    after_step_fn,
    compile_model,
    init_process_group,
    parse_compile_options,
    shard_model,
)
from gpu_sampler import GpuSampler  # noqa: E402
from minifloat import recipes  # noqa: E402
from minifloat.convert import convert, is_output_head  # noqa: E402
from minifloat.models.llama import Llama, get_config  # noqa: E402
from minifloat.size_rule import TORCHAO_TENSORWISE, SizeRule  # noqa: E402
from minifloat.train.head_loss import ChunkedHeadObjective, defer_head  # noqa: E402
from minifloat.train.loss import LOSS_MODES, TrainingObjective  # noqa: E402
from step_profile import find_syncs, profile_steps  # noqa: E402

# --loss: minifloat.train.loss's modes, or the head and the cross entropy in chunks of tokens
# (minifloat.train.head_loss: no [tokens, vocab] logits; the head deferred in the model).
LOSSES = (*LOSS_MODES, "chunked")

PRESETS = {  # model -> (batch, seq, vocab)
    "1.3B": (8, 2048, 32000),
    "125M": (32, 1024, 8192),
    # 7B width (dim 4096, FFN 11008) with 16,384 tokens a step, the one-layer benchmark's M; it
    # fits one GPU with `--layers` (e.g. 8), not whole.
    "7B": (8, 2048, 32000),
    "tiny": (2, 64, 512),  # a CPU smoke test of this script (--device cpu)
}
TORCHAO_ROWS = {"torchao-tensorwise": "tensorwise", "torchao-rowwise": "rowwise"}
DEFAULT_ROWS = ["bf16", *TORCHAO_ROWS] + [
    "fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "fp4-direct", "fp4-dge", "fp4",
]  # fmt: skip
FSDP_MODES = ("fsdp", "qag")  # row suffixes: +fsdp, +qag (FSDP2 with the quantized all-gather)


def build_model(
    model: str, impl: str, vocab: int, seq: int, device: str, layers: int | None, seed: int = 0
) -> nn.Module:
    """The model of `model`'s shape, deterministically initialised, on `device` in fp32."""
    cfg = get_config(model, vocab_size=vocab, max_seq_len=seq)
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    torch.manual_seed(seed)
    if impl == "ours":
        net = Llama(cfg)
        net.init_weights(seed)
        return net.to(device)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, vocab_size=vocab,
        max_position_embeddings=seq, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, attn_implementation="sdpa",
        # Training needs no KV cache; with one, each block's compiled graph guards on its own
        # cache layer's state and every block recompiles (8-14 graphs instead of 1).
        use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(hf_cfg).to(device)


def _float8_eligible(module: nn.Module, fqn: str) -> bool:
    """torchao's layers: plain nn.Linear, not the head, both dims multiples of 16."""
    return (
        type(module) is nn.Linear
        and not is_output_head(fqn)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def split_row(row: str) -> tuple[str, str | None]:
    """`RECIPE[@RULE][+fsdp|+qag]` -> (`RECIPE[@RULE]`, "fsdp" / "qag" / None)."""
    base, plus, mode = row.rpartition("+")
    return (base, mode) if plus and mode in FSDP_MODES else (row, None)


def prepare(net: nn.Module, row: str, *, fsdp_float8_all_gather: bool = False) -> nn.Module:
    """Apply the row's precision recipe to `net` in place; returns it. A row RECIPE@RULE
    converts with a size rule: RULE is `torchao` (torchao's tensorwise bounds, 4096:1024; rows
    named @torchao before session 46 applied 1024:4096, the bounds transposed) or IN:OUT[,...]
    (minifloat.SizeRule.parse), e.g. fp8-tensorwise@torchao, fp4@1024:4096.
    `fsdp_float8_all_gather`: torchao rows all-gather their float8 weights under FSDP2 (its
    `enable_fsdp_float8_all_gather`)."""
    row, _, rule = row.partition("@")
    if rule:
        size_rule = TORCHAO_TENSORWISE if rule == "torchao" else SizeRule.parse(rule)
        report = convert(net, row, size_rule=size_rule, return_report=True)[1]
        print(f"{row}@{rule}: {len(report.converted)} layers converted", flush=True)
    elif row in TORCHAO_ROWS:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(TORCHAO_ROWS[row])
        if fsdp_float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(net, config=config, module_filter_fn=_float8_eligible)
    elif recipes.get(row).quantized:
        convert(net, row)
    return net


def _logits(net: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = net(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def make_step(
    net: nn.Module, opt: torch.optim.Optimizer, after_step=None, loss="compiled", chunks="compiled"
):
    """One training step on a token batch [B, T + 1]. `loss`: the cross entropy eager or
    compiled (`minifloat.train.loss`; compiled keeps 4.6-4.7 GiB less at a 1.3B step's peak),
    or "chunked": `net`'s head swapped (in place) for one that the step defers and applies with
    the cross entropy a chunk of tokens at a time (`minifloat.train.head_loss`) in the
    model's dtype (bf16); `chunks`: its per-chunk loss and gradient eager or compiled."""
    if loss == "chunked":
        objective = ChunkedHeadObjective(defer_head(net), mode=chunks, dtype=torch.bfloat16)
    else:
        objective = TrainingObjective(mode=loss)

    def step(tokens: torch.Tensor) -> None:
        # chunked: inside `deferring` the model returns its final hidden states
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16), objective.deferring():
            out = _logits(net, tokens[:, :-1])
        objective(out, tokens[:, 1:])[1].backward()
        opt.step()
        if after_step is not None:
            after_step()
        opt.zero_grad(set_to_none=True)

    return step


def sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_step(step, tokens: torch.Tensor) -> tuple[float, float]:
    """Milliseconds of one step (CUDA events on the GPU, the wall clock elsewhere) and the host's
    milliseconds until ``step`` returned. A host time close to the step time means the GPU waits
    for launches (CPU-bound); far below it, the GPU is the limit."""
    t0 = time.perf_counter()
    if tokens.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(tokens)
        host_ms = (time.perf_counter() - t0) * 1000.0
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host_ms
    step(tokens)
    ms = (time.perf_counter() - t0) * 1000.0
    return ms, ms


def timed_stream(step, batches: list[torch.Tensor], steps: int) -> list[float]:
    """Milliseconds of each of `steps` steps run back to back, as a training loop runs them:
    CUDA events between steps and no host synchronization until the last, so the host may run
    ahead and the GPU never waits for the next step's first launches (which `timed_step`, with its
    synchronization after every step, counts in every step)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step(batches[i % len(batches)])
        events[i + 1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events[:-1], events[1:], strict=True)]


def run_row(args, row: str, batches: list[torch.Tensor], optim_states: str = "fp32") -> dict:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base, mode = split_row(row)
    torchao = base in TORCHAO_ROWS
    world = init_process_group(args.device)[1] if mode else 1
    model = build_model(args.model, args.impl, args.vocab, args.seq, args.device, args.layers)
    net = prepare(model, base, fsdp_float8_all_gather=mode == "qag")
    if args.loss == "chunked":  # before fully_shard, which records each parameter's module
        defer_head(net)
    if mode:
        compiled = shard_model(net, args, mode, torchao)
    else:
        compiled = compile_model(net, args.compile_scope, args.compile_mode, args.compile_options)
    opt = make_optimizer(net, optim_states)
    step = make_step(compiled, opt, after_step_fn(net, mode, torchao), args.loss)
    counters.clear()
    t0 = time.perf_counter()
    step(batches[0])
    sync_device(args.device)
    compile_s = time.perf_counter() - t0
    print(f"{row}: first step (compilation) {compile_s:.0f} s", flush=True)
    for i in range(1, args.warmup):
        step(batches[i % len(batches)])
    sync_device(args.device)
    warmup_s = time.perf_counter() - t0
    # Between steps (grads freed): weights, optimizer states and whatever a recipe keeps across
    # steps (scale histories, cached quantized weights); the peak minus this is transient.
    resident_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    if cuda:  # the whole row's peak so far (compilation and autotuning included) is kept
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    # The GPU's power and SM clock while the row steps: at a power limit they set the GEMMs'
    # speed (docs/hopper_sessions.md, session 30).
    sampler = GpuSampler.for_device(args.device)
    with sampler.collect() as samples:
        timed = [timed_step(step, batches[i % len(batches)]) for i in range(args.steps)]
        stream_ms = statistics.median(timed_stream(step, batches, args.steps)) if cuda else None
    times = [ms for ms, _ in timed]
    step_ms = statistics.median(times)
    gpu = GpuSampler.summary(samples)
    rec = {
        "model": args.model, "impl": args.impl, "recipe": row, "optim_states": optim_states,
        "batch": args.batch, "seq": args.seq, "vocab": args.vocab,
        "tokens_per_s": args.batch * args.seq / step_ms * 1000.0,
        "step_ms": step_ms, "step_ms_min": min(times), "step_ms_max": max(times),
        "host_ms": statistics.median(h for _, h in timed),
        "stream_step_ms": stream_ms,
        "stream_tokens_per_s": args.batch * args.seq / stream_ms * 1000.0 if stream_ms else None,
        "sm_clock_mhz": gpu.get("sm_mhz"), "gpu_samples": gpu,
        "warmup_s": warmup_s, "compile_s": compile_s,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "peak_mem_gib": max(peak_gib, torch.cuda.max_memory_allocated() / 2**30) if cuda else 0.0,
        "step_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "resident_gib": resident_gib,
        "parallel": "fsdp" if mode else "none", "quantized_allgather": mode == "qag",
        "world_size": world,
        "compile_mode": args.compile_mode or "default", "gpu": gpu_tag(),
        "compile_options": args.compile_options or {}, "loss": args.loss,
        "date": args.date or date.today().isoformat(),
    }  # fmt: skip
    if row in args.profile and cuda:
        rec |= profile_steps(step, batches)
        rec["sync_sites"] = find_syncs(step, batches[0])
        rec["syncs_per_step"] = len(rec["sync_sites"])
        if args.dump_kernels:  # the generated source of the slowest Triton kernels
            names = [name for name, _, _ in rec["kernels"]]
            dump_kernel_sources(names, Path(args.dump_kernels), row.replace(":", "_"), 10)
    del step, opt, compiled, net
    release_memory()
    return rec


def make_optimizer(net: nn.Module, optim_states: str) -> torch.optim.Optimizer:
    """torch's fused AdamW for fp32 states (the trainer's choice on CUDA), else minifloat's
    AdamW with the preset's state formats (fp32 parameters: the presets that keep them)."""
    if optim_states == "fp32":
        return torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    from minifloat.optim import OPTIM_STATE_PRESETS, AdamW

    preset = OPTIM_STATE_PRESETS[optim_states]
    return AdamW(net.parameters(), lr=1e-4, weight_decay=0.1, **preset)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def with_ratios(records: list[dict]) -> list[dict]:
    """Add speed and memory ratios against this run's bf16 and torchao tensorwise rows (with
    several --optim-states, the rows with the first preset), and each row's speed against the
    same recipe with the first preset (`speedup_vs_first_states`)."""
    base: dict[str, dict] = {}
    for r in records:
        base.setdefault(r["recipe"], r)
    bf16, tao = base.get("bf16"), base.get("torchao-tensorwise")
    for r in records:
        r["speedup_vs_first_states"] = r["tokens_per_s"] / base[r["recipe"]]["tokens_per_s"]
        r["speedup_vs_bf16"] = r["tokens_per_s"] / bf16["tokens_per_s"] if bf16 else None
        r["mem_vs_bf16"] = (
            r["peak_mem_gib"] / bf16["peak_mem_gib"] if bf16 and bf16["peak_mem_gib"] else None
        )
        r["speedup_vs_torchao_tensorwise"] = (
            r["tokens_per_s"] / tao["tokens_per_s"] if tao else None
        )
        streamed = bf16 and bf16.get("stream_step_ms") and r.get("stream_step_ms")
        r["stream_speedup_vs_bf16"] = (
            bf16["stream_step_ms"] / r["stream_step_ms"] if streamed else None
        )
        name, mode = split_row(r["recipe"])
        plain = base.get(f"{name}+fsdp") if mode == "qag" else None
        if plain is not None:
            r["speedup_vs_fsdp"] = r["tokens_per_s"] / plain["tokens_per_s"]
    return records


def ratio_cell(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _optimizer_words(optim_states: list[str]) -> str:
    if optim_states == ["fp32"]:
        return "torch's fused AdamW (fp32 states)"
    if len(optim_states) == 1:
        return f"minifloat AdamW with {optim_states[0]} states"
    return "optimizer states per row (fp32: torch's fused AdamW, else minifloat's AdamW)"


def _timeline_cells(t: dict | None) -> str:
    """'wall | idle (a / b / c)' from step_profile.idle_gaps, or dashes without a timeline."""
    if not t:
        return "— | —"
    parts = " / ".join(f"{ms:.1f}" for ms, _ in t["idle_by_gap"].values())
    return f"{t['wall_ms']:.1f} | {t['idle_ms']:.1f} ({parts})"


def shape_words(args) -> str:
    """'Model M (impl), batch B x T, vocab V': the first words of a results file's setup."""
    return f"Model {args.model} ({args.impl}), batch {args.batch} x {args.seq}, vocab {args.vocab}"


def _clock_power(gpu: dict | None) -> str:
    return f"{gpu['sm_mhz']:.0f} / {gpu['power_w']:.0f}" if gpu else "—"


def markdown(records: list[dict], args) -> str:
    lines = [
        f"`{' '.join(sys.argv)}`",
        "",
        f"{shape_words(args)}, torch.compile ({args.compile_scope}, "
        f"mode {args.compile_mode or 'default'}"
        f"{f', options {args.compile_options}' if args.compile_options else ''}), bf16 "
        f"autocast, cross entropy {args.loss}, {_optimizer_words(args.optim_states)}"
        f"{f', {args.layers} layers' if args.layers else ''}; "
        f"median of {args.steps} steps after {args.warmup} warm-up steps.",
        "",
        "| recipe | states | tokens/s | vs bf16 | vs torchao tensorwise | vs first states "
        "| peak GiB | mem vs bf16 | step peak GiB | resident GiB | step ms | host ms "
        "| streamed step ms | compile s | graphs / breaks | SM clock MHz / power W |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        streamed, ratio = r.get("stream_step_ms"), r.get("stream_speedup_vs_bf16")
        ratio = f" ({ratio:.2f}x)" if ratio and r["recipe"] != "bf16" else ""
        lines.append(
            f"| {r['recipe']} | {r.get('optim_states', 'fp32')} | {r['tokens_per_s']:,.0f} | "
            f"{ratio_cell(r['speedup_vs_bf16'])} | "
            f"{ratio_cell(r['speedup_vs_torchao_tensorwise'])} | "
            f"{ratio_cell(r['speedup_vs_first_states'])} | "
            f"{r['peak_mem_gib']:.1f} | "
            f"{ratio_cell(r['mem_vs_bf16'])} | {r.get('step_peak_gib', 0.0):.1f} | "
            f"{r.get('resident_gib', 0.0):.1f} | "
            f"{r['step_ms']:.1f} | {r['host_ms']:.1f} | "
            f"{'—' if streamed is None else f'{streamed:.1f}'}{ratio} | {r['compile_s']:.0f} | "
            f"{r['graphs']} / {r['graph_breaks']} | {_clock_power(r.get('gpu_samples'))} |"
        )
    qag = [r for r in records if "speedup_vs_fsdp" in r]
    if qag:
        ratios = ", ".join(f"{r['recipe']} {ratio_cell(r['speedup_vs_fsdp'])}" for r in qag)
        lines += ["", "Quantized weight all-gather against the plain FSDP2 row of the same recipe "
                  f"({records[0].get('world_size', 1)} rank(s)): {ratios}"]  # fmt: skip
    profiled = [r for r in records if "kernel_ms" in r]
    if profiled:
        lines += ["", "GPU kernel time per step (profiler, 3 steps):", "",
                  "| recipe | kernel ms | GEMM ms | attention ms | other ms | kernels/step "
                  "| syncs/step | GPU wall ms | GPU idle ms (<= 5 / 5-50 / > 50 us gaps) |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in profiled:
            lines.append(
                f"| {r['recipe']} | {r['kernel_ms']:.1f} | {r['gemm_ms']:.1f} | "
                f"{r['attention_ms']:.1f} | {r['other_ms']:.1f} | {r['kernels_per_step']} | "
                f"{r.get('syncs_per_step', '—')} | {_timeline_cells(r.get('timeline'))} |"
            )
        for r in profiled:
            if r.get("sync_sites"):
                lines += ["", f"Host synchronizations in a step, {r['recipe']}: "
                          + ", ".join(f"`{site}`" for site in r["sync_sites"])]  # fmt: skip
            lines += ["", f"Top kernels, {r['recipe']}:", "", "| kernel | ms/step | launches |",
                      "|---|---|---|"]  # fmt: skip
            lines += [f"| `{n}` | {ms:.2f} | {c} |" for n, ms, c in r["top_kernels"]]
            if r.get("timeline", {}).get("top_gaps"):
                lines += ["", f"Longest GPU idle gaps, {r['recipe']} (3 steps):", "",
                          "| us | kernel before | kernel after |", "|---|---|---|"]  # fmt: skip
                lines += [f"| {us:.0f} | `{a}` | `{b}` |" for us, a, b in r["timeline"]["top_gaps"]]
            lines += ["", f"Host (CPU) self time by op, {r['recipe']} (profiled, so slower than "
                      f"unprofiled steps): {r['host_self_ms']:.1f} ms/step", "",
                      "| op | ms/step | calls |", "|---|---|---|"]  # fmt: skip
            lines += [f"| `{n}` | {ms:.2f} | {c} |" for n, ms, c in r["top_host_ops"]]
    return "\n".join(lines)


def check_optim_states(names: list[str]) -> None:
    """Exit with one line for a preset this benchmark cannot run (its model has fp32 weights)."""
    from minifloat.optim import OPTIM_STATE_PRESETS, preset_param_dtype

    for name in names:
        if name not in OPTIM_STATE_PRESETS:
            choices = ", ".join(OPTIM_STATE_PRESETS)
            raise SystemExit(f"--optim-states {name!r}: choose one of {choices}")
        if preset_param_dtype(name) != "fp32":
            raise SystemExit(
                f"--optim-states {name!r} trains bf16 weights; this benchmark's are fp32"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the preset's shapes filled in and every row and option checked
    (one-line errors before any GPU time)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.3B", choices=sorted(PRESETS))
    ap.add_argument("--impl", default="ours", choices=("ours", "hf"))
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    ap.add_argument("--profile", default="", help="rows to profile (comma-separated)")
    ap.add_argument(
        "--dump-kernels",
        default=None,
        help="copy the inductor source of the profiled rows' 10 slowest Triton kernels here",
    )
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode (default: None)")
    ap.add_argument(
        "--compile-options", default="",
        help="inductor options of every compiled graph, KEY=VALUE[,...]; not with --compile-mode",
    )  # fmt: skip
    ap.add_argument("--compile-scope", default="model", choices=("model", "block"))
    ap.add_argument(
        "--loss", default="compiled", choices=LOSSES,
        help="the cross entropy eager (fp32 copies of the logits), compiled (fused; before "
        "session 54 every run's loss was eager) or chunked (with the head, no full logits)",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=None, help="override the preset's n_layers")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--date", default=None)
    ap.add_argument(
        "--optim-states", default="fp32",
        help="optimizer-state presets, comma-separated, each row run with each: fp32 (torch's "
        "fused AdamW) or one that keeps fp32 parameters (fp8-fp16, bf16: minifloat's AdamW)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    batch, seq, vocab = PRESETS[args.model]
    args.batch, args.seq, args.vocab = args.batch or batch, args.seq or seq, args.vocab or vocab
    args.profile = [r for r in args.profile.split(",") if r]
    args.compile_options = parse_compile_options(args.compile_options, args.compile_mode)
    args.rows = args.rows.split(",")
    args.optim_states = args.optim_states.split(",")
    check_optim_states(args.optim_states)
    for row in args.rows:  # fail on a typo before spending GPU time
        name, mode = split_row(row)
        if mode == "qag" and name in TORCHAO_ROWS and TORCHAO_ROWS[name] != "tensorwise":
            raise SystemExit(f"row {row}: torchao all-gathers float8 weights for tensorwise only")
        name, _, rule = name.partition("@")
        if name in TORCHAO_ROWS and rule:
            raise SystemExit(f"row {row}: a size rule applies to minifloat recipes only")
        if name not in TORCHAO_ROWS:
            recipes.get(name)
        if rule and rule != "torchao":
            SizeRule.parse(rule)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = args.rows
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        for _ in range(4)
    ]
    name = f"train_e2e_{args.model}_{args.impl}" + (f"_{args.tag}" if args.tag else "")
    print(f"{name}: rows {rows}", flush=True)
    out = {"day": args.date} | ({"out_dir": Path(args.out_dir)} if args.out_dir else {})
    records: list[dict] = []
    errors: list[dict] = []
    for row, states in [(row, states) for row in rows for states in args.optim_states]:
        label = row if len(args.optim_states) == 1 else f"{row} ({states} states)"
        try:
            records.append(run_row(args, row, batches, states))
            rec = records[-1]
            print(f"{label}: {rec['tokens_per_s']:,.0f} tokens/s, {rec['peak_mem_gib']:.1f} GiB, "
                  f"warm-up {rec['warmup_s']:.0f} s", flush=True)  # fmt: skip
        except Exception as exc:  # one failing row must not lose the others
            errors.append({"model": args.model, "impl": args.impl, "recipe": row,
                           "optim_states": states,
                           "error": f"{type(exc).__name__}: {exc}"[-3000:]})  # fmt: skip
            traceback.print_exc()
            print(f"{label}: FAILED", flush=True)
            release_memory()
        body = markdown(with_ratios(records), args)
        body += "".join(f"\n\n{e['recipe']}: error `{e['error'][-300:]}`" for e in errors)
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 writes
            md, _ = write_results(name, records + errors, body, **out)
    if int(os.environ.get("RANK", "0")) == 0:
        print(md.read_text())


if __name__ == "__main__":
    main()
