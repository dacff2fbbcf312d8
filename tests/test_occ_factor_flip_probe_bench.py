"""benchmarks/occ_factor_flip_probe.py on the CPU: a last-bit change of x moves OCC's y no more
than fp4-dge's, and flips no row's joint factor (before session 82's fix of `_joint_factor`'s
ties it moved 24 of 256 rows by up to 0.5 %, each a flipped one)."""

from __future__ import annotations

from pathlib import Path

from scripts import load_benchmark


def test_a_last_bit_change_of_x_flips_no_joint_factor(tmp_path: Path) -> None:
    probe = load_benchmark("occ_factor_flip_probe")
    recs = {r["recipe"]: r for r in probe.main(
        ["--recipes", "fp4-dge,fp4-occ", "--eps", "1e-7", "--out-dir", str(tmp_path)]
    )}  # fmt: skip
    dge, occ = recs["fp4-dge"], recs["fp4-occ"]
    assert dge["y"] < 1e-6 and dge["rows_moved"] == 0 and "factor_flips" not in dge
    assert occ["factor_flips"] == 0 and occ["rows_moved"] == 0
    assert occ["y"] < 1e-6  # rounding-sized, as fp4-dge's; 8.4e-4 with flipping factors
    assert list(tmp_path.glob("occ_factor_flip_probe_cpu_*.md"))
