"""Dynamic loss scaling for fp16 training: fp16 gradients underflow below 2^-24.

The loss is multiplied by a scale before ``backward()`` and the gradients divided by it
afterwards; an overflow (a non-finite gradient norm) skips the step and lowers the scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LossScaler", "LossScalerConfig"]


@dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """Settings of the dynamic loss scaler (defaults follow the usual fp16 practice)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        # nan stuck the scale at nan (every step skipped); 0 divided by zero in unscale_
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"loss scaler {name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"loss scaler {name} must be positive and finite, got {value}")
        if self.growth_factor <= 1.0 or not self.backoff_factor < 1.0:
            raise ValueError("LossScaler needs growth_factor > 1 and 0 < backoff_factor < 1")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"loss scaler needs min_scale <= init_scale <= max_scale, got {self.min_scale}, "
                f"{self.init_scale}, {self.max_scale}"
            )
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise TypeError(f"growth_interval must be an int, got {self.growth_interval!r}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")


class LossScaler:
    """Dynamic loss scaling for fp16 training (our own, independent of torch.amp.GradScaler).

    Protocol per optimizer step:

    1. ``scaler.scale(loss).backward()`` (once per micro-batch);
    2. ``scaler.unscale_(params)`` divides the gradients by the scale in place;
    3. compute the total gradient norm (e.g. while clipping); it is non-finite iff some gradient
       overflowed;
    4. ``scaler.update(found_inf)``: on overflow the scale is multiplied by ``backoff_factor`` and
       the caller must skip the step; after ``growth_interval`` clean steps in a row it is
       multiplied by ``growth_factor``.

    Taking ``found_inf`` from the caller (rather than scanning gradients here) lets the overflow
    decision come from a global gradient norm, identical on every rank under DDP/FSDP.
    A disabled scaler (``enabled=False``) is the identity and never changes.
    """

    def __init__(self, config: LossScalerConfig | None = None, *, enabled: bool = True) -> None:
        self.config = config or LossScalerConfig()
        if not isinstance(enabled, bool):  # "no" would count as enabled
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        self.enabled = enabled
        self._scale = float(self.config.init_scale) if enabled else 1.0
        self._clean_steps = 0
        self.overflows = 0

    @property
    def scale_value(self) -> float:
        """The current loss scale (1.0 when disabled)."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the current scale before ``backward()``."""
        if not self.enabled:
            return loss
        return loss * self._scale

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient by the scale, in place (inf/nan stay non-finite)."""
        if not self.enabled:
            return
        if isinstance(params, (torch.Tensor, torch.nn.Module, dict)):
            # iterating one Parameter yields its rows, whose .grad is None: nothing was unscaled
            raise TypeError(
                f"unscale_ takes an iterable of Parameters (e.g. model.parameters()), got "
                f"{type(params).__name__}"
            )
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._scale)

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after a step; return True if the step may be applied."""
        if isinstance(found_inf, torch.Tensor) and found_inf.dtype == torch.bool:
            found_inf = bool(found_inf)
        if not isinstance(found_inf, bool):
            # a gradient norm passed here counted every finite norm as an overflow: each step
            # skipped and the scale halved, training stalled without an error
            raise TypeError(
                f"update takes found_inf, True or False (e.g. not math.isfinite(grad_norm)), "
                f"got {type(found_inf).__name__}: {found_inf!r}"
            )
        if not self.enabled:
            return not found_inf
        cfg = self.config
        if found_inf:
            self._scale = max(self._scale * cfg.backoff_factor, cfg.min_scale)
            self._clean_steps = 0
            self.overflows += 1
            return False
        self._clean_steps += 1
        if self._clean_steps >= cfg.growth_interval:
            self._scale = min(self._scale * cfg.growth_factor, cfg.max_scale)
            self._clean_steps = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "scale": self._scale,
            "clean_steps": self._clean_steps,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted({"enabled", "scale", "clean_steps", "overflows"} - set(state))
        if missing:  # e.g. a torch.amp.GradScaler state: another format
            raise ValueError(f"not a LossScaler state: it lacks {', '.join(missing)}")
        scale = float(state["scale"])
        cfg = self.config
        if self.enabled and not (math.isfinite(scale) and cfg.min_scale <= scale <= cfg.max_scale):
            raise ValueError(
                f"loss scaler state has scale {scale}, outside [{cfg.min_scale}, {cfg.max_scale}]"
            )
        if bool(state["enabled"]) != self.enabled:
            raise ValueError(
                f"loss scaler state has enabled={state['enabled']}, this run has {self.enabled}"
            )
        self._scale = scale
        self._clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])
