"""benchmarks/train_interleaved.py: rows built once and timed in rotating rounds; records with
train_e2e.py's keys and ratios; one-line errors before any GPU time."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("train_interleaved")


def test_rows_rotate_and_records_carry_ratios(bench, tmp_path, capsys):
    bench.main(["--model", "tiny", "--device", "cpu", "--compile-scope", "none",
                "--rows", "bf16,fp8-tensorwise,fp4-dge", "--rounds", "3", "--steps", "2",
                "--warmup", "1", "--out-dir", str(tmp_path), "--date", "2026-01-01"])  # fmt: skip
    out = capsys.readouterr().out
    # each round starts one row later
    for i, first in enumerate(["bf16", "fp8-tensorwise", "fp4-dge"]):
        assert f"round {i + 1}/3: {first} " in out
    records = json.loads(next(tmp_path.glob("train_interleaved_tiny_ours_*.json")).read_text())
    assert [r["recipe"] for r in records] == ["bf16", "fp8-tensorwise", "fp4-dge"]
    for r in records:
        assert r["interleaved"] and len(r["round_ms"]) == 3 and r["steps_per_round"] == 2
        assert r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"]
        assert r["gpu_samples"] == {} and r["sm_clock_mhz"] is None  # no NVML on the CPU
        assert r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_ms"] * 1000.0)
    assert records[0]["speedup_vs_bf16"] == 1.0
    assert records[1]["speedup_vs_bf16"] == records[1]["tokens_per_s"] / records[0]["tokens_per_s"]
    assert records[1]["speedup_vs_torchao_tensorwise"] is None  # no torchao row in this run
    md = next(tmp_path.glob("train_interleaved_tiny_ours_*.md")).read_text()
    assert "| fp8-tensorwise |" in md and "3 rounds of 2 steps" in md


@pytest.mark.parametrize(
    ("rows", "message"),
    [("bf16,bf16", "each row once"), ("fp8-tensorwise+fsdp", "plain recipes"),
     ("fp9", "unknown recipe"), ("bf16~fused", "the loss after ~ is one of"),
     ("bf16~", "the loss after ~ is one of"),
     ("bf16,bf16~compiled", "each row once")],  # the compiled loss is the default
)  # fmt: skip
def test_bad_rows_fail_before_any_step(bench, rows, message):
    with pytest.raises((SystemExit, ValueError), match=message):
        bench.main(["--model", "tiny", "--device", "cpu", "--rows", rows])


def test_a_row_can_name_its_own_loss(bench, tmp_path):
    """`ROW~eager` / `ROW~compiled` / `ROW~chunked`: the same recipe with another loss, in the same
    rounds (the loss's own cost, timed in alternation); each record says which it ran, and its
    ratios are against the bf16 row with the same loss."""
    rows = "bf16,fp8-tensorwise,bf16~compiled,fp8-tensorwise~compiled,bf16~chunked"
    bench.main(["--model", "tiny", "--device", "cpu", "--compile-scope", "none",
                "--rows", rows, "--rounds", "1", "--steps", "1",
                "--warmup", "1", "--out-dir", str(tmp_path), "--date", "2026-01-01"])  # fmt: skip
    records = json.loads(next(tmp_path.glob("train_interleaved_tiny_ours_*.json")).read_text())
    by_row = {r["recipe"]: r for r in records}
    assert [(r["recipe"], r["loss"]) for r in records] == [
        ("bf16", "eager"),  # --compile-scope none: nothing compiled unless a row asks
        ("fp8-tensorwise", "eager"),
        ("bf16~compiled", "compiled"),
        ("fp8-tensorwise~compiled", "compiled"),
        ("bf16~chunked", "chunked"),  # the head and its loss a chunk of tokens at a time
    ]
    for row, bf16 in [("fp8-tensorwise", "bf16"), ("fp8-tensorwise~compiled", "bf16~compiled")]:
        want = by_row[row]["tokens_per_s"] / by_row[bf16]["tokens_per_s"]
        assert by_row[row]["speedup_vs_bf16"] == want
    assert by_row["bf16~compiled"]["speedup_vs_bf16"] == 1.0
    assert by_row["bf16~chunked"]["speedup_vs_bf16"] == 1.0


def test_a_failing_row_leaves_the_others(bench, tmp_path, monkeypatch):
    """A row whose build or step fails becomes an error record; the other rows are timed and
    written (nothing lost on one row's failure, as in train_e2e.py)."""
    build = bench.build_row

    def build_or_fail(args, row, batches):
        if row == "fp4-dge":
            raise RuntimeError("CUDA out of memory (simulated)")
        built = build(args, row, batches)
        if row == "fp8-tensorwise":  # builds, then fails in the second round's steps
            calls, step = [0], built["step"]

            def failing_step(tokens):
                calls[0] += 1
                if calls[0] > 3:
                    raise RuntimeError("step failed (simulated)")
                step(tokens)

            built["step"] = failing_step
        return built

    monkeypatch.setattr(bench, "build_row", build_or_fail)
    bench.main(["--model", "tiny", "--device", "cpu", "--compile-scope", "none",
                "--rows", "bf16,fp8-tensorwise,fp4-dge", "--rounds", "3", "--steps", "2",
                "--warmup", "1", "--out-dir", str(tmp_path), "--date", "2026-01-01"])  # fmt: skip
    records = json.loads(next(tmp_path.glob("train_interleaved_tiny_ours_*.json")).read_text())
    by_row = {r["recipe"]: r for r in records}
    assert sorted(by_row) == ["bf16", "fp4-dge", "fp8-tensorwise"]
    assert len(by_row["bf16"]["round_ms"]) == 3 and "error" not in by_row["bf16"]
    assert "step failed" in by_row["fp8-tensorwise"]["error"]
    assert "out of memory" in by_row["fp4-dge"]["error"]
    md = next(tmp_path.glob("train_interleaved_tiny_ours_*.md")).read_text()
    assert "fp4-dge: error `RuntimeError: CUDA out of memory (simulated)`" in md


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--compile-options", "triton.multi_kernel"], "KEY=VALUE"),
     (["--compile-options", "triton.multi_kernel=1", "--compile-mode", "max-autotune"],
      "cannot be combined")],
)  # fmt: skip
def test_bad_compile_options_fail_before_any_step(bench, extra, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(["--model", "tiny", "--device", "cpu", "--rows", "bf16", *extra])


def test_compile_options_reach_every_row(bench, monkeypatch):
    """Every row is compiled with the parsed inductor options (as train_e2e.py's rows)."""
    seen = []

    def compile_model(net, scope, mode, options=None):
        seen.append((scope, mode, options))
        return net

    monkeypatch.setattr(bench.e2e, "compile_model", compile_model)
    args = bench.parse_args(["--model", "tiny", "--device", "cpu", "--rows", "bf16,fp4-dge",
                             "--compile-options", "triton.multi_kernel=1,benchmark_fusion=True",
                             "--warmup", "1"])  # fmt: skip
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1))]
    for row in args.rows:
        bench.build_row(args, row, batches)
    options = {"triton.multi_kernel": 1, "benchmark_fusion": True}
    assert seen == [("block", None, options)] * 2
