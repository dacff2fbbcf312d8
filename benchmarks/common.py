"""Shared benchmark helpers: CUDA timing (medians), environment description, results files."""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path

import torch

__all__ = [
    "time_ms", "alternating_ms", "stream_ms", "host_ms", "kernel_ms", "kernel_profile",
    "kernel_times", "host_ops", "copy_bandwidth", "environment", "gpu_tag", "write_results",
    "dump_kernel_sources", "step_fn", "RESULTS_DIR",
]  # fmt: skip

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_STARTED = time.time()  # dump_kernel_sources prefers the files this process wrote


def step_fn(
    module: torch.nn.Module,
    x: torch.Tensor,
    dy: torch.Tensor,
    mode: str | None = None,
    device: str = "cuda",
) -> Callable[[], None]:
    """One forward + backward of `module` (a layer or block, compiled or not) under bf16
    autocast on `device`, from fresh gradients: accumulating into x.grad and the weights'
    .grad would add eager adds to every step's kernels. Under CUDA graphs (compile mode
    "reduce-overhead") each call starts a new step for cudagraph trees: the last step's outputs
    are dead."""
    graphs = mode is not None and "reduce-overhead" in mode

    def step() -> None:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            y = module(x)
        y.backward(dy)

    return step


def _flushed_call_ms(fn: Callable[[], object], flush: torch.Tensor) -> float:
    """Milliseconds of one `fn()` between CUDA events, after `flush` is overwritten (L2 cold)."""
    flush.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _l2_flush() -> torch.Tensor:
    return torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")


def time_ms(fn: Callable[[], object], *, warmup: int = 5, reps: int = 20) -> float:
    """Median milliseconds of `fn()` on the current CUDA stream (CUDA events, after warm-up).

    The L2 cache is flushed before each repeat (a 256 MB write), so no repeat runs on data left in
    cache by the previous one.
    """
    flush = _l2_flush()
    for _ in range(warmup):
        fn()
    return statistics.median(_flushed_call_ms(fn, flush) for _ in range(reps))


def alternating_ms(fns: dict[str, Callable[[], object]], *, reps: int = 20) -> dict[str, float]:
    """Median milliseconds of each callable, as `time_ms` times one, the callables timed in
    alternation (one call of each a round), so that a change of clock or power state between
    rounds lands on all of them alike. One warm-up call each (compiles, autotunes)."""
    flush = _l2_flush()
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_flushed_call_ms(fn, flush))
    return {name: statistics.median(t) for name, t in times.items()}


def stream_ms(fn: Callable[[], object], *, warmup: int = 5, reps: int = 20) -> float:
    """Median milliseconds of `fn()` called back to back, as a training loop calls its steps.

    No host synchronization between calls, so the host may run ahead and the GPU does not wait
    for a call's first launches (which :func:`time_ms`, synchronizing after every call, counts
    in every call): for a call whose host time is below its GPU time this is its GPU time, and
    for a host-bound one, its host time. The L2 cache is flushed before each call, as there
    (the flush runs between the events that bracket the calls).
    """
    flush = _l2_flush()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def host_ms(fn: Callable[[], object], *, reps: int = 20) -> float:
    """Median host milliseconds until `fn()` returns, starting from an idle GPU (no sync inside
    the timing): the time to enqueue its work. Where it exceeds the GPU time of `fn`, a loop of
    such calls is bound by the host (Python, dispatch, launches), not by the GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    torch.cuda.synchronize()
    return statistics.median(times)


def loop_host_ms(fn: Callable[[], object], *, calls: int = 100, reps: int = 5) -> float:
    """Median over `reps` rounds of the host milliseconds per call of `calls` back-to-back calls
    of `fn` (no sync between them): the steady-state cost of enqueueing it, as in a training
    step whose host runs behind the GPU (`host_ms` starts each call from an idle GPU). Where
    the GPU's time a call exceeds the host's, the launch queue (~1,000 entries) fills and the
    host waits: then this measures the GPU."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1000.0 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernel_ms(fn: Callable[[], object], *, reps: int = 10) -> float | None:
    """GPU kernel milliseconds per call of `fn`: the sum of its kernels' durations (profiler).

    Against :func:`time_ms` this separates device work from host overhead: a call whose event
    time is well above its kernel time is bound by Python and launch costs, not by the GPU.
    None where the profiler reports no CUDA kernels.
    """
    return kernel_profile(fn, reps=reps)["kernel_ms"]


