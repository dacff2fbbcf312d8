"""Training's peak CUDA memory, with diagnostic passes kept out of it.

The per-layer SQNR probe (`--sqnr-every`) runs the model eagerly, also when training runs it
compiled, and can need more memory than a training step: issue 15's 125M fp8-tensorwise run
logged 18.7 GiB after its first probe where training had peaked at 11.9. `PeakMemory.apart`
runs such a pass with the device's peak counter reset around it, so `bytes()` stays training's
and the pass's own peak is returned beside its result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["PeakMemory"]

T = TypeVar("T")


class PeakMemory:
    """Peak allocated memory on `device` since `reset()`, passes run through `apart` excluded.

    On a non-CUDA device every reading is None (the CPU allocator keeps no peak)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before = 0  # training's peak before the last reset inside `apart`

    @property
    def enabled(self) -> bool:
        return self.device.type == "cuda"

    def reset(self) -> None:
        """Start counting afresh (a run, or a resumed chunk of one, starts)."""
        self._before = 0
        if self.enabled:
            torch.cuda.reset_peak_memory_stats(self.device)

    def bytes(self) -> int | None:
        """Training's peak allocated bytes since `reset()`, or None off CUDA."""
        if not self.enabled:
            return None
        return max(self._before, torch.cuda.max_memory_allocated(self.device))

    def apart(self, fn: Callable[[], T]) -> tuple[T, int | None]:
        """Run `fn` outside training's peak; returns its result and the peak allocated while it
        ran (memory resident from training included)."""
        if not self.enabled:
            return fn(), None
        self._before = max(self._before, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            result = fn()
            return result, torch.cuda.max_memory_allocated(self.device)
        finally:
            torch.cuda.reset_peak_memory_stats(self.device)
