"""Time fprop + dgrad + wgrad of one linear layer per recipe against BF16 nn.Linear and torchao.

    PYTHONPATH=src python benchmarks/linear.py [--shapes 7b] [--recipes fp4,fp8-rowwise] [--compile]

M = 16384 tokens (--tokens); (K, N) in (4096, 4096), (4096, 11008), (11008, 4096),
(2048, 5632), (2048, 2048); `--shapes grid` times the small and mid-size layers of 125M-1.3B
models, the measurement a `minifloat.SizeRule` could be taken from (`--no-breakdown
--no-torchao` keep it short; read its kernel-time column: one small layer is host-bound, and
inside a compiled block quantizers fuse with their neighbours, docs/hopper_sessions.md, session 8).
Every layer runs under bf16 autocast with fp32 master weights (as in training).
The end-to-end time of one forward + backward is the median of CUDA-event timings with the L2
flushed, synchronized after every step (`ms`) and with the steps back to back as a training loop
runs them (`stream_ms`: the host may run ahead, so a step does not wait for its first launches;
the issue-13 targets table shows both); the breakdown times the backend calls linear.py makes
(quantization, the three GEMMs, DGE, OCC) one group at a time. Saved bytes count every tensor
autograd saves for the backward except the parameters themselves. Results:
benchmarks/results/linear_<gpu>_<date>.md + .json.

`--compile` wraps every layer (bf16 nn.Linear, torchao, QuantLinear) in torch.compile, as the
trainer's `--compile` does: the fair comparison with torchao, which is meant to be compiled, and
the measure of how much of eager mode's quantization time is host overhead (many small launches)
rather than GPU work. Its results go to linear_compiled_<gpu>_<date>. `--compile-mode
reduce-overhead` replays every layer's compiled forward and backward as CUDA graphs (one launch
each); for a single layer that did not pay on an H200, since the cudagraph trees' own replay
took ~1 ms of host a step (docs/hopper_sessions.md, session 17). `--compile-options` passes
inductor options to every compiled layer alike, e.g. `cpp_wrapper=True,triton.store_cubin=True`
(each graph's wrapper in C++; on torch 2.11 it needs store_cubin: session 53).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    environment,
    host_ms,
    kernel_profile,
    step_fn,
    stream_ms,
    time_ms,
    write_results,
)
from e2e_setup import parse_compile_options  # noqa: E402
from minifloat import delayed, occ_gemm, recipes  # noqa: E402
from minifloat import occ as occ_math  # noqa: E402
from minifloat.kernels.hopper import HopperBackend  # noqa: E402
from minifloat.linear import QuantLinear  # noqa: E402

M = 16384
SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (2048, 5632), (2048, 2048)]
SHAPES_7B = SHAPES[:3]
# 125M (dim 768, ffn 2048), 350M-ish (1024, 4096) and 1.3B (2048, 5504) projections.
SHAPES_GRID = [(768, 768), (768, 2048), (2048, 768), (1024, 1024), (1024, 4096), (4096, 1024),
               (2048, 2048), (2048, 5504), (5504, 2048)]  # fmt: skip
RECIPES = [
    "fp8-tensorwise",
    "fp8-rowwise",
    "fp8-blockwise",
    "fp8-delayed",
    "fp4-direct",
    "fp4-dge",
    "fp4",  # DGE + OCC: sampled thresholds, E4M3 compensation (occ_gemm.py)
]  # fmt: skip
TARGETS = {  # geometric-mean speed-up over the 7B shapes (issue 13, compiled)
    "fp8-tensorwise": 1.50,
    "fp4-dge": 1.45,
    "fp4": 1.15,
}


def make_inputs(k: int, n: int, m: int = M, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen)
    # 128 outlier channels 50x larger: the activation structure OCC is designed for.
    idx = torch.randperm(k, device="cuda", generator=gen)[:128]
    x[:, idx] *= 50.0
    x = x.bfloat16().requires_grad_(True)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    return x, w, dy


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves during one forward, parameters excluded (storages counted once)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x)
    del y
    return sum(seen.values())


def torchao_module(
    k: int, n: int, w: torch.Tensor, recipe_name: str, compile_it: bool, mode: str | None,
    options: dict | None = None,
):  # fmt: skip
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda"))
    lin[0].weight.data.copy_(w)
    convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return maybe_compile(lin, compile_it, mode, options)


# ---------------------------------------------------------------------------------------------
# Breakdown: the backend calls of QuantLinearFunction, grouped
# ---------------------------------------------------------------------------------------------


def breakdown(recipe, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    """Milliseconds of quantization, GEMMs, DGE and OCC, timed group by group."""
    be = HopperBackend()
    xd = x.detach()
    hist = torch.zeros(3, 16, device="cuda")
    st: dict = {}

    def occ():
        if recipe.occ is None:
            return
        st["clip"] = occ_math.thresholds(xd, recipe.occ)
        comp = occ_gemm.compensation(recipe)
        if comp is not None:
            part = occ_gemm.partial_dtype(comp, torch.bfloat16)  # the layers run under autocast
            occ_gemm.fprop_correction(
                be, comp, xd, st["clip"], w, recipe.fprop_fast_accum, out_dtype=part
            )
            if occ_gemm.folds_remainder(recipe):  # the fold replaces x_q's transpose
                x_q = be.quantize(xd, recipe.fprop.lhs, clip=st["clip"])
                occ_gemm.folded_wgrad_operand(be, xd, st["clip"], x_q, recipe.folds("wgrad"))
            else:
                rhs = occ_gemm.remainder_wgrad_operand(be, comp, xd, st["clip"])
                occ_gemm.wgrad_correction(be, comp, dy, rhs)

    def quant():
        d = recipe.delayed
        sx = sw = sg = None
        if d is not None:
            sx = delayed.history_scale(hist, 0, delayed.amax(xd), recipe.fprop.lhs.fmt, d)
            sw = delayed.history_scale(hist, 1, delayed.amax(w), recipe.fprop.rhs.fmt, d)
            sg = delayed.history_scale(hist, 2, delayed.amax(dy), recipe.dgrad.lhs.fmt, d)
        clip = st.get("clip")
        st["x_q"] = x_q = be.quantize(xd, recipe.fprop.lhs, clip=clip, scale=sx)
        st["w_q"] = w_q = be.quantize(w, recipe.fprop.rhs, scale=sw)
        if recipe.wgrad.rhs.reuse:
            st["x_rhs"] = be.transpose(x_q, unit_scale=recipe.folds("wgrad"))
        else:
            st["x_rhs"] = be.quantize(xd, recipe.wgrad.rhs, clip=clip, transpose=True, scale=sx)
        if recipe.dgrad.rhs.reuse:
            st["w_rhs"] = be.transpose(w_q, unit_scale=recipe.folds("dgrad"))
        else:
            st["w_rhs"] = be.quantize(w, recipe.dgrad.rhs, transpose=True)
        pre = w_q.scale.t() if recipe.folds("dgrad") else None
        st["g_q"] = g_q = be.quantize(dy, recipe.dgrad.lhs, prescale=pre, scale=sg)
        lhs = recipe.wgrad.lhs
        if lhs == recipe.dgrad.lhs and lhs.granularity == "tensor" and pre is None:
            st["h_q"] = be.transpose(g_q)
        else:
            pre = x_q.scale if recipe.folds("wgrad") else None
            st["h_q"] = be.quantize(dy, lhs, prescale=pre, transpose=True, scale=sg)

    def gemm():
        be.scaled_mm(st["x_q"], st["w_q"], out_dtype=torch.bfloat16)
        be.scaled_mm(st["g_q"], st["w_rhs"], out_dtype=torch.bfloat16)
        st["dw"] = be.scaled_mm(st["h_q"], st["x_rhs"], out_dtype=torch.float32)

    def dge():
        if recipe.dge is not None:
            be.apply_dge(st["dw"], w, st["w_q"], recipe.dge)

    out = {}
    for name, fn in (("occ", occ), ("quant", quant), ("gemm", gemm), ("dge", dge)):
        fn()
        out[f"{name}_ms"] = time_ms(fn, warmup=2, reps=10)
    return out


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def gpu_profile(step) -> dict:
    """`kernel_ms` (GPU kernel time of one step), `kernels` (launches a step: what a host-bound
    step pays for), `top_kernels` and `top_host_ops` (common.kernel_profile); empty if the
    profiler fails."""
    try:
        return kernel_profile(step)
    except Exception as exc:  # a profiler problem must not stop the benchmark
        print(f"kernel time unavailable: {type(exc).__name__}: {exc}", flush=True)
        return {}


def _streamed(step, bf16_stream: float) -> dict:
    """`stream_ms` (steps back to back, common.stream_ms) and its ratio to bf16's."""
    ms = stream_ms(step)
    return {"stream_ms": ms, "stream_speedup_vs_bf16": bf16_stream / ms}


