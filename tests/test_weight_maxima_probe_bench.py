"""benchmarks/weight_maxima_probe.py without a GPU: the streaming tilings' maxima equal every
row's and column's maximum magnitude in Triton's interpreter;
tiles that do not divide a weight are skipped; clear exits without a GPU or the interpreter.
Times need a GPU: weight_maxima_probe_*_<gpu>_<date>.md."""

from __future__ import annotations

import pytest
import torch

from interpreter import interpreted
from scripts import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("weight_maxima_probe")


@interpreted
@pytest.mark.parametrize("tile", [(128, 8, 128, 4), (64, 16, 64, 2), (256, 32, 128, 8)])
def test_band_maxima_are_the_rows_and_columns_maxima(probe, tile):
    w = probe.special_weight(256, 384, "cpu")
    run = probe.band_maxima(w, tile)
    got = run()
    # rows' then columns' maxima; NaN above inf; the -0 row and the subnormal column
    bits = w.view(torch.int32) & 0x7FFFFFFF
    assert torch.equal(got, torch.cat([bits.amax(dim=1), bits.amax(dim=0)]))
    assert torch.equal(got, probe.reference_maxima(w))
    w[200, 300] = 5.0  # a new maximum of a row and of a column: the old bits no longer match
    assert not torch.equal(run(), got)


@interpreted
def test_cpu_records_skip_tiles_that_do_not_divide(probe):
    tiles = [(128, 8, 128, 4), (256, 8, 128, 4), (128, 48, 128, 4)]
    records = probe.shape_records("cpu", 384, 128, "cpu", tiles, None)
    # 384 rows are no whole number of 256-row bands; 48-row loads do not divide a band
    assert [r["form"] for r in records] == [probe.tile_name(tiles[0])]
    assert all(r["exact"] for r in records)
    text = probe.table(records, None)
    assert (
        "| cpu | 384 x 128 | band 128 x 128, 8 rows a load, 4 warps | yes | — | — | — | — |" in text
    )


def test_without_a_gpu_or_the_interpreter_it_exits_with_a_message(probe, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main([])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        probe.main(["--device", "cpu"])


def test_tiles_parse(probe):
    tiles = probe.parse_tiles(probe.TILES)
    assert len(tiles) == 12 and all(len(t) == 4 for t in tiles)
    assert probe.tile_name(tiles[0]) == "band 128 x 128, 8 rows a load, 4 warps"
