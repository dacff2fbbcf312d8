"""benchmarks/qag_equality.py end to end on the CPU (one gloo rank, its own process): the
script the GPU calls runs, and the quantized all-gather equals the unsharded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_unsharded_and_quantized_all_gather_agree_compiled(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "qag_equality.py"), "--model", "tiny",
         "--device", "cpu", "--recipes", "fp8-tensorwise", "--modes", "none,qag",
         "--steps", "1", "--out", str(tmp_path)],
        check=True, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    (result,) = json.loads((tmp_path / "qag_equality.json").read_text())
    assert (result["mode"], result["reference"], result["compiled"]) == ("qag", "none", True)
    assert result["bit_exact"], result["steps"]
