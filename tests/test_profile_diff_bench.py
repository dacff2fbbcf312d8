"""benchmarks/profile_diff.py on session 98's two profiled trees (HEAD and session 95's fold
maxima kernel, 1.3B fp4-dge, 6 layers, CUDA graphs): the step's split adds up, every kernel's
time is accounted for in the family table, and bad input gets a one-line error."""

from __future__ import annotations

import json

import pytest

from scripts import BENCHMARKS, load_benchmark

diff = load_benchmark("profile_diff")
RESULTS = BENCHMARKS / "results"
BASE = RESULTS / "train_e2e_1.3B_ours_s98foldcg_work_h200_2026-12-05.json"
NEW = RESULTS / "train_e2e_1.3B_ours_s98foldcg_fold_h200_2026-12-05.json"


def test_family_drops_only_inductors_number() -> None:
    assert diff.family("triton_poi_fused_add_view_22") == "triton_poi_fused_add_view"
    assert diff.family("triton_red_fused_amax_12") == "triton_red_fused_amax"
    assert diff.family("nvjet_sm90_tst_128x128_64x4_1x2") == "nvjet_sm90_tst_128x128_64x4_1x2"
    assert diff.family("_fold_maxima_kernel") == "_fold_maxima_kernel"


def test_step_split_adds_up_to_the_kernel_time() -> None:
    record = diff.load(BASE)
    s = diff.step_summary(record)
    parts = ("gemm_ms", "attention_ms", "triton_inductor_ms", "triton_ours_ms", "rest_ms")
    assert sum(s[k] for k in parts) == pytest.approx(record["kernel_ms"])
    assert s["triton_inductor_ms"] > 10 and s["rest_ms"] >= 0
    assert diff.step_summary(diff.load(NEW))["triton_ours_ms"] > s["triton_ours_ms"] + 1.0


@pytest.mark.parametrize("exact", [False, True])
def test_kernel_changes_account_for_every_kernel(exact: bool) -> None:
    base, new = diff.load(BASE), diff.load(NEW)
    rows = diff.kernel_changes(base, new, min_ms=0.0, exact=exact)
    moved = sum(b - a for _, a, _, b, _ in rows)
    total = sum(ms for _, ms, _ in new["kernels"]) - sum(ms for _, ms, _ in base["kernels"])
    assert moved == pytest.approx(total, abs=1e-9)
    launches = sum(bl - al for _, _, al, _, bl in rows)
    assert launches == sum(c for *_, c in new["kernels"]) - sum(c for *_, c in base["kernels"])
    fold = [r for r in rows if r[0] == "_fold_maxima_kernel"]
    assert fold == [("_fold_maxima_kernel", 0.0, 0, pytest.approx(1.186, abs=1e-3), 42)]
    assert [r[3] - r[1] for r in rows] == sorted(r[3] - r[1] for r in rows)


def test_report_and_main(capsys) -> None:
    assert diff.main([str(BASE), str(NEW), "--min-ms", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "| step ms (median, unprofiled) | 61.44 | 62.30 | +0.86 |" in out
    assert "| kernels/step | 1,019 | 1,061 | +42 |" in out
    assert "`_fold_maxima_kernel`" in out and "`nvjet_sm90_qrtst" not in out  # moved < 0.5 ms


def test_bad_input_is_one_line(tmp_path, capsys) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"recipe": "bf16", "step_ms": 1.0}]))
    assert diff.main([str(plain), str(NEW)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its profiled records are []" in err
    assert diff.main([str(BASE), str(NEW), "--recipe", "fp8-rowwise"]) == 2
    assert "recipe 'fp8-rowwise'" in capsys.readouterr().err
    assert diff.main([str(tmp_path / "missing.json"), str(NEW)]) == 2
    with pytest.raises(SystemExit):
        diff.main([str(BASE), str(NEW), "--min-ms", "nan"])
