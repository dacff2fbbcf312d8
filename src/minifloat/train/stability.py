"""Training-stability tools: the step guard, embedding-gradient shrink and z-loss.

Low-precision training fails loudly (a NaN) or quietly (one batch whose loss or gradient norm
explodes and drags the weights somewhere bad). :class:`StepGuard` looks at each step's loss and
total gradient norm *before* the optimizer runs and vetoes the update when either is non-finite
or a spike far above its running statistics, so one bad step never corrupts the weights.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "GuardDecision",
    "StepGuard",
    "StepGuardConfig",
    "attach_embedding_grad_shrink",
    "no_progress",
    "shrink_embedding_grad",
    "z_loss",
]


@dataclass(frozen=True, kw_only=True)
class StepGuardConfig:
    """Settings of :class:`StepGuard`.

    ``spike_k``: a loss above ``mean + spike_k * std`` of the recent accepted losses is a spike
    (0 or inf disables spike detection; non-finite values are always rejected).
    ``grad_norm_spike_k``: the same test for the gradient norm, off (0) by default: grad norms
    are heavy-tailed, 2-4x jumps are routine and clipping already bounds them (with it on at k=6,
    a healthy 125M bf16 run skipped 10 of 300 steps on an H200, 2026-11-22).
    ``window``: how many recent accepted steps the statistics cover.
    ``warmup_steps``: accepted steps collected before spike detection starts.
    ``min_rel_std``: floor on std as a fraction of |mean|, so a flat plateau with tiny noise does
    not turn ordinary fluctuations into "spikes".
    ``max_consecutive_spikes``: after this many spike-skips in a row the level is taken as a real
    shift (e.g. the end of LR warm-up): the value is accepted and the statistics restart.
    """

    spike_k: float = 6.0
    grad_norm_spike_k: float = 0.0
    window: int = 100
    warmup_steps: int = 20
    min_rel_std: float = 0.02
    max_consecutive_spikes: int = 10


@dataclass(frozen=True)
class GuardDecision:
    """Outcome of :meth:`StepGuard.check`: ``skip`` and a short ``reason`` ("" when applied)."""

    skip: bool
    reason: str = ""


class _Window:
    """Mean and standard deviation over the last ``size`` accepted values."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def threshold(self, k: float, min_rel_std: float) -> float:
        n = len(self.values)
        mean = sum(self.values) / n
        var = sum((v - mean) ** 2 for v in self.values) / max(n - 1, 1)
        std = max(math.sqrt(var), min_rel_std * abs(mean))
        return mean + k * std