def maybe_compile(
    module: nn.Module, compile_it: bool, mode: str | None, options: dict | None = None
) -> nn.Module:
    return torch.compile(module, mode=mode, options=options) if compile_it else module


def bench_shape(
    k: int, n: int, names: list[str], args: argparse.Namespace
) -> list[dict]:  # fmt: skip
    """Records of one (K, N): bf16, torchao (unless --no-torchao) and every recipe of `names`."""
    compile_all, torchao_compile, m = args.compile, args.torchao_compile, args.tokens
    mode, options = args.compile_mode, args.compile_options
    x, w, dy = make_inputs(k, n, m)
    records = []
    base = nn.Linear(k, n, bias=False, device="cuda")
    base.weight.data.copy_(w)
    base_step = step_fn(maybe_compile(base, compile_all, mode, options), x, dy, mode)
    bf16_ms = time_ms(base_step)
    bf16_stream = stream_ms(base_step)
    bf16_saved = saved_bytes(base, x)
    records.append(dict(recipe="bf16", K=k, N=n, M=m, ms=bf16_ms, speedup_vs_bf16=1.0,
                        stream_ms=bf16_stream, stream_speedup_vs_bf16=1.0,
                        peak_saved_bytes=bf16_saved, host_ms=host_ms(base_step))
                   | gpu_profile(base_step))  # fmt: skip
    torch._dynamo.reset()
    for ao in () if args.no_torchao else ("tensorwise", "rowwise"):
        name = f"torchao-{ao}" + ("-compiled" if torchao_compile else "")
        try:
            mod = torchao_module(k, n, w, ao, torchao_compile or compile_all, mode, options)
            step = step_fn(mod, x, dy, mode)
            ms = time_ms(step)
            rec = dict(recipe=name, K=k, N=n, M=m, ms=ms, speedup_vs_bf16=bf16_ms / ms,
                       peak_saved_bytes=saved_bytes(mod, x), host_ms=host_ms(step))  # fmt: skip
            rec |= _streamed(step, bf16_stream)
        except Exception as exc:  # torchao missing or failing must not stop the benchmark
            rec = dict(recipe=name, K=k, N=n, M=m, error=f"{type(exc).__name__}: {exc}"[:300])
        records.append(rec)
        torch._dynamo.reset()
    for rname in names:
        recipe = recipes.get(rname)
        layer = QuantLinear(k, n, bias=False, recipe=recipe, backend="hopper", device="cuda")
        layer.weight.data.copy_(w)
        step = step_fn(maybe_compile(layer, compile_all, mode, options), x, dy, mode)
        ms = time_ms(step)
        rec = dict(recipe=rname, K=k, N=n, M=m, ms=ms, speedup_vs_bf16=bf16_ms / ms,
                   peak_saved_bytes=saved_bytes(layer, x), host_ms=host_ms(step))  # fmt: skip
        rec |= _streamed(step, bf16_stream) | gpu_profile(step)
        torch._dynamo.reset()
        rec["saved_vs_bf16"] = rec["peak_saved_bytes"] / bf16_saved
        if not args.no_breakdown:
            rec.update(breakdown(recipe, x, w, dy))
        records.append(rec)
        print(f"K={k} N={n} {rname:18s} {ms:7.3f} ms  x{bf16_ms / ms:.2f}", flush=True)
    print(f"K={k} N={n} {'bf16':18s} {bf16_ms:7.3f} ms", flush=True)
    extra = {"compiled": compile_all, "compile_mode": mode, "compile_options": options or {}}
    return [r | extra for r in records]


