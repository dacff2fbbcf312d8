"""benchmarks/occ_sparse_probe.py on the CPU: OCC's remainder has the ~2 % density the probe
relies on, and the sparse product is the remainder's product (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("occ_sparse_probe")


def test_remainder_density_and_products(bench):
    r = bench.measure(256, 128, 96, "cpu")
    assert 0.01 <= r["density"] <= 0.03  # alpha = 0.99 clips ~2 % of the entries
    assert r["nnz"] == round(r["density"] * 256 * 128)
    assert r["rel_error"]["sparse"] < 1e-6  # float32 SpMM of the exact remainder
    assert 1e-3 < r["rel_error"]["dense"] < 0.1  # E4M3 per row: quantized, not wrong
    assert r["dense_ms"] is None and r["sparse_ms"] is None


def test_without_a_gpu_only_the_smoke_run_is_allowed(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])
