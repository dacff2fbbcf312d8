"""Mixed-precision policy and dynamic loss scaling.

The policy (see RECIPES.md, "Mixed precision"): matmuls run in the recipe's autocast dtype (or its
quantized format), while softmax, cross entropy, RMSNorm reductions, RoPE angles and the loss stay
in fp32, and the embedding and output head keep high-precision weights. The model already keeps
its fp32 islands; this module supplies the autocast region around the forward pass and the
:class:`LossScaler` that fp16 training needs because fp16 gradients underflow below 2^-24.

CPU autocast supports both bfloat16 and float16 on torch >= 2.11 (verified on 2.13), so the same
recipe runs unchanged on CPU and GPU; on CPU it is an emulation of the precision, not a speed-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "LossScaler",
    "LossScalerConfig",
    "autocast_context",
    "full_precision",
]


class _RecipeLike(Protocol):
    autocast_dtype: torch.dtype | None


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def autocast_context(
    recipe: _RecipeLike, device: torch.device | str
) -> contextlib.AbstractContextManager:
    """Return the autocast region for a recipe's non-quantized ops on ``device``.

    ``recipe.autocast_dtype`` of None means plain fp32 (a no-op context). Quantized recipes use
    bf16 for the ops that stay unquantized; their linear layers quantize on their own.
    """
    dtype = recipe.autocast_dtype
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=_device_type(device), dtype=dtype)


def full_precision(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Disable autocast inside an autocast region (for the loss and other fp32 islands)."""
    return torch.autocast(device_type=_device_type(device), enabled=False)


@dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """Settings of the dynamic loss scaler (defaults follow the usual fp16 practice)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24


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
        if self.config.growth_factor <= 1.0 or not 0.0 < self.config.backoff_factor < 1.0:
            raise ValueError("LossScaler needs growth_factor > 1 and 0 < backoff_factor < 1")
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
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._scale)

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after a step; return True if the step may be applied."""
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
        if bool(state["enabled"]) != self.enabled:
            raise ValueError(
                f"loss scaler state has enabled={state['enabled']}, this run has {self.enabled}"
            )
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])
