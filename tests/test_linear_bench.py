"""benchmarks/linear.py's tables and step (the GPU runs it; its bookkeeping runs anywhere)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("linear")


def _record(recipe: str, k: int, n: int, ms: float, bf16_ms: float) -> dict:
    # streamed: 0.8 of the stepped time (no wait for the first launches), bf16's as well
    return dict(recipe=recipe, K=k, N=n, M=16384, ms=ms, kernel_ms=ms * 0.9, kernels=24.0,
                host_ms=ms * 0.5, speedup_vs_bf16=bf16_ms / ms, peak_saved_bytes=2**20,
                stream_ms=ms * 0.8, stream_speedup_vs_bf16=bf16_ms / ms,
                compile_mode="reduce-overhead")  # fmt: skip


def test_markdown_reports_host_time_mode_and_target_geomean(bench):
    shapes = bench.SHAPES_7B
    records = [_record("bf16", k, n, 2.0, 2.0) for k, n in shapes]
    records += [
        _record("fp8-tensorwise", k, n, ms, 2.0)
        for (k, n), ms in zip(shapes, (1.0, 2.0, 4.0), strict=True)
    ]
    md = bench.markdown(records, compiled=True)
    assert "(mode reduce-overhead)" in md
    assert "| streamed ms (vs bf16) | kernel ms | kernels | host ms |" in md
    row = "| 4096 | 4096 | fp8-tensorwise | 1.000 | 0.800 (2.00x) | 0.900 | 24 | 0.500 | 2.00x |"
    assert row in md
    # speed-ups 2, 1, 0.5: geometric mean 1.00x, below the 1.5x target, streamed and by kernel
    # time too (kernel times 0.9 of each step: the same ratios)
    assert "| fp8-tensorwise | 1.000x | 1.5x | no | 1.000x | no | 1.000x |" in md
    # a record without a streamed or kernel time (written before those columns) leaves it blank
    old = [
        {k: v for k, v in r.items() if not k.startswith("stream") and k != "kernel_ms"}
        for r in records
    ]
    assert "| fp8-tensorwise | 1.000x | 1.5x | no | | |  |" in bench.markdown(old, compiled=True)


def test_targets_table_rounds_down_and_gives_kernel_time(bench):
    """Session 47's streamed 1.4998x printed as 1.50x beside "no"; rounded down to 3 decimals
    it shows as a miss, and the kernel-time column gives the speed-up without the host's time."""
    shapes = bench.SHAPES_7B
    records = [_record("bf16", k, n, 3.0, 3.0) for k, n in shapes]
    records += [_record("fp8-tensorwise", k, n, 3.0 / 1.4998, 3.0) for k, n in shapes]
    for r in records:
        if r["recipe"] == "fp8-tensorwise":
            r["kernel_ms"] = 3.0 * 0.9 / 1.52  # bf16's kernels 2.7 ms: 1.52x by kernel time
    line = next(x for x in bench.targets_table(records).splitlines() if "fp8-tensorwise" in x)
    assert line == "| fp8-tensorwise | 1.499x | 1.5x | no | 1.499x | no | 1.520x |"


def test_markdown_names_the_inductor_options(bench):
    records = [_record("bf16", 4096, 4096, 2.0, 2.0) | {"compile_options": {"cpp_wrapper": True}}]
    assert "inductor options {'cpp_wrapper': True}" in bench.markdown(records, compiled=True)
    assert "inductor options" not in bench.markdown([_record("bf16", 4096, 4096, 2.0, 2.0)], True)


def test_options_and_a_mode_cannot_be_combined(bench, monkeypatch):
    argv = ["linear.py", "--compile-mode", "max-autotune", "--compile-options", "cpp_wrapper=True"]
    monkeypatch.setattr(bench.sys, "argv", argv)
    with pytest.raises(SystemExit, match="cannot be combined"):
        bench.main()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_step_runs_forward_and_backward(bench, mode):
    """One step sets the input's and the weight's gradients (fresh each call), in either mode."""
    layer = nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    dy = torch.randn(4, 8)
    step = bench.step_fn(layer, x, dy, mode)
    step()
    step()
    torch.testing.assert_close(x.grad, dy @ layer.weight.detach())
    torch.testing.assert_close(layer.weight.grad, dy.t() @ x.detach())
