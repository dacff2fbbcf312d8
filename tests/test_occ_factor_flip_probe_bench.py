"""benchmarks/occ_factor_flip_probe.py on the CPU: a last-bit change of x moves fp4-dge's y by
about as much, and OCC's y by far more, in exactly the rows whose joint factor flipped."""

from __future__ import annotations

from pathlib import Path

from scripts import load_benchmark


def test_occ_rows_move_where_their_joint_factor_flips(tmp_path: Path) -> None:
    probe = load_benchmark("occ_factor_flip_probe")
    recs = {r["recipe"]: r for r in probe.main(
        ["--recipes", "fp4-dge,fp4-occ", "--eps", "1e-7", "--out-dir", str(tmp_path)]
    )}  # fmt: skip
    dge, occ = recs["fp4-dge"], recs["fp4-occ"]
    assert dge["y"] < 1e-6 and dge["rows_moved"] == 0 and "factor_flips" not in dge
    assert occ["y"] > 1e-4  # amplified ~10^4 times: the discrete factor, not rounding
    assert 0 < occ["rows_moved"] == occ["moved_rows_flipped"] <= occ["factor_flips"]
    assert list(tmp_path.glob("occ_factor_flip_probe_cpu_*.md"))
