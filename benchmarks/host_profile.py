"""Where one compiled layer's host time goes: guards, graph wrappers, launches, `_scaled_mm`.

    PYTHONPATH=src python benchmarks/host_profile.py [--k 4096 --n 4096 --m 16384]
        [--recipes fp8-tensorwise,fp4-dge,fp4] [--no-torchao] [--tag NAME]
        [--compile-options cpp_wrapper=True,triton.store_cubin=True]

A 7B-shaped 4096 x 4096 layer is host-bound on the H200's hosts: session 47 measured 2.3 ms of
host a step for fp8-tensorwise's 1.5 ms of kernels, against 0.97 ms of host for bf16's
`nn.Linear` and 1.75 ms for torchao tensorwise (`linear_compiled_s47_...`), so the host decides
that shape's speed-up. For bf16 `nn.Linear`, torchao tensorwise and each recipe's `QuantLinear`,
compiled as `linear.py --compile` runs them (bf16 autocast, fp32 master weight), this measures:
- the host's milliseconds to enqueue the forward, the backward and the whole step from an idle
  GPU (medians of 20);
- dynamo's guard check alone: the compiled frame's cache entry checked in a loop (µs);
- the steps back to back (`stream_ms`) and the host's own time for them without a profiler;
- cProfile over 50 steps back to back: the functions with the most own time, per step.
Results: benchmarks/results/host_profile_<gpu>_<date>[_<tag>].{md,json}. `--device cpu` runs
the recipes' emulation instead (no torchao), a check of the script.
"""

from __future__ import annotations

import cProfile
import inspect
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import probe_parser, step_fn, write_probe  # noqa: E402
from e2e_setup import parse_compile_options  # noqa: E402
from minifloat import recipes  # noqa: E402
from minifloat.linear import QuantLinear  # noqa: E402

STEPS = 50  # back-to-back steps under cProfile and in the unprofiled host timing
TOP = 18  # functions listed per variant


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(
    name: str, k: int, n: int, w: torch.Tensor, device: str, options: dict | None = None
) -> tuple[nn.Module, nn.Module]:
    """(the compiled module, the module whose `forward` dynamo compiled) for a variant name;
    `options`: inductor's, for every variant alike."""
    if name == "bf16":
        inner = nn.Linear(k, n, bias=False, device=device)
    elif name == "torchao-tensorwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        inner = nn.Sequential(nn.Linear(k, n, bias=False, device=device))
        convert_to_float8_training(inner, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    else:
        backend = "hopper" if device == "cuda" else "emulated"
        inner = QuantLinear(k, n, bias=False, recipe=recipes.get(name), backend=backend,
                            device=device)  # fmt: skip
    first = inner[0] if isinstance(inner, nn.Sequential) else inner
    first.weight.data.copy_(w)
    return torch.compile(inner, options=options), inner


def host_phases(mod: nn.Module, x: torch.Tensor, dy: torch.Tensor, device: str) -> dict:
    """Median host ms of the forward, the backward and the step, each from an idle GPU."""
    fwd, bwd, step = [], [], []
    for _ in range(20):
        x.grad = None
        for p in mod.parameters():
            p.grad = None
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = mod(x)
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        y.backward(dy)
        t3 = time.perf_counter()
        _sync(device)
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t3 - t2) * 1e3)
        step.append((t1 - t0 + t3 - t2) * 1e3)
    med = statistics.median
    return {"host_fwd_ms": med(fwd), "host_bwd_ms": med(bwd), "host_step_ms": med(step)}


def _guard_manager(inner: nn.Module):
    """Dynamo's guard manager of the compiled `forward` of `inner`, or None where it cannot be
    read (a private API: best effort; nn.Linear's compiled frame is not its forward's)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(type(inner).forward.__code__)
    except Exception as exc:  # a private API's change must not stop the probe
        print(f"guards unavailable: {type(exc).__name__}: {exc}", flush=True)
        return None
    return entries[0].guard_manager if entries else None


def guard_us(inner: nn.Module, x: torch.Tensor, device: str) -> tuple[float | None, int | None]:
    """(µs per check of dynamo's guards on the compiled forward, the guard tree's lines), or
    (None, None) where the guards cannot be read or do not pass on these inputs."""
    manager = _guard_manager(inner)
    if manager is None:
        return None, None
    names = list(inspect.signature(type(inner).forward).parameters)
    f_locals = {names[0]: inner, names[1]: x}
    with torch.autocast(device, dtype=torch.bfloat16):
        if not manager.check(f_locals):
            return None, None
        reps = 2000
        t0 = time.perf_counter()
        for _ in range(reps):
            manager.check(f_locals)
        us = (time.perf_counter() - t0) / reps * 1e6
    return us, len(str(manager).splitlines())


def _where(key: tuple) -> str:
    file, line, func = key
    return (f"{Path(file).name}:{line}({func})" if file != "~" else func)[:110]


def _row(key: tuple, calls: int, own_s: float, cum_s: float) -> dict:
    """One function's calls and own and cumulative µs per step."""
    return {"function": _where(key), "calls": calls / STEPS,
            "own_us": own_s / STEPS * 1e6, "cum_us": cum_s / STEPS * 1e6}  # fmt: skip


