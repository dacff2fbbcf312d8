"""Delayed tensor scales (Transformer Engine / MS-AMP style): a scale from past amaxes.

A fp8-delayed `QuantLinear` keeps a [3, history_len] amax history (rows: input, weight,
grad_output; column 0 the newest). Step t quantizes each operand with the scale
`max(history row) * 2**margin / fmt.max` of the steps before it, and its backward records the
step's three amaxes once (`record`). Recording in backward rather than forward makes a forward
that no backward follows (evaluation, generation) leave the history alone, and makes activation
checkpointing, which runs a forward again inside backward, record a step once.
"""

from __future__ import annotations

import math

import torch

from minifloat import formats
from minifloat.exact import div_rn
from minifloat.recipes import DelayedScaling

__all__ = ["INPUT", "WEIGHT", "GRAD_OUTPUT", "history_scale", "record", "amax"]

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2  # rows of the amax history


def amax(t: torch.Tensor) -> torch.Tensor:
    """|t|.amax() as a 0-dim float32 tensor (NaN if t holds one)."""
    return t.detach().abs().amax().float()


def history_scale(
    history: torch.Tensor, row: int, amax_now: torch.Tensor, fmt: str, cfg: DelayedScaling
) -> torch.Tensor:
    """The [1, 1] float32 scale of history row `row`: its largest finite past amax (the current
    amax while the row is still empty) times 2**margin over `fmt`'s max; 1 if that is zero.

    Divided with `exact.div_rn`, so it equals `quantize()`'s scale of that amax bit for bit.
    """
    # Few graph nodes on purpose: this chain sits between an input and its cast, and the
    # partitioner stops recomputing casts more than 100 nodes after their input (its "too long"
    # rule), which made it save the SwiGLU output's FP8 copy (docs/hopper_sessions.md, session 13).
    _check_history(history)  # shapes only: no graph nodes
    if amax_now.numel() != 1:
        raise ValueError(f"amax_now must be one amax, got shape {tuple(amax_now.shape)}")
    h = history[row]
    past = torch.where(h < math.inf, h, 0.0).amax()  # NaN and +inf entries count as 0
    ref = torch.where(past > 0, past, amax_now)
    if cfg.margin:
        ref = ref * (2.0**cfg.margin)
    scale = div_rn(ref, torch.full_like(ref, formats.get(fmt).max))
    return torch.where(scale > 0, scale, 1.0).reshape(1, 1)


def record(history: torch.Tensor, amaxes: torch.Tensor) -> None:
    """Shift the history one step and write `amaxes` [3] (input, weight, grad_output) in front."""
    _check_history(history)
    if amaxes.numel() != 3:
        raise ValueError(
            f"amaxes must be [3] (input, weight, grad_output), got {tuple(amaxes.shape)}"
        )
    history.copy_(torch.cat([amaxes.reshape(3, 1), history[:, :-1]], dim=1))


def _check_history(history: torch.Tensor) -> None:
    """The history must be [3, history_len >= 1]: a 1-D one's `history[row]` is a single entry,
    taken silently as the row's past amaxes."""
    if history.dim() != 2 or history.shape[0] != 3 or history.shape[1] < 1:
        raise ValueError(
            f"history must be [3, history_len >= 1] (rows input, weight, grad_output), got "
            f"shape {tuple(history.shape)}"
        )
