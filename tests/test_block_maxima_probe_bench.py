"""benchmarks/block_maxima_probe.py without a GPU: its variant quantizer (block maxima over x's
own bits) gives HEAD's `quantize_operand` values and scales bit for bit, eager and compiled, its
table marks an inexact form, and the probe refuses to run without CUDA (the timings and the
Triton kernel need one; results: block_maxima_probe_*_<gpu>_<date>.md)."""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from scripts import load_benchmark

probe = load_benchmark("block_maxima_probe")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _adversarial(r: int, c: int) -> torch.Tensor:
    x = torch.randn(r, c).bfloat16()
    x[3, 5], x[7, 9], x[200, 1], x[130, 4] = float("inf"), -3e38, float("nan"), 0.0
    x[256:384, 128:256] = 0  # a block of zeros: scale from a zero maximum
    return x


@pytest.mark.parametrize("kind", ["128x1", "1x128"])
@pytest.mark.parametrize("compiled", [False, True])
def test_own_bits_quantizer_gives_heads_values_and_scales(kind, compiled):
    block, transpose = ((128, 1), True) if kind == "128x1" else ((1, 128), False)
    x = _adversarial(384, 256)
    fn = functools.partial(probe.quantizer, block=block, own_bits=True, transpose=transpose)
    got = torch.compile(fn, fullgraph=True)(x) if compiled else fn(x)
    want = probe.operand.quantize_operand(
        x, "e4m3", (1, 128), transpose=transpose, scale_format="inv"
    )[:2]
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(_bits(g), _bits(w))


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
    assert "| 8x8 | 128x1 | triton rows=8 cols=64 warps=4 | 1.0 | 50% | 60% | **no** |" in text
    assert "| maxima alone, bf16 bits | 1.0 | 50% | 60% | yes |" in text


def test_without_a_gpu_it_exits_with_a_message(monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["block_maxima_probe.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main()
