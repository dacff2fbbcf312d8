"""Tests for minifloat.train.stability: step guard, embedding-gradient shrink, z-loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from minifloat.train.stability import (
    StepGuard,
    StepGuardConfig,
    attach_embedding_grad_shrink,
    shrink_embedding_grad,
    z_loss,
)


def _warm_guard(steps: int = 30, **kwargs: float) -> StepGuard:
    guard = StepGuard(StepGuardConfig(warmup_steps=20, **kwargs))
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(steps, 2, generator=gen) * 0.05
    for i in range(steps):
        decision = guard.check(3.0 + float(noise[i, 0]), 1.0 + float(noise[i, 1]))
        assert not decision.skip
    return guard


def test_nonfinite_loss_or_norm_always_skipped() -> None:
    guard = StepGuard()
    assert guard.check(float("nan"), 1.0).skip
    assert guard.check(2.0, float("inf")).skip
    assert guard.skipped == guard.skipped_nonfinite == 2
    assert not guard.check(2.0, 1.0).skip


def test_spikes_skipped_only_after_warmup() -> None:
    guard = StepGuard(StepGuardConfig(warmup_steps=5))
    for loss in (3.0, 3.1, 2.9):
        guard.check(loss, 1.0)
    assert not guard.check(100.0, 1.0).skip  # still warming up: accepted
    guard = _warm_guard()
    decision = guard.check(30.0, 1.0)
    assert decision.skip and "loss spike" in decision.reason
    assert not guard.check(3.0, 50.0).skip  # grad-norm spikes are left to clipping by default
    guard = _warm_guard(grad_norm_spike_k=6.0)
    decision = guard.check(3.0, 50.0)
    assert decision.skip and "grad-norm spike" in decision.reason
    assert guard.skipped_spike == 1
    assert not guard.check(3.01, 1.02).skip


def test_spike_detection_can_be_disabled() -> None:
    guard = _warm_guard(spike_k=0.0)
    assert not guard.check(1e6, 1e6).skip
    assert guard.check(math.nan, 1.0).skip


def test_grad_norm_check_works_without_the_loss_check() -> None:
    guard = _warm_guard(spike_k=0.0, grad_norm_spike_k=6.0)
    assert not guard.check(1e6, 1.0).skip  # loss check off
    decision = guard.check(3.0, 50.0)
    assert decision.skip and "grad-norm spike" in decision.reason


def test_persistent_level_shift_is_accepted() -> None:
    guard = _warm_guard(max_consecutive_spikes=3)
    assert [guard.check(9.0, 1.0).skip for _ in range(4)] == [True, True, True, False]
    assert not guard.check(9.0, 1.0).skip  # the new level is now the statistics


def test_state_dict_round_trip() -> None:
    a = _warm_guard()
    a.check(float("nan"), 1.0)
    b = StepGuard(StepGuardConfig(warmup_steps=20))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.check(30.0, 1.0) == a.check(30.0, 1.0)


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


def _grads(
    model: nn.Module, alpha: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    handle = attach_embedding_grad_shrink(model[0], alpha) if alpha is not None else None
    tokens = torch.tensor([[1, 2, 3, 4]])
    out = model(tokens)
    out.square().mean().backward()
    if handle is not None:
        handle.remove()
    grads = model[0].weight.grad.clone(), model[1].weight.grad.clone()
    model.zero_grad()
    return out.detach(), *grads


def test_revoke_turns_an_accepted_step_into_a_skipped_one() -> None:
    guard = StepGuard(StepGuardConfig(warmup_steps=2))
    for loss in (2.0, 2.1, 2.05):
        assert not guard.check(loss, 1.0).skip
    before = guard.state_dict()
    assert not guard.check(2.02, 1.1).skip
    decision = guard.revoke("non-finite weights after the update (refused)")
    assert decision.skip and decision.reason.startswith("non-finite weights")
    after = guard.state_dict()
    assert after["loss"] == before["loss"] and after["grad_norm"] == before["grad_norm"]
    assert guard.skipped == guard.skipped_update == 1
    with pytest.raises(RuntimeError, match="revoke"):
        guard.revoke("twice")  # only the step check() just accepted
    restored = StepGuard()
    restored.load_state_dict({k: v for k, v in after.items() if k != "skipped_update"})
    assert restored.skipped_update == 0  # a checkpoint from before the weight guard loads


def test_embedding_grad_shrink_scales_only_the_embedding_gradient() -> None:
    model = _tiny_model()
    out_ref, emb_ref, lin_ref = _grads(model, None)
    out, emb, lin = _grads(model, 0.1)
    # The same computation but for one multiply by alpha: assert_close's fp32 defaults (rtol
    # 1.3e-6, atol 1e-5) hold with > 80x to spare (measured 1.2e-7).
    torch.testing.assert_close(out, out_ref)  # forward unchanged (up to rounding)
    torch.testing.assert_close(lin, lin_ref)
    torch.testing.assert_close(emb, 0.1 * emb_ref)


def test_shrink_function_forward_identity() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    y = shrink_embedding_grad(x, 0.25)
    torch.testing.assert_close(y, x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 0.25))


def test_z_loss_value_and_upcast() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.bfloat16)
    lse = torch.logsumexp(logits.float(), -1)
    out = z_loss(logits, 1e-4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, 1e-4 * lse.pow(2).mean())  # the same fp32 ops: exact
    # log(4)^2 from fp32 ops: a few ulps, inside pytest.approx's default rel=1e-6 (measured 1e-9)
    assert z_loss(torch.zeros(2, 4), 1.0).item() == pytest.approx(math.log(4.0) ** 2)


@pytest.mark.parametrize("grad_norm_spike_k", [None, 4.0])
def test_train_config_reaches_the_trainers_guard(tmp_path, dataset, grad_norm_spike_k) -> None:
    from minifloat.train.config import TrainConfig
    from minifloat.train.trainer import Trainer

    changes = {} if grad_norm_spike_k is None else {"grad_norm_spike_k": grad_norm_spike_k}
    config = TrainConfig(
        recipe="fp32", model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
        steps=2, batch_size=2, seq_len=16, spike_k=5.0, spike_warmup=7, device="cpu",
        out_dir=str(tmp_path / "run"), **changes,
    )  # fmt: skip
    trainer = Trainer(config, dataset=dataset, progress=False)
    try:
        guard = trainer.guard.config
    finally:
        trainer.close()
    expected = StepGuardConfig().grad_norm_spike_k if grad_norm_spike_k is None else 4.0
    assert guard.grad_norm_spike_k == expected
    assert guard.spike_k == 5.0 and guard.warmup_steps == 7
