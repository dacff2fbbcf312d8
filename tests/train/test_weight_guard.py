"""Tests for minifloat.train.weight_guard: an update that makes a weight non-finite is refused,
and the weights and optimizer are exactly as before it."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from minifloat.optim import AdamW
from minifloat.train.weight_guard import WeightGuard


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _backward(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(100 + seed)
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    model(torch.randn(4, 8).to(dtype)).float().square().mean().backward()


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    # bf16 weights without master, rounded stochastically: the generator is part of the state.
    model.to(torch.bfloat16)
    return AdamW(model.parameters(), lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16",
                 master_weights="none", small_numel=1, seed=3)  # fmt: skip


def _damage(optimizer: torch.optim.Optimizer) -> None:
    """A negative second moment, as a damaged state would hold: sqrt gives NaN weights."""
    for state in optimizer.state.values():
        key = "exp_avg_sq"
        state[key] = torch.full_like(state[key], -1.0)
        break


@pytest.mark.parametrize("kind", ["torch", "minifloat"])
def test_a_refused_update_changes_nothing(kind: str) -> None:
    model = _model()
    optimizer = _optimizer(model, kind)
    guard = WeightGuard(model, optimizer)
    _backward(model, 0)
    assert guard.step() is True
    _damage(optimizer)
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    _backward(model, 1)
    assert guard.step() is False
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after) and torch.isfinite(after).all()
    restored = optimizer.state_dict()
    for key, values in state["state"].items():
        for name, value in values.items():
            got = restored["state"][key][name]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value


def test_without_the_guard_the_weights_become_nan() -> None:
    model = _model()
    optimizer = _optimizer(model, "torch")
    guard = WeightGuard(model, optimizer, enabled=False)
    _backward(model, 0)
    guard.step()
    _damage(optimizer)
    _backward(model, 1)
    assert guard.step() is True
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_a_refused_first_step_leaves_the_trajectory_of_a_run_without_it() -> None:
    """Refusing the very first update (state and the rounding generator created by it) and then
    stepping equals stepping an untouched optimizer: bit for bit, stochastic rounding included."""
    guarded, plain = _model(), _model()
    opt_guarded, opt_plain = _optimizer(guarded, "minifloat"), _optimizer(plain, "minifloat")
    guard = WeightGuard(guarded, opt_guarded)
    _backward(guarded, 0)
    with torch.no_grad():
        guarded[0].weight[0, 0] = math.inf  # the update keeps it non-finite: refused
    assert guard.step() is False
    with torch.no_grad():
        guarded[0].weight[0, 0] = plain[0].weight[0, 0]
    assert opt_guarded.state == {} or all(not s for s in opt_guarded.state.values())
    for seed in (1, 2, 3):
        _backward(guarded, seed)
        _backward(plain, seed)
        assert guard.step() is True
        opt_plain.step()
    for a, b in zip(guarded.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_trainer_skips_and_counts_a_refused_update(tmp_path: Path, dataset) -> None:
    from minifloat.train import TrainConfig, Trainer

    config = TrainConfig(recipe="fp32", model="tiny", steps=6, batch_size=2, seq_len=32,
                         model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
                         eval_batches=0, device="cpu", out_dir=str(tmp_path / "run"))  # fmt: skip
    trainer = Trainer(config, dataset=dataset, progress=False)
    try:
        assert trainer.train_step()["skip_reason"] == ""
        _damage(trainer.optimizer)
        params = [p.detach().clone() for p in trainer.raw_model.parameters()]
        metrics = trainer.train_step()
        assert metrics["skip_reason"] == "non-finite weights after the update (refused)"
        assert trainer.guard.skipped == trainer.guard.skipped_update == 1
        for before, after in zip(params, trainer.raw_model.parameters(), strict=True):
            assert torch.equal(before, after)
        assert trainer.guard.state_dict()["skipped_update"] == 1
    finally:
        trainer.close()
