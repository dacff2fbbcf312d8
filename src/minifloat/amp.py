"""Mixed-precision policy: the autocast region of a recipe's non-quantized ops.

The policy (docs/training.md, "Mixed-precision policy"): matmuls run in the recipe's autocast
dtype (or its quantized format), while softmax, cross entropy, RMSNorm reductions, RoPE angles and
the loss stay in fp32, and the embedding and output head keep high-precision weights. The model
already keeps its fp32 islands; this module supplies the autocast region around the forward pass
(and the fp32 islands inside it). The dynamic loss scaling that fp16 training needs is a
training-loop tool: :class:`minifloat.train.loss_scaler.LossScaler`.

CPU autocast supports both bfloat16 and float16 on torch >= 2.11 (verified on 2.13), so the same
recipe runs unchanged on CPU and GPU; on CPU it is an emulation of the precision, not a speed-up.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

__all__ = ["autocast_context", "full_precision"]


class _RecipeLike(Protocol):
    autocast_dtype: torch.dtype | None


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def autocast_context(
    recipe: _RecipeLike | str, device: torch.device | str
) -> contextlib.AbstractContextManager:
    """Return the autocast region for a recipe's non-quantized ops on ``device``.

    ``recipe``: a recipe or its name. ``recipe.autocast_dtype`` of None means plain fp32 (a
    no-op context). Quantized recipes use bf16 for the ops that stay unquantized; their linear
    layers quantize on their own.
    """
    if isinstance(recipe, str):  # every other API takes names too
        from minifloat import recipes

        recipe = recipes.get(recipe)
    dtype = recipe.autocast_dtype
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=_device_type(device), dtype=dtype)


def full_precision(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Disable autocast inside an autocast region (for the loss and other fp32 islands)."""
    return torch.autocast(device_type=_device_type(device), enabled=False)
