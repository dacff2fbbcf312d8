"""benchmarks/block_maxima_probe.py without a GPU: both its quantizers (HEAD's and the variant
with block maxima over x's own bits) give `quantize_operand`'s bits, eager and compiled (a NaN
of either sign), its table marks an inexact form, and the probe refuses to run without CUDA
(the timings and the Triton kernel need one; results: block_maxima_probe_*_<gpu>_<date>.md)."""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from bits import bits_equal, same_e4m3
from scripts import load_benchmark

probe = load_benchmark("block_maxima_probe")


def _adversarial(r: int, c: int) -> torch.Tensor:
    x = torch.randn(r, c).bfloat16()
    x[3, 5], x[7, 9], x[200, 1], x[130, 4] = float("inf"), -3e38, float("nan"), 0.0
    x[256:384, 128:256] = 0  # a block of zeros: scale from a zero maximum
    return x


@pytest.mark.parametrize("kind", ["128x1", "1x128"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("own_bits", [False, True])
def test_both_quantizers_give_heads_values_and_scales(kind, compiled, own_bits):
    block, transpose = ((128, 1), True) if kind == "128x1" else ((1, 128), False)
    x = _adversarial(384, 256)
    fn = functools.partial(probe.quantizer, block=block, own_bits=own_bits, transpose=transpose)
    got = torch.compile(fn, fullgraph=True)(x) if compiled else fn(x)
    want = probe.operand.quantize_operand(
        x, "e4m3", (1, 128), transpose=transpose, scale_format="inv"
    )[:2]
    (values, scale), (want_values, want_scale) = got, want
    # a NaN's byte may take either sign compiled on the CPU (tests/bits.py's same_e4m3)
    assert values.shape == want_values.shape and same_e4m3(values, want_values)
    assert bits_equal(scale, want_scale)


def test_block_maxima_forms_agree():
    x = _adversarial(256, 384)
    for block in ((128, 1), (1, 128)):
        own = probe.block_maxima(x, block, own_bits=True)
        head = probe.block_maxima(x, block, own_bits=False)
        assert own.shape == (256 // block[0], 384 // block[1])
        assert torch.equal(own.nan_to_num(-1.0), head.nan_to_num(-1.0))
        assert own.isnan().any() and own.isinf().any()


def test_table_marks_an_inexact_form():
    rec = dict(shape="8x8", kind="128x1", form="triton rows=8 cols=64 warps=4", us=1.0, gb=0.1,
               frac_of_copy=0.5, frac_of_same_copy=0.6, exact=False)  # fmt: skip
    text = probe.table([rec, rec | dict(exact=True, form="maxima alone, bf16 bits")], 4000.0)
    assert "| shape | blocks | form | us |" in text
    assert "| 8x8 | 128x1 | triton rows=8 cols=64 warps=4 | 1.0 | 50% | 60% | **no** |" in text
    assert "| maxima alone, bf16 bits | 1.0 | 50% | 60% | yes |" in text


def test_without_a_gpu_it_exits_with_a_message(monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["block_maxima_probe.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main()
