"""Tests for minifloat.train.loss_scaler: the dynamic LossScaler."""

from __future__ import annotations

import re

import pytest
import torch

from minifloat.train.loss_scaler import LossScaler, LossScalerConfig


def _params_with_grads(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_defaults_match_spec() -> None:
    scaler = LossScaler()
    assert scaler.scale_value == 2.0**16
    assert scaler.config.backoff_factor == 0.5
    assert scaler.config.growth_factor == 2.0
    assert scaler.config.growth_interval == 2000


def test_scale_and_unscale_round_trip() -> None:
    scaler = LossScaler(LossScalerConfig(init_scale=1024.0))
    loss = torch.tensor(0.75)
    assert scaler.scale(loss).item() == 0.75 * 1024
    params = _params_with_grads(torch.tensor([2048.0, -512.0]))
    scaler.unscale_(params)
    assert torch.equal(params[0].grad, torch.tensor([2.0, -0.5]))


def test_overflow_backs_off_and_skips() -> None:
    scaler = LossScaler(LossScalerConfig(init_scale=2.0**16, growth_interval=3))
    assert scaler.update(found_inf=False) is True
    assert scaler.update(found_inf=True) is False
    assert scaler.scale_value == 2.0**15
    assert scaler.overflows == 1
    # The clean-step counter restarts after an overflow: 2 clean steps are not enough to grow.
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert scaler.scale_value == 2.0**15


def test_growth_after_interval_of_clean_steps() -> None:
    scaler = LossScaler(LossScalerConfig(init_scale=8.0, growth_interval=4))
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale_value == 8.0
    scaler.update(found_inf=False)
    assert scaler.scale_value == 16.0


def test_scale_is_bounded() -> None:
    scaler = LossScaler(LossScalerConfig(init_scale=2.0, min_scale=1.0))
    for _ in range(5):
        scaler.update(found_inf=True)
    assert scaler.scale_value == 1.0


def test_real_fp16_overflow_is_detected_through_grad_norm() -> None:
    """A loss scaled beyond fp16 range gives inf gradients; the scaler then backs off."""
    scaler = LossScaler(LossScalerConfig(init_scale=2.0**40, max_scale=2.0**40))
    w = torch.nn.Parameter(torch.ones(4))
    x = torch.full((4,), 100.0, dtype=torch.float16)
    loss = (w.half() * x).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_([w])
    norm = torch.nn.utils.clip_grad_norm_([w], float("inf"))
    assert not torch.isfinite(norm)
    assert scaler.update(found_inf=not bool(torch.isfinite(norm))) is False
    assert scaler.scale_value == 2.0**39


def test_state_dict_round_trip() -> None:
    a = LossScaler(LossScalerConfig(growth_interval=5))
    for found in (False, True, False, False):
        a.update(found_inf=found)
    b = LossScaler(LossScalerConfig(growth_interval=5))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for _ in range(3):  # both grow on the same step
        assert a.update(found_inf=False) == b.update(found_inf=False)
        assert a.scale_value == b.scale_value
    assert a.scale_value == 2.0**16


def test_disabled_scaler_is_identity() -> None:
    scaler = LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.update(found_inf=False) is True
    assert scaler.update(found_inf=True) is False
    assert scaler.scale_value == 1.0
    with pytest.raises(ValueError, match="enabled"):
        scaler.load_state_dict(LossScaler().state_dict())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(init_scale=float("nan")), ValueError, "init_scale must be positive and finite"),
        (dict(growth_factor=float("nan")), ValueError, "growth_factor must be positive and fin"),
        (dict(init_scale=0.0), ValueError, "init_scale must be positive and finite, got 0.0"),
        (dict(min_scale=0.0), ValueError, "min_scale must be positive and finite"),
        (dict(min_scale=8.0, init_scale=4.0), ValueError, "min_scale <= init_scale <= max_scale"),
        (dict(growth_interval=0), ValueError, "growth_interval must be >= 1, got 0"),
        (dict(growth_interval=2.5), TypeError, "growth_interval must be an int"),
    ],
)
def test_config_refuses_values_that_stall_or_crash(kwargs, error, match) -> None:
    """nan kept the scale nan (every step skipped); 0 divided by zero in unscale_."""
    with pytest.raises(error, match=match):
        LossScalerConfig(**kwargs)


def test_misuse_that_silently_stalled_training_is_refused() -> None:
    scaler = LossScaler()
    w = torch.nn.Parameter(torch.ones(4, 4))
    w.grad = torch.full((4, 4), 2.0**16)
    # one Parameter iterates as rows whose .grad is None: nothing was unscaled
    with pytest.raises(TypeError, match="unscale_ takes an iterable of Parameters .*Parameter"):
        scaler.unscale_(w)
    # a gradient norm counted as an overflow on every step: each skipped, the scale halved
    for norm in (1.5, torch.tensor(0.7)):
        with pytest.raises(TypeError, match="update takes found_inf, True or False"):
            scaler.update(norm)
    assert scaler.update(torch.tensor(False)) is True  # a 0-d bool tensor is a bool
    assert scaler.scale_value == 2.0**16 and scaler.overflows == 0
    with pytest.raises(TypeError, match="enabled must be True or False, got 'no'"):
        LossScaler(enabled="no")


@pytest.mark.parametrize("scale", [0.0, float("nan"), -4.0, 1e30])
def test_load_refuses_a_scale_out_of_range(scale) -> None:
    state = LossScaler().state_dict() | {"scale": scale}
    with pytest.raises(ValueError, match=re.escape(f"loss scaler state has scale {scale}")):
        LossScaler().load_state_dict(state)
    with pytest.raises(ValueError, match="not a LossScaler state: it lacks clean_steps"):
        LossScaler().load_state_dict({"enabled": True, "scale": 2.0, "overflows": 0})