def markdown(records: list[dict], compiled: bool = False) -> str:
    modes = sorted({str(r.get("compile_mode")) for r in records})
    options = sorted({str(r["compile_options"]) for r in records if r.get("compile_options")})
    with_options = f", inductor options {'; '.join(options)}" if options else ""
    mode = (
        f"every layer under torch.compile (mode {', '.join(modes)}{with_options})"
        if compiled
        else "eager"
    )
    tokens = sorted({r["M"] for r in records})
    lines = [
        f"`{' '.join(['benchmarks/linear.py', *sys.argv[1:]])}`",
        "",
        f"M = {', '.join(map(str, tokens))} tokens; one forward + backward (fprop, dgrad, wgrad) "
        "under bf16 autocast, "
        f"{mode}; the breakdown is eager in both modes; "
        "median ms, L2 flushed. Breakdown columns time the backend's calls group by group "
        "(their sum differs from the end-to-end time by autograd and PyTorch glue). "
        "'kernel ms' is the GPU kernel time of one step (profiler): where 'ms' is well above "
        "it, the step is bound by host overhead, not by the GPU; 'kernels' its kernel launches; "
        "'host ms' is the host's time to enqueue one step from an idle GPU. 'ms' synchronizes "
        "after every step, so each step also waits for its first launches; 'streamed ms' runs "
        "the steps back to back, as a training loop does (no synchronization between them).",
        "",
        "| K | N | recipe | ms | streamed ms (vs bf16) | kernel ms | kernels | host ms | vs bf16 "
        "| quant | GEMM | DGE | OCC | saved MiB (vs bf16) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['K']} | {r['N']} | {r['recipe']} | error: {r['error']} |")
            continue
        parts = [f"{r[key]:.3f}" if key in r else "" for key in
                 ("quant_ms", "gemm_ms", "dge_ms", "occ_ms")]  # fmt: skip
        ratio = f" ({r['saved_vs_bf16']:.2f}x)" if "saved_vs_bf16" in r else ""
        streamed = (
            f"{r['stream_ms']:.3f} ({r['stream_speedup_vs_bf16']:.2f}x)" if "stream_ms" in r else ""
        )
        lines.append(
            f"| {r['K']} | {r['N']} | {r['recipe']} | {r['ms']:.3f} | {streamed} | "
            f"{_opt(r.get('kernel_ms'))} | "
            f"{_opt(r.get('kernels'), '.0f')} | {_opt(r.get('host_ms'))} | "
            f"{r['speedup_vs_bf16']:.2f}x | {' | '.join(parts)} | "
            f"{r['peak_saved_bytes'] / 2**20:.0f}{ratio} |"
        )
    lines += ["", targets_table(records)]
    return "\n".join(lines)


