"""benchmarks/fold_contraction_probe.py on the CPU, where it turns on inductor's FMA contraction:
the plain product then sum contracts in every crafted entry, the library's form in none."""

from __future__ import annotations

import json

import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("fold_contraction_probe")


def test_cpu_run_shows_the_contraction_and_its_absence(bench, tmp_path):
    bench.main(["--device", "cpu", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("fold_contraction_probe_*.json")
    records = {r["form"]: r for r in json.loads(path.read_text())}
    clipped = records["plain"]["clipped"]
    assert clipped > 0 and all(r["one_rounding_differs"] == clipped for r in records.values())
    assert records["plain"]["differ_from_two_roundings"] == clipped
    assert records["plain"]["equal_to_one_rounding_where_it_differs"] == clipped
    assert records["behind_select"]["differ_from_two_roundings"] == 0


def test_without_a_gpu_only_the_cpu_check_runs(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])
