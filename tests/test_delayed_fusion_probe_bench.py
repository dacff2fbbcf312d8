"""benchmarks/delayed_fusion_probe.py: its variants quantize alike, so their timings compare the
same work. The delayed ones cast with the history's scale (as `quantize_operand` with that
scale) and record the exact amax whichever way they reduce it."""

from __future__ import annotations

import pytest
import torch

from minifloat import delayed
from minifloat.kernels.operand import quantize_operand
from minifloat.recipes import DelayedScaling
from scripts import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("delayed_fusion_probe")


@pytest.mark.parametrize("kind", ["rmsnorm", "swiglu", "grad"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_variants_cast_with_the_history_scale(probe, kind, fmt):
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(512, 768, generator=gen).bfloat16() for _ in range(2))
    w = (torch.rand(768, generator=gen) + 0.5).bfloat16()
    history = torch.rand(3, 16, generator=gen) + 1.0
    y = probe._produce(kind, a, b, w)
    s = delayed.history_scale(history, delayed.INPUT, delayed.amax(y), fmt, DelayedScaling())
    want = quantize_operand(y, fmt, "tensor", scale=s)[0]
    for variant in ("delayed", "delayed_rows"):
        values, amax = probe.step(kind, variant, fmt, a, b, w, history)
        assert torch.equal(values.view(torch.uint8), want.view(torch.uint8)), variant
        assert torch.equal(amax.reshape(()), y.abs().amax().float()), variant
    values, _ = probe.step(kind, "delayed_now", fmt, a, b, w, history)
    assert torch.equal(values.view(torch.uint8), want.view(torch.uint8))
    assert probe.step(kind, "current", fmt, a, b, w, history)[0].dtype == want.dtype
