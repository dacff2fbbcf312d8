"""benchmarks/common.kernel_times and benchmarks/step_profile.py: how profiler events become
per-step kernel times, launch counts and classes (the numbers the training benchmarks report)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from scripts import load_benchmark


def _event(name: str, us: float, device=DeviceType.CUDA, annotation: bool = False):
    return SimpleNamespace(
        name=name, device_time_total=us, device_type=device, is_user_annotation=annotation
    )


class _Profile:
    """What a finished torch.profiler.profile hands kernel_times: its events."""

    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_kernel_times_per_call_without_annotations_or_host_events():
    common = load_benchmark("common")
    gemm = [_event("nvjet_sm90_qqtst", 100.0)] * 504  # 168 launches a step over 3 steps
    events = [
        *gemm,
        _event("triton_poi_fused_cast", 30.0),
        # the optimizer's record_function range, drawn over kernels counted themselves
        _event("Optimizer.step#AdamW.step", 9000.0, annotation=True),
        _event("aten::mm", 500.0, device=DeviceType.CPU),
    ]
    ms, launches = common.kernel_times(_Profile(events), 3)
    assert set(ms) == {"nvjet_sm90_qqtst", "triton_poi_fused_cast"}
    assert launches["nvjet_sm90_qqtst"] == 168  # counted exactly, not summed in thirds
    assert ms["nvjet_sm90_qqtst"] == 504 * 100.0 / 1000.0 / 3
    assert launches["triton_poi_fused_cast"] == 1 / 3


def test_kernels_are_classed_by_name():
    classify = load_benchmark("step_profile").classify
    assert classify("nvjet_sm90_qrtst_128x160_128x5_1x2_h_bz_coopA_algo2_TNT") == "gemm"
    assert classify("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert classify("triton_per_fused_abs_amax_mul_silu_silu_backward_view_9") == "other"


def test_dumped_kernel_source_is_this_process_own_file(tmp_path, monkeypatch):
    """A shared inductor cache holds one kernel name several times (every graph numbers its
    kernels from 0; older processes leave theirs): the dump takes the file written since the
    benchmark started, and the kernel's own file over the graph module embedding it."""
    common = load_benchmark("common")
    cache = tmp_path / "cache"
    (cache / "a").mkdir(parents=True)
    (cache / "b").mkdir()
    stale = cache / "a" / "stale.py"
    stale.write_text("def triton_per_fused_amax_9(x):\n  0\n")  # another run's; the smallest
    hour_ago = common._STARTED - 3600
    os.utime(stale, (hour_ago, hour_ago))
    module = cache / "b" / "module.py"
    module.write_text("x = 1\n" * 50 + "def triton_per_fused_amax_9(x):\n    pass\n")
    own = cache / "b" / "own.py"
    own.write_text("def triton_per_fused_amax_9(x):\n    pass\n")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    names = ["nvjet_sm90_qqtst", "triton_per_fused_amax_9", "triton_poi_missing"]
    copied = common.dump_kernel_sources(names, tmp_path / "dump", "fp8-rowwise", 10)
    assert [p.read_text() for p in copied] == [own.read_text()]
    assert copied[0].name == "fp8-rowwise_0_triton_per_fused_amax_9.py"


def test_idle_gaps_count_overlaps_once_and_class_gaps_by_length():
    idle_gaps = load_benchmark("step_profile").idle_gaps
    spans = [
        (0.0, 100.0, "gemm"),
        (50.0, 120.0, "other_stream"),  # overlaps: busy once
        (123.0, 200.0, "cast"),  # a 3 us launch gap
        (230.0, 300.0, "amax"),  # 30 us
        (1300.0, 1400.0, "after_wait"),  # 1000 us
    ]
    t = idle_gaps(spans, steps=2)
    assert t["wall_ms"] == 1400.0 / 1000.0 / 2
    assert t["busy_ms"] == (120.0 + 77.0 + 70.0 + 100.0) / 1000.0 / 2
    assert abs(t["idle_ms"] - (3.0 + 30.0 + 1000.0) / 1000.0 / 2) < 1e-12
    assert t["idle_by_gap"] == {"gaps <= 5 us": [0.002, 0.5], "5-50 us": [0.015, 0.5],
                                "> 50 us": [0.5, 0.5]}  # fmt: skip
    assert t["top_gaps"][0] == [1000.0, "amax", "after_wait"]
    assert t["top_gaps"][-1] == [3.0, "other_stream", "cast"]
    assert idle_gaps([], steps=1) == {}


def test_probe_options_and_tiles():
    """The GPU probes' shared options: tiles parsed to integer tuples, a one-line exit without
    a GPU (these CPU tests have none)."""
    common = load_benchmark("common")
    args = common.probe_parser("A probe.\n\nmore", "64,64,4;32,128,4", "tiles").parse_args(
        ["--tag", "t", "--tiles", "32,128,4,64,64,4"]
    )
    assert args.tag == "t" and args.date is None and args.out_dir == str(common.RESULTS_DIR)
    assert common.parse_tiles(args.tiles) == [(32, 128, 4, 64, 64, 4)]
    assert common.parse_tiles("64,64,4;32,128,4") == [(64, 64, 4), (32, 128, 4)]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="a_probe needs a CUDA GPU"):
            common.require_cuda("a_probe")


def test_probe_results_carry_the_command_and_tag(tmp_path, monkeypatch):
    """write_probe: `<base>_<tag>_<gpu>_<date>.md` with the command line above the body; a
    probe without tiles has no --tiles option."""
    common = load_benchmark("common")
    args = common.probe_parser("A probe.").parse_args(
        ["--tag", "t", "--date", "2026-01-01", "--out-dir", str(tmp_path)]
    )
    assert not hasattr(args, "tiles")
    monkeypatch.setattr(common.sys, "argv", ["benchmarks/a_probe.py", "--tag", "t"])
    md = common.write_probe("a_probe", args, [{"x": 1}], "| a |")
    assert md.name == f"a_probe_t_{common.gpu_tag()}_2026-01-01.md"
    assert "`benchmarks/a_probe.py --tag t`\n\n| a |" in md.read_text()
    assert md.with_suffix(".json").read_text().strip().startswith("[")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cold_kernel_times_leave_out_only_the_flush():
    common = load_benchmark("common")
    x = torch.ones(1 << 20, device="cuda")

    def fn() -> None:
        torch.zeros(256, device="cuda")  # a fill, as the flush of time_ms is
        x.mul_(2)

    ms, launches = common.cold_kernel_times(fn, reps=4)
    assert not any("bitwise_not" in name for name in ms)
    assert sorted(launches.values()) == [1.0, 1.0]  # the fill and the multiply, once a call
    assert all(t > 0 for t in ms.values())
