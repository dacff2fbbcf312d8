"""The nvfp4 and mxfp4 recipes as specified (issue 16, RECIPES.md) and their `BASE:KEY=VALUE`
variants (minifloat/microblock_variants.py)."""

from __future__ import annotations

import dataclasses

import pytest

from minifloat import recipes
from minifloat.recipes import OperandSpec, QuantRecipe


def _e2m1(granularity, scale_format, rounding="nearest", hadamard=0) -> OperandSpec:
    return OperandSpec(
        fmt="e2m1",
        granularity=granularity,
        scale_format=scale_format,
        rounding=rounding,
        hadamard=hadamard,
    )


def test_nvfp4_is_the_nvidia_recipe():
    r = recipes.get("nvfp4")
    assert isinstance(r, QuantRecipe) and r.randomized
    act = _e2m1((1, 16), "e4m3")
    assert r.fprop.lhs == act and r.fprop.rhs == _e2m1((16, 16), "e4m3")  # 2-D weight blocks
    assert r.dgrad.lhs == _e2m1((1, 16), "e4m3", "stochastic")
    assert r.dgrad.rhs == OperandSpec(fmt="e2m1", reuse=True)  # wᵀ: the same 16x16 blocks
    assert r.wgrad.lhs == _e2m1((1, 16), "e4m3", "stochastic", hadamard=16)
    assert r.wgrad.rhs == _e2m1((1, 16), "e4m3", hadamard=16)  # RNE, rotated like dy
    assert r.keep_last_blocks == 2 and r.min_multiple == 16 and r.dge is r.occ is None


def test_mxfp4_is_ocp_mx_with_stochastic_gradients():
    r = recipes.get("mxfp4")
    block = _e2m1((1, 32), "e8m0")
    assert r.fprop.lhs == r.fprop.rhs == block
    assert r.dgrad.lhs == r.wgrad.lhs == _e2m1((1, 32), "e8m0", "stochastic")
    assert r.dgrad.rhs == r.wgrad.rhs == block  # 1x32 along N / M: quantized again
    assert r.keep_last_blocks == 0 and r.min_multiple == 32
    assert "RHT" not in str(r.describe())


def test_variants():
    assert recipes.get("nvfp4:rht=off").wgrad.lhs.hadamard == 0
    assert recipes.get("nvfp4:rht=off").wgrad.rhs.hadamard == 0
    sr_off = recipes.get("nvfp4:sr=off")
    assert sr_off.dgrad.lhs.rounding == sr_off.wgrad.lhs.rounding == "nearest"
    assert sr_off.randomized  # the Hadamard signs still draw
    assert not recipes.get("nvfp4:rht=off:sr=off").randomized
    on = recipes.get("mxfp4:rht=on")
    assert on.wgrad.lhs.hadamard == on.wgrad.rhs.hadamard == 32  # the block size
    assert recipes.get("mxfp4:rht.size=16").wgrad.rhs.hadamard == 16
    b32 = recipes.get("nvfp4:block=32")
    assert b32.fprop.lhs.granularity == (1, 32) and b32.fprop.rhs.granularity == (32, 32)
    assert b32.wgrad.lhs.granularity == (1, 32) and b32.min_multiple == 32
    b16 = recipes.get("mxfp4:block=16")
    assert b16.fprop.rhs.granularity == (1, 16) and b16.min_multiple == 16
    assert recipes.get("nvfp4:keep_last=0").keep_last_blocks == 0
    assert recipes.get("fp4:keep_last=3").keep_last_blocks == 3
    words = recipes.get("nvfp4").describe()["wgrad"]
    assert words == "E2M1 (1x16, e4m3 scale, stochastic, RHT 16) x E2M1 (1x16, e4m3 scale, RHT 16)"


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("nvfp4:rht=on:block=32", 32),  # rht=on takes the final block's size, wherever it stands
        ("nvfp4:block=32:rht=on", 32),
        ("nvfp4:rht.size=64:rht=on", 64),  # an explicit size wins over rht=on's
        ("nvfp4:rht=on:rht.size=64", 64),
        ("nvfp4:block=32", 16),  # block alone keeps the recipe's transform
    ],
)
def test_variant_keys_apply_in_one_order(name, size):
    r = recipes.get(name)
    assert r.wgrad.lhs.hadamard == r.wgrad.rhs.hadamard == size


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("fp4:sr=on", "micro-block recipes (nvfp4, mxfp4) only"),
        ("fp8-rowwise:rht=on", "micro-block recipes (nvfp4, mxfp4) only"),
        ("nvfp4:block=24", "block must be a power of two >= 2 and at most 65536"),
        ("nvfp4:block=1099511627776", "block must be a power of two >= 2 and at most 65536"),
        ("nvfp4:rht.size=1", "rht.size must be a power of two >= 2"),
        ("nvfp4:keep_last=1.5", "keep_last must be a non-negative integer"),
        ("nvfp4:rht=off:rht.size=16", "rht=off contradicts rht.size"),
        ("nvfp4:sr=maybe", "on|true|yes|1|off|false|no|0"),
    ],
)
def test_invalid_variants(name, fragment):
    with pytest.raises(ValueError) as err:
        recipes.get(name)
    assert fragment in str(err.value)


def test_hadamard_only_on_both_wgrad_operands():
    r, rep = recipes.get("nvfp4"), dataclasses.replace
    with pytest.raises(ValueError, match="wgrad operands only"):
        rep(r, fprop=rep(r.fprop, lhs=_e2m1((1, 16), "e4m3", hadamard=16)))
    with pytest.raises(ValueError, match="same Hadamard"):
        rep(r, wgrad=rep(r.wgrad, rhs=_e2m1((1, 16), "e4m3")))
    with pytest.raises(ValueError, match="power of two"):
        _e2m1((1, 16), "e4m3", hadamard=12)
