"""The training loss and the validation loss: cross entropy in fp32 from upcast logits."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minifloat import recipes
from minifloat.amp import autocast_context, full_precision
from minifloat.train.errors import ConfigError

__all__ = ["cross_entropy", "eval_batch_size", "evaluate"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def eval_batch_size(val_tokens: Any, batch_size: int, seq_len: int) -> int:
    """The training batch size, or fewer rows when the validation split is small."""
    fits = (len(val_tokens) - 1) // seq_len
    if fits < 1:  # build_dataset checks this too; kept for datasets passed in directly
        raise ConfigError(
            f"validation split has {len(val_tokens)} tokens, fewer than one "
            f"sequence of {seq_len}; use more data or a shorter seq-len"
        )
    return min(batch_size, fits)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokens: Any,
    *,
    recipe: recipes.Recipe,
    device: torch.device,
    batch_size: int,
    seq_len: int,
    batches: int,
    rank: int = 0,
    world_size: int = 1,
) -> float:
    """Mean cross-entropy over the first ``batches`` sequential batches of ``tokens``.

    Sequential windows make every evaluation see exactly the same text, so validation losses
    are comparable across steps and recipes.
    """
    from minifloat.data import BatchIterator

    iterator = BatchIterator(
        tokens, batch_size, seq_len, mode="sequential", rank=rank, world_size=world_size
    )
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for _ in range(batches):
            inputs, targets = iterator.next()
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast_context(recipe, device):
                logits = model(inputs)
            with full_precision(device):
                total += float(cross_entropy(logits, targets))
    finally:
        model.train(was_training)
    return total / batches
