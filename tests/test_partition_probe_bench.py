"""benchmarks/partition_probe.py: the saved-bytes and partitioner-ban probe of one compiled block
with the Hopper GEMM path forced on the CPU."""

from __future__ import annotations

import pytest

from minifloat.kernels import scaled_mm as smm
from minifloat.kernels import select
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("partition_probe")


def test_probe_reports_what_a_small_block_saves(bench):
    """fp8-tensorwise saves no quantized operand (tests/test_transpose.py's check), bf16 saves
    more, and the forced path is undone afterwards."""
    before = select._fp8_gemm_available, smm.supported
    with bench.hopper_path_on_cpu():
        fp8 = bench.probe("fp8-tensorwise", "small", 64)
        bf16 = bench.probe("bf16", "small", 64)
    assert (select._fp8_gemm_available, smm.supported) == before
    assert fp8["quantized_saved"] == [] and 0 < fp8["saved_bytes"] < bf16["saved_bytes"]
    assert sum(fp8["saved_by_dtype"].values()) == fp8["saved_bytes"]
    table = bench.markdown([fp8, bf16], "probe")
    assert "| fp8-tensorwise | small | 64 |" in table and table.count("\n| ") == 3
