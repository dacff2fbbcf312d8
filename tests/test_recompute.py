"""recompute.py: which layers run in the recompute region, what its policy recomputes, and what a
compiled LLaMA block under fp8-delayed saves for backward with it (Hopper path forced on the
CPU; bytes counted from inductor's partition, as tests/test_transpose.py does)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from minifloat import recipes, recompute
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.kernels.hopper import HopperBackend
from test_transpose import _nbytes, _saved, force_hopper_path

aten = torch.ops.aten
QUANT_RECIPES = [n for n in recipes.names() if recipes.get(n).quantized]


@pytest.mark.parametrize("backend", [EmulatedBackend(), HopperBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize("name", QUANT_RECIPES)
def test_region_applies_to_delayed_scaling_on_the_hopper_path_only(name, backend):
    """Not on the emulation: not measured there, and torch 2.13's CPU code generator
    miscompiles the region's backward (tests/test_cpu_compile_probe_bench.py)."""
    recipe = recipes.get(name)
    weight = torch.zeros(16, 16)
    want = recipe.delayed is not None and backend.name == "hopper"
    assert recompute.applies(recipe, weight, backend) == want


RECOMPUTE, SAVE = CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.PREFER_SAVE
POLICY_CASES = [
    (aten.mul.Tensor, None, RECOMPUTE),
    (aten.clamp.default, None, RECOMPUTE),
    (aten.where.self, None, RECOMPUTE),
    (aten._to_copy.default, torch.float8_e4m3fn, RECOMPUTE),
    (aten._to_copy.default, torch.float8_e5m2, RECOMPUTE),
    (aten._to_copy.default, torch.float32, SAVE),
    (aten._to_copy.default, torch.float64, SAVE),
    (aten.amax.default, None, SAVE),
    (aten.mm.default, None, SAVE),
    (aten._scaled_mm.default, None, SAVE),
]


@pytest.mark.parametrize(("func", "dtype", "want"), POLICY_CASES, ids=str)
def test_policy_recomputes_elementwise_ops_and_narrowing_casts(func, dtype, want):
    kwargs = {} if dtype is None else {"dtype": dtype}
    assert recompute._policy(None, func, **kwargs) == want


def test_compiled_delayed_block_saves_what_tensorwise_saves(monkeypatch):
    """fp8-delayed, compiled, saves no FP8 operand and no more than fp8-tensorwise (its amaxes
    aside). Without the region the layers reading an input another layer had cast with its own
    scale (k and v after q, up after gate) saved their FP8 copies (the partitioner's "used
    above/below fusible" rule; +2.2 GiB at 1.3B); with the policy recomputing widening
    conversions too, the shared float64 conversion of the input (docs/hopper_sessions.md,
    session 18)."""
    force_hopper_path(monkeypatch)
    delayed, tensorwise = _nbytes(_saved("fp8-delayed")), _nbytes(_saved("fp8-tensorwise"))
    narrow = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
    assert not [d for _, d in delayed if d in narrow]
    assert not [n for n, d in delayed if d == torch.float64 and n > 8]
    extra = sum(n for n, _ in delayed) - sum(n for n, _ in tensorwise)
    assert 0 <= extra <= 64, extra  # the scalar amaxes backward records in the history