def _generated_calls(stats: pstats.Stats) -> dict[str, dict]:
    """For each inductor-generated `call` (a compiled graph's wrapper code): its source file
    and its callees' calls and times per step, largest cumulative first."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    generated = cache_dir()  # where inductor writes its wrapper code (TORCHINDUCTOR_CACHE_DIR)
    calls = {}
    for key in stats.stats:
        file, _, func = key
        if func == "call" and file.startswith(generated):
            callees = []
            for callee, (_, _, _, _, callers) in stats.stats.items():
                if key in callers:
                    _, n, own, cum = callers[key]
                    callees.append(_row(callee, n, own, cum))
            callees.sort(key=lambda r: r["cum_us"], reverse=True)
            calls[_where(key)] = {"source": file, "callees": callees}
    return calls


def profiled(step, device: str, dump: Path | None) -> tuple[float, list[dict], dict]:
    """(host ms a step over STEPS back-to-back steps without a profiler, cProfile's top
    functions by own time: [{function, calls, own_us, cum_us}] per step, `_generated_calls`);
    the whole profile also to `dump`/host.pstats where given."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    host = (time.perf_counter() - t0) / STEPS * 1e3
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(STEPS):
        step()
    prof.disable()
    _sync(device)
    if dump is not None:
        prof.dump_stats(dump / "host.pstats")
    stats = pstats.Stats(prof)
    rows = []
    for key, (_, calls, own, cum, _) in stats.stats.items():
        rows.append(_row(key, calls, own, cum))
    rows.sort(key=lambda r: r["own_us"], reverse=True)
    return host, rows[:TOP], _generated_calls(stats)


def measure(name: str, args, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict:
    mod, inner = build(name, args.k, args.n, w, args.device, args.compile_options)
    step = step_fn(mod, x, dy, device=args.device)

    for _ in range(3):
        step()
    _sync(args.device)
    rec = {"variant": name, "K": args.k, "N": args.n, "M": args.m,
           "compile_options": args.compile_options or {}}  # fmt: skip
    rec |= host_phases(mod, x, dy, args.device)
    rec["guard_us"], rec["guard_lines"] = guard_us(inner, x, args.device)
    dump = Path(args.dump_dir) / name if args.dump_dir else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    rec["host_stream_ms"], rec["top_functions"], graphs = profiled(step, args.device, dump)
    rec["graph_calls"] = {k: v["callees"] for k, v in graphs.items()}
    if dump is not None:  # the compiled graphs' wrapper code and the guard tree, to read
        for g in graphs.values():
            shutil.copy(g["source"], dump / Path(g["source"]).name)
        manager = _guard_manager(inner)
        (dump / "guards.txt").write_text("" if manager is None else str(manager))
    if args.device == "cuda":
        from common import stream_ms

        rec["stream_ms"] = stream_ms(step)
    torch._dynamo.reset()
    print(f"{name:20s} host step {rec['host_step_ms']:.3f} ms (fwd {rec['host_fwd_ms']:.3f}, "
          f"bwd {rec['host_bwd_ms']:.3f}), back to back {rec['host_stream_ms']:.3f} ms, "
          f"guards {rec['guard_us']} us", flush=True)  # fmt: skip
    return rec


def markdown(records: list[dict]) -> str:
    lines = [(
        "Host milliseconds of one compiled layer's forward, backward and step, each from an idle "
        "GPU (median of 20); 'back to back' is the host's time a step over 50 steps without a "
        "profiler; 'streamed' the GPU-timed steps back to back (common.stream_ms); guards: one "
        "check of dynamo's guard tree on the compiled forward."), "",
        "| variant | host fwd ms | host bwd ms | host step ms | back to back ms | streamed ms "
        "| guard µs | guard lines |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    fmt = lambda v, s=".3f": "" if v is None else format(v, s)  # noqa: E731
    for r in records:
        lines.append(f"| {r['variant']} | {fmt(r['host_fwd_ms'])} | {fmt(r['host_bwd_ms'])} | "
                     f"{fmt(r['host_step_ms'])} | {fmt(r['host_stream_ms'])} | "
                     f"{fmt(r.get('stream_ms'))} | {fmt(r['guard_us'], '.1f')} | "
                     f"{fmt(r['guard_lines'], 'd')} |")  # fmt: skip
    for r in records:
        lines += [
            "",
            f"### {r['variant']}: cProfile, own time per step (profiled, so inflated)",
            "",
            "| function | calls | own µs | cumulative µs |",
            "|---|---|---|---|",
        ]
        for f in r["top_functions"]:
            lines.append(f"| `{f['function']}` | {f['calls']:g} | {f['own_us']:.1f} | "
                         f"{f['cum_us']:.1f} |")  # fmt: skip
        for graph, callees in r.get("graph_calls", {}).items():
            lines += [
                "",
                f"Called from the compiled graph `{graph}`:",
                "",
                "| function | calls | own µs | cumulative µs |",
                "|---|---|---|---|",
            ]
            for f in callees[:12]:
                lines.append(f"| `{f['function']}` | {f['calls']:g} | {f['own_us']:.1f} | "
                             f"{f['cum_us']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--recipes", default="fp8-tensorwise,fp4-dge,fp4")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dump-dir", default=None, help="copy each variant's graph code and guards")
    ap.add_argument(
        "--compile-options", default="",
        help="inductor options of every variant, KEY=VALUE[,...], e.g. "
        "cpp_wrapper=True,triton.store_cubin=True (the graphs' wrapper in C++)",
    )  # fmt: skip
    args = ap.parse_args()
    args.compile_options = parse_compile_options(args.compile_options)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("host_profile.py needs a CUDA GPU (or --device cpu)")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.m, args.k, generator=gen).to(args.device).requires_grad_()
    w = (torch.randn(args.n, args.k, generator=gen) / args.k**0.5).to(args.device)
    dy = torch.randn(args.m, args.n, generator=gen).to(args.device, torch.bfloat16)
    names = ["bf16"] + ([] if args.no_torchao or args.device != "cuda" else ["torchao-tensorwise"])
    records = []
    for name in names + args.recipes.split(","):
        try:
            records.append(measure(name, args, x, w, dy))
        except Exception as exc:  # torchao missing must not stop the probe
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
    write_probe("host_profile", args, records, markdown(records))


if __name__ == "__main__":
    main()