def kernel_profile(fn: Callable[[], object], *, reps: int = 10, top: int = 8) -> dict:
    """Per call of `fn`, from the profiler: `kernel_ms` (the sum of its CUDA kernels' times, None
    where there are none), `kernels` (launches) and `top_kernels` ([name, ms, launches], the
    `top` largest by time); see `kernel_times`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ms, launches = kernel_times(prof, reps)
    names = sorted(ms, key=ms.get, reverse=True)[:top]
    return {
        "kernel_ms": sum(ms.values()) if ms else None,
        "kernels": sum(launches.values()),
        "top_kernels": [[n[:100], round(ms[n], 3), launches[n]] for n in names],
        "top_host_ops": [(op, round(t, 3), n) for op, t, n in host_ops(prof, reps)[:top]],
    }


def host_ops(prof, calls: int) -> list[tuple[str, float, int]]:
    """[(op, host self ms, calls)] per call of a finished `torch.profiler` `prof` that ran
    `calls` calls, largest first: where the host's time goes (dispatcher calls, kernel
    launches, compiled-graph wrappers) when a step is bound by it rather than by the GPU."""
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key[:100], e.self_cpu_time_total / 1000.0 / calls, e.count // calls) for e in ops]


def kernel_times(prof, calls: int) -> tuple[dict[str, float], dict[str, float]]:
    """(GPU ms, launches) per kernel name and per call, from a finished `torch.profiler`
    `prof` that ran `calls` calls (steps). User annotations (`record_function` ranges, such as
    the one every optimizer.step() opens) also appear on the GPU timeline, over kernels that
    are counted themselves: they are left out, or a step's kernel time counts twice."""
    from torch.autograd import DeviceType

    us: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            us[e.name] = us.get(e.name, 0.0) + e.device_time_total
            count[e.name] = count.get(e.name, 0) + 1
    return {n: t / 1000.0 / calls for n, t in us.items()}, {n: c / calls for n, c in count.items()}


def cold_kernel_times(
    fn: Callable[[], object], *, reps: int = 10
) -> tuple[dict[str, float], dict[str, float]]:
    """`kernel_times` of `fn` per call, the L2 cache flushed before each call (as `time_ms`
    flushes it: a weight read in training is not in L2 either). The flush is a bitwise NOT of
    256 MB, a kernel that none of the timed forms launch (their memsets are fills, as
    `time_ms`'s flush is), profiled alone first and left out by name."""
    from torch.profiler import ProfilerActivity, profile

    flush = _l2_flush()
    with profile(activities=[ProfilerActivity.CUDA]) as alone:
        flush.bitwise_not_()
        torch.cuda.synchronize()
    flush_names = set(kernel_times(alone, 1)[0])
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    ms, launches = kernel_times(prof, reps)
    return (
        {n: t for n, t in ms.items() if n not in flush_names},
        {n: c for n, c in launches.items() if n not in flush_names},
    )


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as uint8 for one-byte dtypes (FP8: `torch.equal` on the bytes, so a NaN equals
    itself), else t itself."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def same_bits(want: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> bool:
    """Whether two sequences of tensors hold the same bits, pairwise (`raw_bits`)."""
    return len(want) == len(got) and all(
        torch.equal(raw_bits(a), raw_bits(b)) for a, b in zip(want, got, strict=True)
    )


def copy_bandwidth() -> float:
    """GB/s of a 256 MiB device-to-device copy (bytes read + written): the ceiling that
    memory-bound kernels are measured against."""
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src)) / 1e6


def environment() -> dict[str, str]:
    """Hardware and software versions, for the results header."""
    env = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "none"
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except ImportError:
        env["torchao"] = "none"
    return env


