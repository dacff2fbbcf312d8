"""The training objective: next-token cross entropy in fp32 (plus PaLM's z-loss), eager or compiled.

The head's logits are [tokens, vocab], the largest tensor of a step at small widths and large
vocabularies (1.3B at 8 x 2048 tokens and a 32000 vocabulary: 1 GiB in bf16). Eagerly,
`F.cross_entropy(logits.float())` writes an fp32 copy, saves the fp32 log-softmax for backward
and in backward writes two fp32 gradients before the bf16 one: ~7 GiB live at once, at the
step's peak (backward starts with every activation still alive). Compiled, inductor fuses the
upcast, log-softmax and NLL into row reductions that save only the bf16 logits (which autograd
keeps alive anyway) and two floats a row (three with the z-loss), and its backward writes the
bf16 gradient in one pass.
Same formula; the compiled sums run in another order, so the loss differs from eager's in the
last bits (`tests/train/test_loss.py` states the tolerance).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from minifloat.recipes import Recipe
from minifloat.train.errors import ConfigError
from minifloat.train.evaluate import cross_entropy
from minifloat.train.head_loss import ChunkedHeadObjective, defer_head
from minifloat.train.stability import z_loss

__all__ = ["LOSS_MODES", "TrainingObjective", "objective", "training_objective"]

LOSS_MODES = ("eager", "compiled")


def objective(
    logits: torch.Tensor, targets: torch.Tensor, z_loss_coef: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, objective): the mean cross entropy, and what backward differentiates, the loss
    plus `z_loss_coef` times PaLM's z-loss when that is positive (the loss itself otherwise).

    Args:
        logits: [..., vocab], any float dtype (upcast to fp32 inside).
        targets: [...] token ids, the shape of logits without its last dimension.
        z_loss_coef: weight of the z-loss; 0 leaves it out.
    """
    loss = cross_entropy(logits, targets)
    return loss, (loss + z_loss(logits, z_loss_coef) if z_loss_coef > 0 else loss)


class TrainingObjective:
    """`objective` with its z-loss weight bound, run eagerly or compiled as one graph.

    Compiled (`mode="compiled"`) it takes one fused pass each way and no fp32 copy of the
    logits: 4.6-4.7 GiB less at a 1.3B step's peak on the H200 (session 54), with inductor's
    default options whatever the model was compiled with. Shapes are static (`dynamic=False`):
    a training run's batches share one shape, and under dynamic shapes the partitioner saves
    the fp32 upcast of the logits for backward instead of recomputing it (torch 2.13, CPU),
    which is what this form exists to avoid. Dynamo's cache for it is one per process, shared
    by every instance (torch.compile traces a `functools.partial` through one wrapper), so a
    process that meets many shapes, dtypes or z-loss weights (a test suite) compiles each, and
    past torch's recompile limit (8) runs the eager objective: same values, the eager form's
    memory. Hence no `fullgraph`, which would turn that limit into an error.
    """

    def __init__(self, z_loss_coef: float = 0.0, *, mode: str = "eager") -> None:
        if mode not in LOSS_MODES:
            raise ValueError(f"loss mode must be one of {', '.join(LOSS_MODES)}, got {mode!r}")
        if not z_loss_coef >= 0.0:
            raise ValueError(f"z-loss weight must be >= 0, got {z_loss_coef}")
        self.mode = mode
        fn: Callable = functools.partial(objective, z_loss_coef=float(z_loss_coef))
        self._fn = torch.compile(fn, dynamic=False) if mode == "compiled" else fn

    def __call__(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fn(logits, targets)

    def deferring(self) -> contextlib.AbstractContextManager:
        """`ChunkedHeadObjective.deferring`'s counterpart: nothing deferred, the model returns
        its logits (so a training loop calls either objective alike)."""
        return contextlib.nullcontext()


def training_objective(
    model: nn.Module,
    z_loss_coef: float,
    *,
    compiled: bool,
    chunk_tokens: int = 0,
    recipes: tuple[Recipe, ...] = (),
) -> TrainingObjective | ChunkedHeadObjective:
    """The trainer's objective: `TrainingObjective`, eager or compiled; with `chunk_tokens` > 0
    the model's head swapped (in place) for one the trainer defers, and the head applied with
    the loss that many tokens at a time (`head_loss.ChunkedHeadObjective`) in the autocast
    dtype of `recipes` (the run's, before and after a switch: one dtype, not fp16).
    """
    mode = "compiled" if compiled else "eager"
    if not chunk_tokens:
        return TrainingObjective(z_loss_coef, mode=mode)
    dtypes = {recipe.autocast_dtype or torch.float32 for recipe in recipes}
    if len(dtypes) != 1 or torch.float16 in dtypes:
        names = ", ".join(recipe.name for recipe in recipes)
        raise ConfigError(
            f"loss-chunk needs one bf16 or fp32 compute dtype for the head ({names}): its "
            "gradient is made in forward, before an fp16 loss scale"
        )
    return ChunkedHeadObjective(
        defer_head(model), z_loss_coef, chunk_tokens=chunk_tokens, mode=mode, dtype=dtypes.pop()
    )
