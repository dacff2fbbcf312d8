"""benchmarks/swiglu_slice_probe.py: both forms of g and u (two tensors, two halves of one
buffer) give the same casts of h, and the recorder answers as inductor's own choices do."""

from __future__ import annotations

import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("swiglu_slice_probe")


def test_the_forms_hold_the_same_values(bench):
    forms = bench.inputs(64, 256, "cpu")
    (g2, u2), (gs, us) = forms["two"], forms["slices"]
    assert gs.is_contiguous() is False and gs.stride() == (512, 1)
    assert g2.equal(gs) and u2.equal(us)


def test_the_cpu_smoke_run(bench, capsys):
    bench.main(["--device", "cpu"])
    assert "both forms built, same bits" in capsys.readouterr().out


def test_the_recorder_keeps_inductors_answer(bench, monkeypatch):
    from torch._inductor.choices import InductorChoices

    monkeypatch.setattr(
        InductorChoices, "should_use_persistent_reduction", staticmethod(lambda f, c: True)
    )

    class Features:
        reduction_numel = 128

        def get_reduction_hint(self):
            return "INNER"

    log = []
    assert bench._recording_choices(log).should_use_persistent_reduction(Features(), False)
    assert log == [{"reduction_numel": "128", "hint": "INNER",
                    "non_contiguous_pointwise": None, "persistent": True}]  # fmt: skip