def gpu_tag() -> str:
    """Short GPU name for file names, e.g. "h100" or "h200"."""
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    for tag in ("h200", "h100", "a100", "l4", "l40"):
        if tag in name:
            return tag
    return name.replace(" ", "-")


def write_results(
    name: str,
    records: list[dict],
    markdown_body: str,
    *,
    out_dir: Path = RESULTS_DIR,
    day: str | None = None,
) -> tuple[Path, Path]:
    """Write `<name>_<gpu>_<date>.md` (environment header + body) and its `.json` twin."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{gpu_tag()}_{day or date.today().isoformat()}"
    env = environment()
    header = "\n".join(f"- {k}: {v}" for k, v in env.items())
    md = out_dir / f"{stem}.md"
    md.write_text(f"# {name} benchmark\n\n{header}\n\n{markdown_body}\n")
    js = out_dir / f"{stem}.json"
    js.write_text(json.dumps(records, indent=1))
    return md, js


def dump_kernel_sources(names: list[str], dest: Path, prefix: str, limit: int) -> list[Path]:
    """Copy inductor's generated source of the first `limit` Triton kernels in `names` (profiler
    kernel names, slowest first) from its cache (TORCHINDUCTOR_CACHE_DIR or the default) to
    `dest/<prefix>_<i>_<name>.py`.

    Kernel names repeat across graphs and processes (every compiled graph numbers its kernels
    from 0), so a shared cache holds several sources per name: files this process wrote are
    preferred, and among them the kernel's own file over the graph module that embeds it.
    """
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.environ.get('USER', 'root')}"
    )
    wanted = [n for n in names if n.startswith("triton_")][:limit]
    paths = glob.glob(os.path.join(cache, "**", "*.py"), recursive=True)
    sources = {p: Path(p).read_text(errors="ignore") for p in paths} if wanted else {}
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for i, name in enumerate(wanted):
        # names may come truncated (profiler tables): match a long one as a prefix
        needle = f"def {name}" + ("(" if len(name) < 200 else "")
        matches = [p for p, text in sources.items() if needle in text]
        if not matches:
            continue
        best = min(matches, key=lambda p: (os.path.getmtime(p) < _STARTED, os.path.getsize(p)))
        target = dest / f"{prefix}_{i}_{name[:60]}.py"
        shutil.copy(best, target)
        copied.append(target)
    return copied


def median(values: list[float]) -> float:
    return statistics.median(values)


def same_bytes(a, b) -> bool:
    """Whether tensors `a` and `b` (or equal-length tuples of them) hold the same bytes: values
    compared bit for bit, NaN payloads and the sign of zero included."""
    a, b = (a,) if torch.is_tensor(a) else a, (b,) if torch.is_tensor(b) else b
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    return all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(a, b, strict=True))


def probe_parser(
    doc: str, tiles: str | None = None, tiles_help: str = ""
) -> argparse.ArgumentParser:
    """The GPU probes' common options: --out-dir, --date, --tag, and with a default `tiles`
    --tiles (';'-separated tuples of integers, parsed by `parse_tiles`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    ap.add_argument("--tag", default="", help="results file suffix")
    if tiles is not None:
        ap.add_argument("--tiles", default=tiles, help=tiles_help)
    return ap


def write_probe(base: str, args: argparse.Namespace, records: list[dict], body: str) -> Path:
    """A probe's results as `<base>[_<tag>]_<gpu>_<date>.{md,json}` under probe_parser's
    --out-dir, --date and --tag, the command line above `body`; prints and returns the .md."""
    name = "_".join(filter(None, (base, args.tag)))
    text = f"`{shlex.join(sys.argv)}`\n\n{body}"
    md, _ = write_results(name, records, text, out_dir=Path(args.out_dir), day=args.date)
    print(md)
    return md


def parse_tiles(text: str) -> list[tuple[int, ...]]:
    """'64,64,4;32,128,4' -> [(64, 64, 4), (32, 128, 4)]."""
    return [tuple(int(v) for v in t.split(",")) for t in text.split(";")]


def require_cuda(name: str) -> None:
    """Exit with a one-line message where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU")
