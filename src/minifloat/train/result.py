"""What a finished (or stopped) run returns: :class:`TrainResult`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FINAL_LOSS_WINDOW", "TrainResult", "final_loss"]

# Final train loss is the mean over this many last steps: one step's loss is too noisy to rank
# recipes by.
FINAL_LOSS_WINDOW = 10


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Summary of a finished (or stopped) run; ``losses`` has one entry per optimizer step.

    ``tokens_per_s`` is the steady-state speed (tokens per step over the median step time);
    ``rank`` is this process's rank (every rank returns a result under torchrun). ``recipe`` is
    the run's name: its recipe, or ``RECIPE+switch=SWITCH+at=F`` for a run with a final-phase
    switch (switch.py), whose settings are ``switch_recipe`` and ``switch_at``. A run that
    started from another run's checkpoint (branch.py) names that run's directory in
    ``branched_from`` and the checkpoint's step in ``branch_step``.
    """

    recipe: str
    model: str
    num_params: int
    steps: int
    tokens: int
    final_loss: float
    final_val_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int | None
    skipped_steps: int
    losses: tuple[float, ...]
    val_losses: tuple[tuple[int, float], ...]
    out_dir: Path
    metrics_path: Path
    checkpoint_path: Path | None
    rank: int = 0
    switch_recipe: str | None = None
    switch_at: float | None = None
    branched_from: str | None = None
    branch_step: int | None = None


def final_loss(losses: Sequence[float]) -> float:
    """Mean of the last :data:`FINAL_LOSS_WINDOW` finite losses (NaN if there are none).

    Skipped steps may have non-finite losses; they did not change the weights.
    """
    tail = [v for v in losses if math.isfinite(v)][-FINAL_LOSS_WINDOW:] or [math.nan]
    return sum(tail) / len(tail)