class StepGuard:
    """Decide per step whether to apply the update, from the loss and the total gradient norm.

    A step is skipped when the loss or grad norm is non-finite, or (once ``warmup_steps``
    accepted steps have been seen) when either exceeds ``mean + k * std`` of the last ``window``
    accepted values. Skipped values never enter the statistics. A step accepted here can still
    be refused after the update (:meth:`revoke`, e.g. by the weight guard). Counters: ``skipped``
    (all), ``skipped_nonfinite``, ``skipped_spike``, ``skipped_update``.
    """

    def __init__(self, config: StepGuardConfig | None = None) -> None:
        self.config = config or StepGuardConfig()
        self._loss = _Window(self.config.window)
        self._grad_norm = _Window(self.config.window)
        self._consecutive_spikes = 0
        self.skipped_nonfinite = 0
        self.skipped_spike = 0
        self.skipped_update = 0
        self._undo: int | None = None  # consecutive spikes before the step check() accepted

    @property
    def skipped(self) -> int:
        return self.skipped_nonfinite + self.skipped_spike + self.skipped_update

    @property
    def _warmed_up(self) -> bool:
        return len(self._loss.values) >= max(self.config.warmup_steps, 2)

    def _spike_reason(self, loss: float, grad_norm: float) -> str:
        """Why this step is a spike ("" if it is not); each check is on when its k is finite > 0."""
        if not self._warmed_up:
            return ""
        cfg = self.config
        if 0 < cfg.spike_k < math.inf:
            loss_limit = self._loss.threshold(cfg.spike_k, cfg.min_rel_std)
            if loss > loss_limit:
                return f"loss spike ({loss:.4g} > {loss_limit:.4g})"
        if 0 < cfg.grad_norm_spike_k < math.inf:
            norm_limit = self._grad_norm.threshold(cfg.grad_norm_spike_k, cfg.min_rel_std)
            if grad_norm > norm_limit:
                return f"grad-norm spike ({grad_norm:.4g} > {norm_limit:.4g})"
        return ""

    def check(self, loss: float, grad_norm: float) -> GuardDecision:
        """Return whether to skip this step; updates counters and statistics."""
        loss, grad_norm = float(loss), float(grad_norm)
        self._undo = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped_nonfinite += 1
            return GuardDecision(True, "non-finite loss or grad norm")
        reason = self._spike_reason(loss, grad_norm)
        if reason:
            self._consecutive_spikes += 1
            if self._consecutive_spikes <= self.config.max_consecutive_spikes:
                self.skipped_spike += 1
                return GuardDecision(True, reason)
            # A "spike" this persistent is a level shift: accept it and restart the statistics.
            self._loss.values.clear()
            self._grad_norm.values.clear()
        self._undo = self._consecutive_spikes
        self._consecutive_spikes = 0
        self._loss.values.append(loss)
        self._grad_norm.values.append(grad_norm)
        return GuardDecision(False)

    def revoke(self, reason: str) -> GuardDecision:
        """Turn the step :meth:`check` just accepted into a skipped one (counted in
        ``skipped_update``): its values leave the statistics again. Returns the decision."""
        if self._undo is None:
            raise RuntimeError("revoke() needs a step that check() accepted just before")
        self._consecutive_spikes, self._undo = self._undo, None
        self._loss.values.pop()
        self._grad_norm.values.pop()
        self.skipped_update += 1
        return GuardDecision(True, reason)

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": list(self._loss.values),
            "grad_norm": list(self._grad_norm.values),
            "consecutive_spikes": self._consecutive_spikes,
            "skipped_nonfinite": self.skipped_nonfinite,
            "skipped_spike": self.skipped_spike,
            "skipped_update": self.skipped_update,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss.values.clear()
        self._loss.values.extend(float(v) for v in state["loss"])
        self._grad_norm.values.clear()
        self._grad_norm.values.extend(float(v) for v in state["grad_norm"])
        self._consecutive_spikes = int(state["consecutive_spikes"])
        self.skipped_nonfinite = int(state["skipped_nonfinite"])
        self.skipped_spike = int(state["skipped_spike"])
        self.skipped_update = int(state.get("skipped_update", 0))  # absent before the weight guard


def no_progress(skipped: int, steps: int, planned: int, fraction: float) -> str | None:
    """Why a run that took `steps` of its `planned` steps, `skipped` of them vetoed, made no
    progress: more than `fraction` of the steps it took were skipped. None when it did.

    Checked after every step (the trainer stops there) as well as at the end: once more than
    `fraction` of the planned steps are skipped, the end's check cannot pass, so a run that went
    NaN stops then instead of running its remaining steps for nothing.
    """
    if not steps or skipped <= fraction * planned:
        return None
    stopped = "" if steps == planned else f"; stopped after step {steps} of {planned}"
    return (
        f"{skipped} of {steps} steps were skipped ({100 * skipped / steps:.0f} % > "
        f"max-skip-fraction {fraction:g}{stopped})"
    )


def shrink_embedding_grad(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """GLM-130B embedding-gradient shrink: same forward value, gradient scaled by ``alpha``.

    ``alpha * x + (1 - alpha) * x.detach()`` equals ``x`` in the forward pass while only the
    ``alpha`` part carries gradient, which damps the large early embedding gradients that
    trigger loss spikes.
    """
    if alpha == 1.0:
        return x
    return alpha * x + (1.0 - alpha) * x.detach()


def attach_embedding_grad_shrink(embedding: nn.Module, alpha: float) -> RemovableHandle:
    """Apply :func:`shrink_embedding_grad` to ``embedding``'s output via a forward hook.

    A hook keeps the model code free of trainer options; remove it with ``handle.remove()``.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"embedding-gradient shrink alpha must be in (0, 1], got {alpha}")

    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return shrink_embedding_grad(output, alpha)

    return embedding.register_forward_hook(hook)


def z_loss(logits: torch.Tensor, coef: float = 1e-4) -> torch.Tensor:
    """Auxiliary loss ``coef * mean(logsumexp(logits)^2)`` (PaLM), computed in fp32.

    It keeps the softmax normalizer near 1 so the logits cannot drift to magnitudes where
    low-precision arithmetic loses them.
    """
    lse = torch.logsumexp(logits.float(), dim=-1)
    return coef * lse.pow(2).mean()
