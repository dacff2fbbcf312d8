"""benchmarks/fold_probe.py on the CPU: its `library` form is the library's (z equals
occ.fold_remainder by the quotient, the old E2M1 rounding gives the same bytes),
occ.fold_remainder by the quotient gives its bytes from before session 71, by the multiplier
at most a few other bytes (its Δx within a float32 ulp), and every exact form compiles to
eager's bits (the timing needs a GPU)."""

from __future__ import annotations

import json

import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("fold_probe")


def test_cpu_run_checks_the_library_form_and_compiled_bits(bench, tmp_path):
    bench.main(["--device", "cpu", "--shapes", "64:256", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("fold_probe_*.json")
    records = json.loads(path.read_text())
    folds = {f"fold_remainder{v}" for v in ("", " by the quotient", " before session 71")}
    assert {r["variant"] for r in records} == {name for name, _, _ in bench.VARIANTS} | folds
    assert all(r["library_z_is_fold_remainder"] and r["products_is_library"] for r in records)
    assert all(r["fold_same_bytes_as_before"] for r in records)
    # Δx·m_x against Δx / s_x: a count of bytes, few where any (neighbouring float32s)
    assert all(0 <= r["fold_by_m_differing_bytes"] <= 64 * 256 // 100 for r in records)
    assert all(r["compiled_vs_eager_bytes"] == 0 for r in records if r["exact"])
    assert all("kernel_ms" not in r for r in records)  # no timing without a GPU


def test_without_a_gpu_only_the_cpu_check_runs(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])