def _opt(value: float | None, spec: str = ".3f") -> str:
    return "" if value is None else f"{value:{spec}}"


def _geomean(records: list[dict], name: str, key: str) -> float | None:
    sp = [r[key] for r in records
          if r["recipe"] == name and (r["K"], r["N"]) in SHAPES_7B and key in r]  # fmt: skip
    return math.exp(sum(map(math.log, sp)) / len(sp)) if sp else None  # float64


def _kernel_geomean(records: list[dict], name: str) -> float | None:
    """Geometric mean over the 7B shapes of bf16's GPU kernel time over `name`'s: the speed-up
    with the host's time left out (None where a shape lacks either kernel time)."""
    bf16 = {(r["K"], r["N"]): r.get("kernel_ms") for r in records if r["recipe"] == "bf16"}
    pairs = [(bf16.get((r["K"], r["N"])), r.get("kernel_ms")) for r in records
             if r["recipe"] == name and (r["K"], r["N"]) in SHAPES_7B]  # fmt: skip
    if not pairs or not all(base and ms for base, ms in pairs):
        return None
    return math.exp(sum(math.log(base / ms) for base, ms in pairs) / len(pairs))


def _down3(x: float) -> str:
    """x to 3 decimals, rounded down (by at most 1e-9 more), so that no speed-up below its
    target prints as the target: a streamed 1.4998x read "1.50x ... no" (session 47)."""
    return f"{math.floor(x * 1000 + 1e-9) / 1000:.3f}x"


