"""Tests for minifloat.amp: the autocast policy."""

from __future__ import annotations

import pytest
import torch

from minifloat import recipes
from minifloat.amp import autocast_context, full_precision


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_autocast_context_on_cpu(name: str, dtype: torch.dtype) -> None:
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with autocast_context(recipes.get(name), "cpu"):
        out = a @ b
        with full_precision("cpu"):
            exact = a @ b
    assert out.dtype == dtype
    assert exact.dtype == torch.float32
