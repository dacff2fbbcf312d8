"""benchmarks/column_maxima_probe.py on the CPU: every form compiles and equals its eager run,
the kernels' sources are captured, and the table shows each form's row and sources (times and
the Triton kernels' kept configs need a GPU: column_maxima_probe_*_<gpu>_<date>.md)."""

from __future__ import annotations

import pytest
import torch

from interpreter import interpreted
from scripts import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("column_maxima_probe")


def test_forms_compile_equal_eager_and_keep_their_sources(probe):
    records = probe.shape_records(512, 256, "cpu", None, {})
    # (and in Triton's interpreter the Triton tilings after them: the test below)
    records = [r for r in records if not r["form"].startswith("triton")]
    assert [r["form"] for r in records] == list(probe.forms())
    assert all(r["exact"] for r in records)
    assert all(r["sources"] and r["kernels"] == len(r["sources"]) for r in records)
    assert all(r["configs"] == {} for r in records)  # no Triton autotuner on the CPU
    text = probe.table(records, None)
    assert "| 512x256 | float32 x * s | — | — | — |" in text
    assert "### 512x256, bf16 x" in text and "```python" in text


def test_the_cpu_smoke_run(probe, capsys):
    probe.main(["--device", "cpu"])
    assert "every form's compiled maxima equal eager's" in capsys.readouterr().out


def test_without_a_gpu_it_exits_with_a_message(probe, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main([])


@pytest.mark.parametrize("configs, suffix", [(["a", "b", "c"], " (of 3)"), (None, "")])
def test_kept_configs_with_and_without_the_autotuners_list(probe, configs, suffix):
    # torch 2.11 drops an autotuner's `configs` once it has chosen (session 93's GPU run)
    import types

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    tuner = object.__new__(CachingAutotuner)
    tuner.launchers = [types.SimpleNamespace(config="XBLOCK: 64, num_warps: 4")]
    tuner.configs = configs
    module = types.SimpleNamespace(triton_red_fused_amax_0=tuner, other=1)
    assert probe.kept_configs([module]) == {
        "triton_red_fused_amax_0": "XBLOCK: 64, num_warps: 4" + suffix
    }


@interpreted
def test_triton_fold_tilings_equal_the_fold_in_the_interpreter(probe, monkeypatch):
    tiles = ((256, 32, 128, 4, 0), (128, 64, 64, 4, 1), (512, 16, 256, 2, 0), (256, 48, 128, 4, 0))
    monkeypatch.setattr(probe, "TILES", tiles)
    records = probe.shape_records(512, 256, "cpu", None, {})
    tiled = [r for r in records if r["form"].startswith("triton")]
    # the last tiling's rows do not divide its band: skipped, not run
    assert [r["form"] for r in tiled] == [
        "triton band=256 rows=32 cols=128 warps=4",
        "triton band=128 rows=64 cols=64 warps=4 atomic",
        "triton band=512 rows=16 cols=256 warps=2",
    ]
    assert all(r["exact"] for r in tiled)
    assert "### 512x256, triton" not in probe.table(records, None)


@interpreted
def test_triton_fold_notices_wrong_maxima(probe):
    x = torch.randn(256, 128).bfloat16()
    s = torch.rand(256, 1) + 0.5
    fold = probe.operand._column_amax(x.float() * s)
    for atomic in (0, 1):
        run = probe.triton_fold(x, s, (128, 32, 128, 4, atomic))
        assert torch.equal(run(), fold)
    x[17, 5] = 1000.0  # a new maximum in one column: the stale want no longer matches
    assert not torch.equal(run(), fold)


def test_known_options_drop_what_this_torch_lacks(probe):
    # the nd-tiling form's options exist in torch 2.13; an unknown key would fail the compile
    assert probe.known_options(probe.ND_TILING) == probe.ND_TILING
    assert probe.known_options({"triton.no_such_option": 1}) == {}
