"""The SQNR metric, the synthetic tensors, and the claims the quantization demo makes."""

import math
import subprocess
import sys

import pytest
import torch

from minifloat.sqnr import (
    FORMATS,
    GRANULARITIES,
    format_table,
    granularity_label,
    main,
    sqnr_db,
    sqnr_table,
    student_t,
    synthetic_activation,
    synthetic_weight,
)
from tolerances import SQNR_TABLE_MARGIN_DB


@pytest.fixture(scope="module")
def table():
    rows = sqnr_table(256, 512)
    return {(r["tensor"], r["format"], r["granularity"]): r["sqnr_db"] for r in rows}


def test_sqnr_known_values():
    ref = torch.ones(100)
    assert sqnr_db(ref, ref) == math.inf
    # 1.1 and 1.01 are rounded to fp32: the noise is off by <= 2^-24 / 0.01 = 6e-6 relative, 5e-5
    # dB (deterministic; measured 8.3e-6 dB at 40, which the default rel=1e-6 held only by luck)
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0, abs=1e-4)
    assert sqnr_db(ref, ref + 0.01) == pytest.approx(40.0, abs=1e-4)
    assert sqnr_db(torch.zeros(4), torch.ones(4)) == -math.inf  # no signal, some noise
    with pytest.raises(ValueError, match=r"shapes differ: \(4, 4\) vs \(4,\)"):
        sqnr_db(torch.ones(4, 4), torch.ones(4))  # would broadcast to the wrong comparison


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("ref", "out", "want"),
    [
        ([1.0, NAN], [1.0, 2.0], NAN),  # was -inf, the "no signal" value
        ([1.0, 2.0], [1.0, NAN], NAN),
        ([0.0, 0.0], [NAN, 0.0], NAN),
        ([NAN, 0.0], [NAN, 0.0], NAN),
        ([1.0, INF], [1.0, INF], NAN),  # inf - inf
        ([1.0, INF], [1.0, 2.0], NAN),  # inf / inf
        ([1.0, 2.0], [1.0, INF], -INF),  # infinite noise (log10(0) raised before)
        ([0.0, 0.0], [0.0, 0.0], INF),  # finite input keeps the documented meanings
        ([0.0, 0.0], [1.0, 0.0], -INF),
    ],
)
def test_sqnr_of_non_finite_input(ref, out, want):
    got = sqnr_db(torch.tensor(ref), torch.tensor(out))
    assert math.isnan(got) if math.isnan(want) else got == want


def test_table_covers_every_format_and_granularity(table):
    labels = ["tensor", "row", "column", "1x16", "1x32", "1x128", "16x16", "128x128"]
    assert [granularity_label(g) for g in GRANULARITIES] == labels
    assert set(FORMATS) == {"e2m1", "e1m2", "e3m0", "e4m3", "e5m2", "int8", "int4"}
    want = {(k, f, g) for k in ("weight", "activation") for f in FORMATS for g in labels}
    assert set(table) == want
    assert all(math.isfinite(v) and v > 0 for v in table.values())


@pytest.mark.parametrize("kind", ["weight", "activation"])
def test_demo_orderings_hold(table, kind):
    # On heavy-tailed data, per-row FP4 scaling beats per-tensor, and FP8 beats FP4.
    e2m1 = {g: table[(kind, "e2m1", g)] for g in ("tensor", "row", "1x32")}
    assert e2m1["row"] > e2m1["tensor"] + SQNR_TABLE_MARGIN_DB["row_over_tensor"]
    for gran in ("tensor", "row", "1x32"):
        assert table[(kind, "e4m3", gran)] > e2m1[gran] + SQNR_TABLE_MARGIN_DB["fp8_over_fp4"]
    assert e2m1["1x32"] > e2m1["row"] + SQNR_TABLE_MARGIN_DB["block_over_row"]


def test_format_table_has_one_table_per_kind_with_formats_as_rows(table):
    rows = [
        {"tensor": k, "format": f, "granularity": g, "sqnr_db": v} for (k, f, g), v in table.items()
    ]
    text = format_table(rows)
    assert text.count("| format | tensor | row | column | 1x16 |") == 2
    body = [line for line in text.splitlines() if line.startswith("| ") and "format" not in line]
    assert [line.split(" | ")[0][2:] for line in body] == list(FORMATS) * 2
    assert f"{table[('activation', 'int4', '128x128')]:.1f} |" in text.splitlines()[-1]


def test_synthetic_tensors_leave_global_rng_alone():
    state = torch.get_rng_state()
    a = synthetic_activation(64, 128, seed=3)
    w = synthetic_weight(64, 128, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, synthetic_activation(64, 128, seed=3))
    assert torch.equal(w, synthetic_weight(64, 128, seed=3))
    assert not torch.equal(a, synthetic_activation(64, 128, seed=4))


def test_activation_is_heavy_tailed_with_outlier_channels():
    x = synthetic_activation(2048, 256, seed=0, outlier_channels=4)
    channel_rms = x.pow(2).mean(0).sqrt()
    assert int((channel_rms > 10 * channel_rms.median()).sum()) == 4
    # Student-t(3): variance dof / (dof - 2) = 3 and a much heavier tail than a Gaussian.
    plain = synthetic_activation(2048, 256, seed=0, outlier_channels=0)
    # t(3) has no fourth moment, so its sample variance converges slowly (measured 0.8% off)
    assert plain.var().item() == pytest.approx(3.0, rel=0.25)
    beyond = (plain.abs() > 5).double().mean().item()
    assert 0.005 < beyond < 0.03  # t(3): 1.5%; a Gaussian: 6e-7


def test_student_t_draws_only_from_its_generator():
    state = torch.get_rng_state()
    a = student_t((1000,), 3, torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, student_t((1000,), 3, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="dof"):
        student_t((4,), 0, torch.Generator())


def test_main_prints_both_tables(capsys):
    main(64, 256)
    out = capsys.readouterr().out
    assert "weight-like" in out and "activation-like" in out
    assert out.count("| int4 |") == 2


def test_demo_command_prints_without_runpy_warning():
    # The command `make demo` should run (`python -m minifloat.sqnr` makes runpy warn, since
    # `import minifloat` imports this module first).
    code = "from minifloat.sqnr import main; main(64, 256)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr and "found in sys.modules" not in done.stderr
    assert done.stdout.count("| e2m1 |") == 2


def test_sqnr_db_refuses_complex_input():
    """.double() dropped the imaginary part: 1+1j against 1+2j gave inf."""
    with pytest.raises(TypeError, match="sqnr_db takes real tensors"):
        sqnr_db(torch.tensor([1 + 1j]), torch.tensor([1 + 2j]))


@pytest.mark.parametrize("channels", [-1, 9])
def test_synthetic_activation_refuses_outlier_counts_outside_the_channels(channels):
    """-1 sliced [:-1]: all channels but one were scaled x20."""
    with pytest.raises(ValueError, match="outlier_channels must lie in"):
        synthetic_activation(4, 8, outlier_channels=channels)
    with pytest.raises(ValueError, match="dof must be a positive int, got 2.5"):
        student_t((2, 2), 2.5, torch.Generator())
