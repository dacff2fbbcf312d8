"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (the FP4 paper's setup)."""

from __future__ import annotations

import math

__all__ = ["lr_at", "warmup_steps"]


def warmup_steps(total_steps: int, warmup_fraction: float) -> int:
    """Number of warm-up steps: ``warmup_fraction`` of the run, at least 1 when the fraction > 0."""
    if warmup_fraction <= 0:
        return 0
    return max(1, round(warmup_fraction * total_steps))


def lr_at(
    step: int,
    *,
    total_steps: int,
    peak_lr: float,
    warmup_fraction: float = 0.05,
    min_lr_ratio: float = 0.1,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warm-up rises linearly to ``peak_lr`` at the last warm-up step ((step + 1) / warmup, so the
    first step already moves); afterwards a half cosine goes from ``peak_lr`` to
    ``min_lr_ratio * peak_lr``, reached at step ``total_steps - 1``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    warm = warmup_steps(total_steps, warmup_fraction)
    if step < warm:
        return peak_lr * (step + 1) / warm
    min_lr = min_lr_ratio * peak_lr
    decay_steps = total_steps - warm - 1
    if decay_steps <= 0:
        return peak_lr
    progress = min(max((step - warm) / decay_steps, 0.0), 1.0)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
