"""Refuse an optimizer update that makes any weight non-finite.

The step guard (stability.py) judges a step by its loss and gradient norm *before* the update;
a finite gradient can still produce a non-finite weight (a damaged or overflowing optimizer
state, a weight already near the largest float). :class:`WeightGuard` copies the weights and the
optimizer state, applies the update, checks every weight, and on a non-finite one puts the copy
back: the step is skipped and the weights and optimizer are exactly as before it. The copy costs
one more set of weights and optimizer state in memory (12 bytes per parameter for fp32 AdamW);
``weight_guard=False`` (``--no-weight-guard``) turns it off where that memory is needed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minifloat.optim.state_loading import local_tensor as _local  # FSDP2 params are DTensors

__all__ = ["WeightGuard"]


class WeightGuard:
    """Applies ``optimizer.step()`` only if every parameter of ``model`` stays finite.

    ``any_rank``: turns this rank's "found a non-finite weight" into every rank's (a MAX
    all-reduce under torchrun), so all ranks skip the same steps.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        enabled: bool = True,
        any_rank: Callable[[bool], bool] = bool,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.enabled, self.any_rank = optimizer, enabled, any_rank

    @torch.no_grad()
    def step(self) -> bool:
        """Run the optimizer step; return False (having undone it) when it made any weight
        non-finite."""
        if not self.enabled:
            self.optimizer.step()
            return True
        saved = self._snapshot()
        self.optimizer.step()
        if not self.any_rank(self._nonfinite()):
            return True
        self._restore(saved)
        return False

    def _nonfinite(self) -> bool:
        local = [_local(p) for p in self.params]
        if not local:
            return False
        # inf-norm (max |w|): NaN and inf propagate, and it cannot overflow on finite weights.
        norms = torch._foreach_norm(local, float("inf"))
        return not bool(torch.isfinite(torch.stack(norms)).all())

    def _snapshot(self) -> dict[str, Any]:
        state = {
            p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in s.items()}
            for p, s in self.optimizer.state.items()
        }
        generators = getattr(self.optimizer, "generator_states", None)
        return {
            "params": [_local(p).clone() for p in self.params],
            "state": state,
            "generators": generators() if callable(generators) else None,
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        for param, value in zip(self.params, saved["params"], strict=True):
            _local(param).copy_(value)
        for param in list(self.optimizer.state):
            if param not in saved["state"]:  # state the step created
                del self.optimizer.state[param]
        for param, values in saved["state"].items():
            self.optimizer.state[param] = values
        if saved["generators"] is not None:
            self._restore_generators(saved["generators"])

    def _restore_generators(self, saved: dict[str, torch.Tensor]) -> None:
        """minifloat AdamW's stochastic-rounding generators as they were; one the step created
        goes back to its seeded start, where it would begin when first used again."""
        states = dict(saved)
        for device in self.optimizer.generator_states():
            if device not in states:
                fresh = torch.Generator(device=device).manual_seed(self.optimizer.seed)
                states[device] = fresh.get_state()
        self.optimizer.set_generator_states(states)