def targets_table(records: list[dict]) -> str:
    """The 7B targets: synchronized, streamed and kernel-time geometric means (`_down3`)."""
    lines = ["## Targets at the 7B shapes (geometric mean of speed-ups, 3 decimals rounded down)",
             "", "| recipe | measured | target | met | streamed | met streamed | by kernel time |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, target in TARGETS.items():
        gm = _geomean(records, name, "speedup_vs_bf16")
        if gm is None:
            continue
        gs = _geomean(records, name, "stream_speedup_vs_bf16")
        streamed = (
            "| | |" if gs is None else f"| {_down3(gs)} | {'yes' if gs >= target else 'no'} |"
        )
        gk = _kernel_geomean(records, name)
        kernel = "" if gk is None else _down3(gk)
        lines.append(
            f"| {name} | {_down3(gm)} | {target}x | {'yes' if gm >= target else 'no'} {streamed} "
            f"{kernel} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="all", help="'all', '7b', 'grid', or K:N,K:N")
    ap.add_argument("--tokens", type=int, default=M, help="M, the rows of x")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the eager breakdown")
    ap.add_argument("--no-torchao", action="store_true", help="skip the torchao rows")
    ap.add_argument("--tag", default="", help="suffix of the results files")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--compile", action="store_true", help="torch.compile every layer")
    ap.add_argument("--torchao-compile", action="store_true", help="torch.compile torchao layers")
    ap.add_argument(
        "--compile-mode", default=None,
        help="torch.compile mode of every compiled layer, e.g. reduce-overhead (CUDA graphs)",
    )  # fmt: skip
    ap.add_argument(
        "--compile-options", default="",
        help="inductor options of every compiled layer, KEY=VALUE[,KEY=VALUE...], e.g. "
        "cpp_wrapper=True",
    )  # fmt: skip
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--date", default=None)
    args = ap.parse_args()
    args.compile_options = parse_compile_options(args.compile_options, args.compile_mode)
    if args.shapes == "all":
        shapes = SHAPES
    elif args.shapes == "7b":
        shapes = SHAPES_7B
    elif args.shapes == "grid":
        shapes = SHAPES_GRID
    else:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    print(environment(), flush=True)
    records = []
    kw = {"day": args.date} | ({"out_dir": Path(args.out_dir)} if args.out_dir else {})
    name = ("linear_compiled" if args.compile else "linear") + (f"_{args.tag}" if args.tag else "")
    for k, n in shapes:
        records += bench_shape(k, n, args.recipes.split(","), args)
        torch.cuda.empty_cache()
        # rewritten after every shape: a run stopped by a time limit keeps what it measured
        md, js = write_results(name, records, markdown(records, args.compile), **kw)
    print(md.read_text())
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
