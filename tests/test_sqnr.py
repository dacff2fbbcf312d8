"""The SQNR metric and the claims the quantization demo makes."""

import math

import pytest
import torch

from minifloat.sqnr import sqnr_db, sqnr_table


def test_sqnr_known_values():
    ref = torch.ones(100)
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)
    assert sqnr_db(ref, ref + 0.01) == pytest.approx(40.0)


def test_demo_orderings_hold():
    rows = {
        (r["tensor"], r["format"], r["granularity"]): r["sqnr_db"] for r in sqnr_table(256, 512)
    }
    for kind in ("weight", "activation"):
        # On heavy-tailed data, per-row FP4 scaling beats per-tensor, and FP8 beats FP4.
        assert rows[(kind, "e2m1", "row")] > rows[(kind, "e2m1", "tensor")] + 1.0
        assert rows[(kind, "e4m3", "row")] > rows[(kind, "e2m1", "row")] + 6.0
        assert rows[(kind, "e2m1", "1x32")] > rows[(kind, "e2m1", "row")]
