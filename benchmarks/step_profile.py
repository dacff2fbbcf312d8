"""What a training step spends on the GPU, from the profiler: kernel time by class (GEMM,
attention, everything else), launches, the top kernels and host ops, and the host-device
synchronizations a step makes. Used by train_e2e.py for the rows it profiles."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host_ops, kernel_times  # noqa: E402

__all__ = [
    "GEMM_WORDS",
    "ATTENTION_WORDS",
    "classify",
    "idle_gaps",
    "profile_steps",
    "find_syncs",
]

GEMM_WORDS = ("gemm", "nvjet", "xmma", "cutlass", "matmul", "splitk")
ATTENTION_WORDS = ("flash", "fmha", "attention", "attn")


def classify(name: str) -> str:
    """A kernel's class by its name: "attention", "gemm" or "other"."""
    low = name.lower()
    if any(w in low for w in ATTENTION_WORDS):
        return "attention"
    if any(w in low for w in GEMM_WORDS):
        return "gemm"
    return "other"


# Gap classes on the GPU timeline, in microseconds: up to 5 us is the spacing of back-to-back
# launches from a full queue; longer gaps are the GPU waiting for something.
_GAP_CLASSES = ((5.0, "gaps <= 5 us"), (50.0, "5-50 us"), (float("inf"), "> 50 us"))


def idle_gaps(spans: list[tuple[float, float, str]], steps: int, top: int = 10) -> dict:
    """Where the GPU idles between its kernels, per step, from (start us, end us, name) spans.

    Overlapping spans (several streams) count once. `wall_ms` is the first start to the last
    end over `steps`; `busy_ms` the union of the spans; `idle_ms` the rest, also split by gap
    length (`idle_by_gap`: ms and gaps per step); `top_gaps` the longest [us, kernel before,
    kernel after]. Against the sum of kernel times this says whether a step's time beyond its
    kernels is launch spacing (many short gaps) or waits (a few long ones).
    """
    if not spans:
        return {}
    spans = sorted(spans)
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    start, end, prev = spans[0]
    for s, e, name in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, prev, name))
            start = s
        if e >= end:
            end, prev = e, name
    busy += end - start
    wall = end - spans[0][0]  # `end` is the latest end seen
    by_class = {label: [0.0, 0] for _, label in _GAP_CLASSES}
    for us, _, _ in gaps:
        label = next(lab for bound, lab in _GAP_CLASSES if us <= bound)
        by_class[label][0] += us
        by_class[label][1] += 1
    longest = sorted(gaps, reverse=True)[:top]
    return {
        "wall_ms": wall / 1000.0 / steps,
        "busy_ms": busy / 1000.0 / steps,
        "idle_ms": (wall - busy) / 1000.0 / steps,
        "idle_by_gap": {
            k: [round(us / 1000.0 / steps, 3), round(n / steps, 1)]
            for k, (us, n) in by_class.items()
        },
        "top_gaps": [[round(us, 1), a[:80], b[:80]] for us, a, b in longest],
    }


def _device_spans(prof) -> list[tuple[float, float, str]]:
    from torch.autograd import DeviceType

    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]


def profile_steps(step: Callable, batches: list[torch.Tensor], steps: int = 3) -> dict:
    """GPU kernel ms per step by class, launches per step, the top kernels and host ops, and
    every kernel (for offline reading: which passes a recipe adds over bf16 or torchao), and
    the GPU's idle time between kernels (`timeline`, see `idle_gaps`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
    ms, launches = kernel_times(prof, steps)
    by_class = dict.fromkeys(("gemm", "attention", "other"), 0.0)
    for name, t in ms.items():
        by_class[classify(name)] += t
    ranked = sorted(ms, key=ms.get, reverse=True)
    host = host_ops(prof, steps)
    return {
        "kernel_ms": sum(ms.values()),
        "gemm_ms": by_class["gemm"],
        "attention_ms": by_class["attention"],
        "other_ms": by_class["other"],
        "kernels_per_step": round(sum(launches.values())),
        "top_kernels": [(n[:100], round(ms[n], 3), round(launches[n])) for n in ranked[:12]],
        "host_self_ms": sum(t for _, t, _ in host),
        "top_host_ops": [(op, round(t, 3), n) for op, t, n in host[:15]],
        "kernels": [(n[:200], round(ms[n], 4), round(launches[n])) for n in ranked],
        "timeline": idle_gaps(_device_spans(prof), steps),
    }


def find_syncs(step: Callable, tokens: torch.Tensor) -> list[str]:
    """Host-device synchronizations in one step (CUDA's sync debug mode, as warnings), each as
    the file:line that caused it: each one drains the launch queue and leaves the GPU idle while
    the host catches up."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # Only torch's per-sync warning: setting the mode also warns once per process that it is a
    # prototype ("... synchronizing operations"), which session 22 counted as a sync.
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    return [f"{w.filename}:{w.lineno}" for w in syncs]
