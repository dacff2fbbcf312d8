"""benchmarks/host_profile.py on the CPU: its phases, guard timing, profile and dumps (the GPU runs
it on the 7B-shaped layer; session 48)."""

from __future__ import annotations

import json
import sys

from scripts import load_benchmark


def test_cpu_run_reports_guards_profile_and_graph_code(tmp_path, monkeypatch):
    bench = load_benchmark("host_profile")
    out, dump = tmp_path / "out", tmp_path / "dump"
    argv = ["host_profile.py", "--device", "cpu", "--k", "64", "--n", "64", "--m", "32",
            "--recipes", "fp8-tensorwise", "--out-dir", str(out),
            "--dump-dir", str(dump),
            "--compile-options", "triton.store_cubin=True"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    (md,) = out.glob("host_profile_*.md")
    (js,) = out.glob("host_profile_*.json")
    records = {r["variant"]: r for r in json.loads(js.read_text())}
    assert set(records) == {"bf16", "fp8-tensorwise"}
    # the inductor options reach every variant (a no-op on the CPU; for the C++ wrapper on CUDA)
    assert all(r["compile_options"] == {"triton.store_cubin": True} for r in records.values())
    ours = records["fp8-tensorwise"]
    for key in ("host_fwd_ms", "host_bwd_ms", "host_step_ms", "host_stream_ms"):
        assert ours[key] > 0, key
    # the guard tree of QuantLinear's compiled forward was found, checked and timed
    assert ours["guard_us"] > 0 and ours["guard_lines"] > 10
    assert "| fp8-tensorwise |" in md.read_text()
    # the compiled graphs' wrapper code, what it called, the guards and the whole profile
    assert len(ours["graph_calls"]) == 2  # forward and backward
    callees = [c["function"] for calls in ours["graph_calls"].values() for c in calls]
    assert any("mm" in f for f in callees), callees
    assert "TENSOR_MATCH" in (dump / "fp8-tensorwise" / "guards.txt").read_text()
    assert (dump / "fp8-tensorwise" / "host.pstats").stat().st_size > 0
    assert len(list((dump / "fp8-tensorwise").glob("*.py"))) == 2
