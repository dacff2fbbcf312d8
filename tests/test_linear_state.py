"""QuantLinear's state across steps: fp8-delayed's amax history (recorded by backward, saved in
the state_dict) and `set_recipe` (a run's final phase in another recipe)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from minifloat import formats, recipes
from minifloat.linear import QuantLinear
from minifloat.quantize import quantize
from minifloat.sqnr import sqnr_db
from tolerances import FP32_SUMS_MIN_DB


def _delayed_layer(history_len: int = 4, margin: int = 1) -> QuantLinear:
    r = dataclasses.replace(
        recipes.get("fp8-delayed"),
        delayed=recipes.DelayedScaling(history_len=history_len, margin=margin),
    )
    return QuantLinear(64, 32, recipe=r, backend="emulated")


def test_delayed_scaling_history():
    layer = _delayed_layer()
    assert layer.amax_history.shape == (3, 4) and "amax_history" in layer.state_dict()
    x = torch.randn(16, 64)
    layer(x).sum().backward()  # the backward records the step: input, weight, grad_output
    amax1 = x.abs().amax()
    assert layer.amax_history[0, 0] == amax1 and layer.amax_history[2, 0] == 1.0
    assert layer.amax_history[1, 0] == layer.weight.abs().amax()
    # step 2 with a 10x larger input: the scale comes from step 1's amax (x 2^margin), so most of
    # the input saturates at e4m3's max instead of following the new amax
    y = layer(10 * x)
    ref_scale = amax1 * 2 / 448.0
    q = (10 * x / ref_scale).clamp(-448, 448)
    assert float(q.abs().max()) == 448.0
    wq = quantize(layer.weight.detach(), "e4m3")
    expected = quantize(q, "e4m3").dequantize() * ref_scale @ wq.dequantize().t()
    assert sqnr_db(expected, y - layer.bias) > FP32_SUMS_MIN_DB
    assert layer.amax_history[0, :2].tolist() == [float(amax1), 0.0]  # no backward: no record
    y.sum().backward()
    assert layer.amax_history[0, :2].tolist() == [float(10 * amax1), float(amax1)]


def _cast_with_scale(t: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """t quantized with a given tensor scale, as float64 (saturating at the format's max)."""
    f = formats.get(fmt)
    return f.round((t / scale).clamp(-f.max, f.max)).double() * scale.double()


@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_step_uses_the_past_amaxes_in_all_three_gemms(margin):
    """Step 2's y, dx and dw use step 1's amaxes (x 2^margin) of input, weight and grad_output,
    not the current ones: against float64 GEMMs of operands cast with those scales."""
    layer = _delayed_layer(margin=margin)
    gen = torch.Generator().manual_seed(0)
    x1, dy1 = torch.randn(16, 64, generator=gen), torch.randn(16, 32, generator=gen)
    layer(x1).backward(dy1)
    layer.weight.grad = None
    # step 2's operands 4x and 10x smaller: their current scales would differ from the past ones
    x2 = (0.25 * torch.randn(16, 64, generator=gen)).requires_grad_()
    dy2 = 0.1 * torch.randn(16, 32, generator=gen)
    y = layer(x2)
    y.backward(dy2)
    w = layer.weight.detach()
    past = [t.abs().amax() * 2.0**margin for t in (x1, w, dy1)]
    xq = _cast_with_scale(x2.detach(), past[0] / 448.0, "e4m3")
    wq = _cast_with_scale(w, past[1] / 448.0, "e4m3")
    gq = _cast_with_scale(dy2, past[2] / 57344.0, "e5m2")
    expected = {"y": xq @ wq.t(), "dx": gq @ wq, "dw": gq.t() @ xq}
    got = {"y": y.detach() - layer.bias.detach(), "dx": x2.grad, "dw": layer.weight.grad}
    for name, value in expected.items():
        assert sqnr_db(value, got[name]) > FP32_SUMS_MIN_DB, name


def test_delayed_scales_keep_non_finite_input_non_finite():
    """A scale from past steps would saturate an inf to E4M3's max and the step guard would
    train on it: the cast keeps it NaN, as the current-scaled recipes' NaN group scale does."""
    layer = _delayed_layer()
    layer(torch.randn(16, 64)).sum().backward()  # a filled history: scales from the past
    x = torch.randn(16, 64)
    x[3, 5] = float("inf")
    y = layer(x)
    y.sum().backward()
    assert torch.isnan(y[3]).all() and torch.isfinite(y[:3]).all()
    assert not torch.isfinite(layer.weight.grad).all()
    assert layer.amax_history[0, 0] == float("inf")  # recorded, and ignored by later scales
    x[3, 5] = 0.0
    assert torch.isfinite(layer(x)).all()


def test_delayed_history_ignores_evaluation_and_recomputation():
    layer = _delayed_layer()
    x = torch.randn(16, 64)
    layer(x).sum().backward()
    after_one = layer.amax_history.clone()
    with torch.no_grad():
        layer(3 * x)  # evaluation: no backward follows, nothing is recorded
    layer.eval()
    layer(5 * x)
    layer.train()
    assert torch.equal(layer.amax_history, after_one)
    # activation checkpointing runs the forward again inside backward: one record per step
    from torch.utils.checkpoint import checkpoint

    xg = (2 * x).requires_grad_()
    checkpoint(layer, xg, use_reentrant=False).sum().backward()
    assert torch.equal(layer.amax_history[:, 1:], after_one[:, :-1])
    assert layer.amax_history[0, 0] == 2 * x.abs().amax()


def test_delayed_history_is_saved_and_plain_state_dicts_still_load():
    layer = _delayed_layer()
    layer(torch.randn(16, 64)).sum().backward()
    copy = _delayed_layer()
    copy.load_state_dict(layer.state_dict())  # strict: the history travels with checkpoints
    assert torch.equal(copy.amax_history, layer.amax_history)
    plain = nn.Linear(64, 32)
    copy.load_state_dict(plain.state_dict())  # an nn.Linear's keys: the history stays
    assert torch.equal(copy.amax_history, layer.amax_history)
    assert torch.equal(copy.weight, plain.weight)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_set_recipe_to_bf16_computes_as_nn_linear_and_back(autocast):
    """A final phase in bf16 (convert.set_recipe): the same parameters, nn.Linear's math."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = QuantLinear.from_linear(copy.deepcopy(lin), "fp4")
    weight = q.weight
    q.set_recipe("bf16")
    assert q.weight is weight and q.recipe.name == "bf16" and q.amax_history is None
    x, dy = torch.randn(2, 8, 64), torch.randn(2, 8, 32)
    outs = []
    for layer in (lin, q):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xi)
        y.backward(dy.to(y.dtype))
        outs.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*outs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    q.set_recipe("fp4")  # and back: the quantized GEMMs again
    assert torch.equal(q(x), QuantLinear.from_linear(lin, "fp4")(x))


def test_set_recipe_keeps_restarts_or_drops_the_amax_history():
    layer = _delayed_layer()
    layer(torch.randn(16, 64)).sum().backward()
    history = layer.amax_history
    assert history.abs().sum() > 0
    same_length = dataclasses.replace(
        layer.recipe, name="d4-margin0", delayed=recipes.DelayedScaling(history_len=4, margin=0)
    )
    layer.set_recipe(same_length)  # the amaxes of the same tensors: kept
    assert layer.amax_history is history and layer.recipe is same_length
    longer = dataclasses.replace(
        layer.recipe, name="d8", delayed=recipes.DelayedScaling(history_len=8)
    )
    layer.set_recipe(longer)
    assert layer.amax_history.shape == (3, 8) and not layer.amax_history.any()
    assert "amax_history" in layer.state_dict()
    layer.set_recipe("fp4")  # no delayed scaling: no history, and none in the state_dict
    assert layer.amax_history is None and list(layer.state_dict()) == ["weight", "bias"]
    with pytest.raises(ValueError, match="not multiples of 128"):
        layer.set_recipe("fp8-blockwise")  # 64 x 32: the blockwise tiles do not fit
    assert layer.recipe.name == "fp4"
