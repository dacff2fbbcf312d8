"""benchmarks/weight_rows_variants.py: its candidate cast kernels write what the op writes, in
Triton's interpreter (TRITON_INTERPRET=1, where Triton is installed; a GPU run is the probe's
own bit check). The interpreter rounds FP8 casts its own way, so the weights hold E4M3 grid
values with ±448 in every row and column: every multiplier is 1 and every value exact, and
the layouts, scales and multipliers are what is checked."""

from __future__ import annotations

import os

import pytest
import torch

from minifloat.kernels.weight_rows import _reference
from scripts import load_benchmark

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("weight_rows_variants")


def _grid_weight(rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows + cols)
    w = (torch.randn(rows, cols, generator=gen) * 50).to(torch.float8_e4m3fn).float()
    for i in range(max(rows, cols)):
        w[i % rows, i % cols] = 448.0 if i % 2 else -448.0
    return w


def test_unknown_variant_is_refused(bench):
    with pytest.raises(ValueError, match="variant must be one of"):
        bench.weight_rows_variant(torch.ones(128, 128), 448.0, True, variant="tl.trans")


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ["addr", "trans32"])
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 128)])
def test_variants_write_what_the_op_writes(bench, variant, shape):
    w = _grid_weight(*shape)
    got = bench.weight_rows_variant(w, 448.0, True, variant=variant)
    want = _reference(w, True)
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype and g.is_contiguous()
        assert torch.equal(g.float(), r.float())
