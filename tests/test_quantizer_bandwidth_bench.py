"""benchmarks/quantizer_bandwidth.py's per-pass table on the CPU: each quantizer case is rated by
its slowest rated pass, against the copy bandwidth and against a copy of the pass's own bytes."""

from __future__ import annotations

from scripts import load_benchmark


def _pass(case, frac, same, rated=True, shape="32768x768"):
    return dict(shape=shape, case=case, kernel="triton_k", us=20.0, gb=0.05, frac_of_copy=frac,
                frac_of_same_copy=same, rated=rated)  # fmt: skip


def test_slowest_rated_pass_decides_each_case():
    bench = load_benchmark("quantizer_bandwidth")
    passes = [
        _pass("row e4m3", 0.71, 0.92), _pass("row e4m3", 0.95, 1.01),
        _pass("tensor e4m3", 0.85, 0.97), _pass("tensor e4m3", 0.01, 0.02, rated=False),
        _pass("col e4m3, T", 0.60, 0.75),
        _pass("transpose_copy e4m3", 0.90, 0.99),  # not a quantizer: listed, not counted
    ]  # fmt: skip
    lines = bench._pass_lines(passes)
    assert "| 32768x768 | row e4m3 | 2 (2) | 71% | 92% |" in lines
    assert "| 32768x768 | tensor e4m3 | 2 (1) | 85% | 97% |" in lines  # the launch-bound pass
    summary = next(line for line in lines if line.startswith("A quantizer's slowest"))
    assert "1 of 3 against the copy bandwidth, 2 of 3 against a copy" in summary
    assert sum(line.startswith("| 32768x768 |") for line in lines) == 4 + len(passes)


def test_records_without_same_size_copies_still_render():
    """Results files before session 63 have no same-size copy: NaN, not a crash."""
    rec = _pass("row e4m3", 0.9, 0.0)
    del rec["frac_of_same_copy"]
    lines = load_benchmark("quantizer_bandwidth")._pass_lines([rec])
    assert "| 32768x768 | row e4m3 | 1 (1) | 90% | nan% |" in lines
