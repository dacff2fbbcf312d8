"""benchmarks/occ_real_activations.py on the CPU: a tiny fp4 run stopped half-way, its layers'
inputs captured from a validation batch, y's SQNR of every OCC variant and the clipped
entries' channels measured per layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minifloat.train.cli import main as cli
from scripts import load_benchmark

SMALL = ["dim=32", "n_layers=2", "n_heads=2", "ffn_dim=64"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("occ_real_activations")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("occ_real")
    overrides = [arg for kv in SMALL for arg in ("--model-override", kv)]
    status = cli(["train", "--recipe", "fp4", "--model", "tiny", *overrides, "--steps", "6",
                  "--stop-after", "3", "--batch-size", "2", "--seq-len", "32",
                  "--vocab-size", "300", "--data-max-bytes", "60000", "--eval-batches", "0",
                  "--device", "cpu", "--cache-dir", str(root / "cache"), "--out",
                  str(root / "run"), "--quiet"])  # fmt: skip
    assert status == 0
    return root / "run"


def test_every_layer_and_variant_is_measured(bench, run_dir, tmp_path):
    md = bench.main([str(run_dir), "--tokens", "64", "--device", "cpu", "--out-dir",
                     str(tmp_path), "--date", "2026-01-01"])  # fmt: skip
    records = json.loads(md.with_suffix(".json").read_text())
    layers = {r["layer"] for r in records}
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of the two blocks
    restricted = bench.restricted_labels()
    assert len(records) == len(layers) * (len(bench.VARIANTS) + len(restricted))
    assert {r["step"] for r in records} == {3} and {r["steps"] for r in records} == {6}
    assert {r["m"] for r in records} == {64}
    by = {(r["layer"], r["variant"]): r for r in records}
    for name in layers:
        off = by[(name, "fp4:occ.compensate=off")]["y_sqnr_db"]
        # the fp32 compensation puts back what the clamp took: y only gains
        assert by[(name, bench.REFERENCE)]["y_sqnr_db"] > off
        r = by[(name, bench.DEFAULT)]
        assert 0 < r["clipped_fraction"] <= 0.05  # alpha = 0.99 clips ~2 % of the entries
        assert 0 < r["channels_clipped"] <= r["channels"]
        assert 0 < r["energy_top1pct"] <= r["energy_top5pct"] <= 1
        assert r["threshold_rel_err"] == 0  # 64 x 32 entries: the sample is every entry
        # the restricted compensation: at least 16 channels, more for larger shares
        kept = [by[(name, label)] for label in restricted]
        assert [k["channels_kept"] for k in kept] == sorted(k["channels_kept"] for k in kept)
        assert min(k["channels_kept"] for k in kept) >= 16
    assert "Target (issue 13" in md.read_text()


def test_a_bad_variant_fails_before_the_run_is_read(bench, tmp_path):
    with pytest.raises(ValueError, match="unknown variant key 'occ.bogus'"):
        bench.main([str(tmp_path / "no_run"), "--variants", "fp4:occ.bogus=1"])


def test_restricted_to_every_channel_is_the_full_compensation(bench):
    """With K = 16 every share keeps all 16 channels: y_off + Δx·wᵀ in float64 is the fp32
    compensation's y up to its float32 rounding."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen) * torch.linspace(0.2, 8.0, 16)
    w = torch.randn(24, 16, generator=gen)
    ref = x.double() @ w.double().t()
    got = bench.restricted(x, w, bench.layer_y(bench.UNCOMPENSATED, x, w), ref)
    full = bench.sqnr_db(ref, bench.layer_y(bench.REFERENCE, x, w))
    assert {c for _, c in got.values()} == {16}
    assert all(db == pytest.approx(full, abs=0.05) for db, _ in got.values())
    assert full > bench.sqnr_db(ref, bench.layer_y(bench.UNCOMPENSATED, x, w)) + 1.0
