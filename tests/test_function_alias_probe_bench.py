"""benchmarks/function_alias_probe.py on the CPU: every Function's compiled gradients are
there (none all zeros) and RoPE's and SwiGLU's equal eager's (torch 2.13 on the CPU; the bug it
looks for showed under torch 2.11 on CUDA, session 80)."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("function_alias_probe")


def test_cpu_run_finds_every_gradient(bench, tmp_path):
    results = bench.main(["--device", "cpu", "--no-linear", "--out-dir", str(tmp_path)])
    written = json.loads((tmp_path / "function_alias_probe_cpu.json").read_text())
    rows = {k: v for k, v in written.items() if k not in ("torch", "device")}
    assert set(rows) == {f"{f}_{d}" for f in ("rope", "swiglu") for d in ("float32", "bfloat16")}
    assert written == json.loads(json.dumps(results))
    for name, row in rows.items():
        assert not any(row["zero_grads"]), name
        # RoPE's backward is the plain form's ops in both; SwiGLU's sigmoid may differ in its
        # last bits compiled (tests/test_swiglu.py)
        bound = 0.0 if name.startswith("rope") else 1e-5
        assert max(row["rel_err"]) <= bound, name


def test_a_failing_row_is_reported_not_raised(bench):
    def broken(x):
        raise ValueError("no")

    assert bench.compare(broken, torch.ones(2)).startswith("ValueError")
