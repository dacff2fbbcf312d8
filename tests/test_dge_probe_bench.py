"""benchmarks/dge_probe.py: its variants share the E2M1 operand, the split one computes the
shipped DGE, and the exp2 form stays within float32 rounding. (The bit-read spacing that the
probe's `dge_bits` timed is the library's own since session 40: tests/test_formats.py.)"""

from __future__ import annotations

import pytest
import torch

from minifloat import dge
from scripts import load_benchmark
from test_dge import adversarial_points


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("dge_probe")


def test_exp2_power_within_float32_rounding(probe):
    """The exp2 form against the shipped CPU `pow` (on CUDA the shipped power is this form)."""
    x = adversarial_points()
    x = x[~torch.isnan(x)]
    want = dge.dge_derivative(x, "e2m1", probe.K, probe.CAP).double()
    got = probe._derivative(x, "dge_bits_exp2").double()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)  # a few float32 ulps


def test_weight_backward_variants_share_the_operand(probe):
    gen = torch.Generator().manual_seed(1)
    w, dw = torch.randn(64, 96, generator=gen) * 0.02, torch.randn(64, 96, generator=gen)
    ref = probe.weight_backward(w, dw, "dge")
    for variant in probe.VARIANTS:
        out = probe.weight_backward(w, dw, variant)
        assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)), variant


def test_split_variant_is_the_shipped_dge(probe):
    """`dge_split` times the same result as `dge`, only in two graphs."""
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(1)) * 0.02
    dw = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    split = probe._split(probe.weight_backward, probe.dge_alone)(w, dw)
    fused = probe.weight_backward(w, dw, "dge")
    assert all(torch.equal(a, b) for a, b in zip(split, fused, strict=True))
    assert not torch.equal(fused[1], dw)  # DGE did rescale dw
