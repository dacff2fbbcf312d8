"""benchmarks/silu_form_probe.py on the CPU: each form runs compiled in a converted MLP, the
error table holds the eager and compiled errors, and the landed form rounds once."""

from __future__ import annotations

import json
import sys

from scripts import load_benchmark


def test_cpu_run_writes_every_form_and_the_errors(tmp_path, monkeypatch):
    bench = load_benchmark("silu_form_probe")
    argv = ["silu_form_probe.py", "--device", "cpu", "--m", "32", "--dim", "32", "--ffn", "64",
            "--recipes", "fp8-tensorwise", "--forms", "aten,fn",
            "--out-dir", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    (js,) = tmp_path.glob("silu_form_probe_*.json")
    records = json.loads(js.read_text())
    rows = [r for r in records if "form" in r]
    assert [(r["recipe"], r["form"], r["ran"]) for r in rows] == [
        ("fp8-tensorwise", "aten", True), ("fp8-tensorwise", "fn", True)
    ]  # fmt: skip
    (errors,) = [r["errors"] for r in records if "errors" in r]
    # h, dg, du: eager F.silu rounds silu(g) first, so its dg errs more than the landed form's
    assert errors["fn"]["eager"][1] < errors["aten"]["eager"][1]
    assert all(0 < e < 1e-2 for form in errors.values() for m in form.values() for e in m)
