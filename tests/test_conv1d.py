"""QuantConv1D (GPT-2's transposed linear): bit for bit QuantLinear on the transposed weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifloat.conv1d import QuantConv1D
from minifloat.linear import QuantLinear

Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D


@pytest.mark.parametrize("recipe", ["fp4", "fp8-tensorwise", "fp8-rowwise", "fp8-delayed"])
def test_quant_conv1d_equals_quant_linear_on_the_transposed_weight(recipe: str) -> None:
    torch.manual_seed(0)
    conv = Conv1D(nf=48, nx=32)
    nn.init.normal_(conv.bias)
    linear = nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    q_conv = QuantConv1D.from_conv1d(conv, recipe, backend="emulated")
    q_linear = QuantLinear.from_linear(linear, recipe, backend="emulated")
    assert q_conv.weight is conv.weight and q_conv.bias is conv.bias
    history = ["amax_history"] if recipe == "fp8-delayed" else []  # as in QuantLinear
    assert list(q_conv.state_dict()) == ["weight", "bias", *history]
    assert tuple(q_conv.state_dict()["weight"].shape) == (32, 48)

    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_conv, y_linear = q_conv(x1), q_linear(x2)
    assert y_conv.shape == (3, 5, 48)
    assert torch.equal(y_conv, y_linear)
    dy = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(2))
    y_conv.backward(dy)
    y_linear.backward(dy)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(q_conv.weight.grad, q_linear.weight.grad.t())
    assert torch.equal(q_conv.bias.grad, q_linear.bias.grad)
    if recipe == "fp8-delayed":
        assert torch.equal(q_conv.amax_history, q_linear.amax_history)
    # and quantization did something: the plain Conv1D differs
    assert not torch.equal(conv(x), y_conv)


def test_constructor_and_checks() -> None:
    layer = QuantConv1D(48, 32, recipe="fp4")
    assert layer.weight.shape == (32, 48) and layer.bias.shape == (48,)
    assert (layer.in_features, layer.out_features) == (32, 48)
    assert "nf=48, nx=32, recipe=fp4" in repr(layer)
    with pytest.raises(ValueError, match="does not quantize"):
        QuantConv1D(48, 32, recipe="bf16")
    with pytest.raises(ValueError, match="expected last dim 32"):
        layer(torch.randn(2, 16))
    conv = Conv1D(nf=48, nx=32)
    conv.weight = nn.Parameter(torch.randn(48, 32))  # not [nx, nf]
    with pytest.raises(ValueError, match=r"shape \[nx, nf\] = \[32, 48\]"):
        QuantConv1D.from_conv1d(conv, "fp4")


def test_set_recipe_to_bf16_computes_as_conv1d() -> None:
    torch.manual_seed(0)
    conv, twin = Conv1D(nf=48, nx=32), Conv1D(nf=48, nx=32)
    twin.load_state_dict(conv.state_dict())
    q_conv = QuantConv1D.from_conv1d(twin, "fp4", backend="emulated")
    q_conv.set_recipe("bf16")
    assert q_conv.weight is twin.weight and q_conv.recipe.name == "bf16"
    x = torch.randn(3, 5, 32)
    outs = []
    for layer in (conv, q_conv):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
        outs.append((y, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*outs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
