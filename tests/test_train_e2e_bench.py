"""benchmarks/train_e2e.py's optimizer choice: torch's fused AdamW for fp32 states, minifloat's
AdamW for the presets that keep fp32 weights, one-line errors before any GPU time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifloat.optim import AdamW
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("train_e2e")


def test_optimizer_per_state_preset(bench):
    net = nn.Linear(64, 64)
    assert type(bench.make_optimizer(net, "fp8-fp16")) is AdamW
    opt = bench.make_optimizer(net, "fp8-fp16")
    assert (opt.exp_avg_dtype, opt.exp_avg_sq_dtype) == ("fp8", "fp16")
    if torch.cuda.is_available():  # torch's fused AdamW needs a CUDA (or MPS) build to step
        assert type(bench.make_optimizer(net.cuda(), "fp32")) is torch.optim.AdamW


@pytest.mark.parametrize(("name", "message"), [("fp9", "choose one of"), ("lean", "bf16 weights")])
def test_bad_state_presets_fail_before_gpu_time(bench, name, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(["--model", "tiny", "--device", "cpu", "--optim-states", name])


def test_rows_with_two_state_presets_compare_within_the_run(bench):
    """With `--optim-states fp32,fp8-fp16` each row runs with both; ratios to bf16 use the
    first preset's rows, and each row is also compared with its recipe's first-preset row."""
    import argparse

    records = [
        {"recipe": r, "optim_states": s, "tokens_per_s": t, "peak_mem_gib": m, "resident_gib": 1.0,
         "step_ms": 1.0, "host_ms": 1.0, "compile_s": 1.0, "graphs": 1, "graph_breaks": 0}
        for r, s, t, m in [("bf16", "fp32", 100.0, 50.0), ("bf16", "fp8-fp16", 98.0, 44.0),
                           ("fp8-tensorwise", "fp32", 120.0, 40.0),
                           ("fp8-tensorwise", "fp8-fp16", 117.0, 34.0)]
    ]  # fmt: skip
    out = bench.with_ratios(records)
    assert [r["speedup_vs_bf16"] for r in out] == [1.0, 0.98, 1.2, 1.17]
    assert [r["speedup_vs_first_states"] for r in out] == [1.0, 0.98, 1.0, 0.975]
    assert out[1]["mem_vs_bf16"] == 44.0 / 50.0
    args = argparse.Namespace(model="tiny", impl="ours", batch=2, seq=64, vocab=512, loss="eager",
                              compile_scope="model", compile_mode=None, compile_options=None,
                              layers=None, steps=2, warmup=1,
                              optim_states=["fp32", "fp8-fp16"])  # fmt: skip
    table = bench.markdown(out, args)
    assert "| fp8-tensorwise | fp8-fp16 | 117 | 1.17x | — | 0.97x |" in table
    assert "optimizer states per row" in table


def test_streamed_step_times_compare_with_bf16s(bench):
    """The streamed column (steps back to back, no synchronization between them) shows each
    row's ratio to bf16's streamed step; rows without one (CPU runs) show a dash."""
    import argparse

    records = [
        {"recipe": r, "tokens_per_s": 1.0, "peak_mem_gib": 1.0, "step_ms": 1.0, "host_ms": 1.0,
         "compile_s": 1.0, "graphs": 1, "graph_breaks": 0, "stream_step_ms": ms}
        for r, ms in [("bf16", 250.0), ("fp8-tensorwise", 200.0), ("fp4", None)]
    ]  # fmt: skip
    args = argparse.Namespace(model="tiny", impl="ours", batch=2, seq=64, vocab=512, loss="eager",
                              compile_scope="model", compile_mode=None, compile_options=None,
                              layers=None, steps=2, warmup=1, optim_states=["fp32"])  # fmt: skip
    records = bench.with_ratios(records)
    assert [r["stream_speedup_vs_bf16"] for r in records] == [1.0, 1.25, None]
    table = bench.markdown(records, args)
    assert "| 1.0 | 1.0 | 250.0 | 1 |" in table
    assert "| 1.0 | 1.0 | 200.0 (1.25x) | 1 |" in table
    assert "| 1.0 | 1.0 | — | 1 |" in table


def test_compile_options_parse_and_clash_with_a_mode(bench):
    assert bench.parse_compile_options("") is None
    parsed = bench.parse_compile_options("triton.prefer_nd_tiling=True,triton.max_tiles=3,x=y")
    assert parsed == {"triton.prefer_nd_tiling": True, "triton.max_tiles": 3, "x": "y"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench.parse_compile_options("triton.prefer_nd_tiling")
    with pytest.raises(SystemExit, match="cannot be combined"):
        bench.main(["--model", "tiny", "--device", "cpu", "--compile-mode", "reduce-overhead",
                    "--compile-options", "triton.prefer_nd_tiling=True"])  # fmt: skip


def test_profile_table_shows_gpu_idle_time_and_longest_gaps(bench):
    """A profiled row's GPU wall and idle time (step_profile.idle_gaps) sit beside its kernel
    time; a row profiled before timelines were recorded shows dashes."""
    import argparse

    prof = {"kernel_ms": 229.0, "gemm_ms": 99.0, "attention_ms": 25.0, "other_ms": 105.0,
            "kernels_per_step": 4000, "syncs_per_step": 0, "top_kernels": [],
            "host_self_ms": 170.0, "top_host_ops": []}  # fmt: skip
    timeline = {"wall_ms": 240.0, "busy_ms": 229.0, "idle_ms": 11.0,
                "idle_by_gap": {"gaps <= 5 us": [4.0, 3900], "5-50 us": [2.0, 90],
                                "> 50 us": [5.0, 10]},
                "top_gaps": [[900.0, "triton_red_fused_amax_1", "nvjet_sm90_qqtst"]]}  # fmt: skip
    records = [
        {"recipe": r, "tokens_per_s": 1.0, "peak_mem_gib": 1.0, "step_ms": 1.0, "host_ms": 1.0,
         "compile_s": 1.0, "graphs": 1, "graph_breaks": 0, **prof, **extra}
        for r, extra in [("bf16", {}), ("fp8-rowwise", {"timeline": timeline})]
    ]  # fmt: skip
    args = argparse.Namespace(model="tiny", impl="ours", batch=2, seq=64, vocab=512, loss="eager",
                              compile_scope="model", compile_mode=None, compile_options=None,
                              layers=None, steps=2, warmup=1, optim_states=["fp32"])  # fmt: skip
    table = bench.markdown(bench.with_ratios(records), args)
    assert "| 4000 | 0 | 240.0 | 11.0 (4.0 / 2.0 / 5.0) |" in table
    assert "| 4000 | 0 | — | — |" in table
    assert "| 900 | `triton_red_fused_amax_1` | `nvjet_sm90_qqtst` |" in table


def test_rows_run_on_cpu_with_gpu_samples_empty(bench, tmp_path):
    """A whole run on the CPU (tiny preset, two layers, compiled per block): the row's record and
    table line, with the GPU sample fields empty where NVML cannot be read."""
    import json

    bench.main(["--model", "tiny", "--device", "cpu", "--layers", "2",
                "--rows", "bf16", "--steps", "2", "--warmup", "1",
                "--out-dir", str(tmp_path), "--date", "2026-01-01"])  # fmt: skip
    records = json.loads(next(tmp_path.glob("train_e2e_*.json")).read_text())
    assert [r["recipe"] for r in records] == ["bf16"]
    assert records[0]["gpu_samples"] == {} and records[0]["sm_clock_mhz"] is None
    assert records[0]["loss"] == "compiled"  # the default since session 54
    md = next(tmp_path.glob("train_e2e_*.md")).read_text()
    assert "cross entropy compiled" in md
    bf16_row = next(line for line in md.splitlines() if line.startswith("| bf16 |"))
    assert "SM clock MHz / power W |" in md and bf16_row.endswith(" / 0 | — |")


@pytest.mark.parametrize("impl", ["ours", "hf"])
def test_chunked_loss_step_gives_the_unchunked_gradients(bench, impl):
    """`--loss chunked`: the step defers the model's head and applies it with the cross entropy
    a chunk at a time (minifloat.train.head_loss); its gradients are the eager loss's within
    the bf16 rounding of the head's gradient (test_head_loss.py states the bounds)."""
    if impl == "hf":
        pytest.importorskip("transformers")
    grads = {}
    for loss in ("eager", "chunked"):
        net = bench.prepare(bench.build_model("tiny", impl, 512, 64, "cpu", None), "bf16")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        seen = grads.setdefault(loss, {})
        step = bench.make_step(net, opt, lambda net=net, seen=seen: seen.update(
            {n: p.grad.clone() for n, p in net.named_parameters()}), loss=loss,
            chunks="eager")  # fmt: skip
        step(torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(0)))
    head = "output" if impl == "ours" else "lm_head"
    assert any(name.startswith(head) for name in grads["chunked"])  # the head's weight trains
    assert grads["chunked"].keys() == grads["eager"].keys()
    for name, want in grads["eager"].items():
        err = (grads["chunked"][name] - want).norm() / want.norm()
        assert err < 1e-2, name
