"""The model and recipes of the quantized FSDP2 all-gather tests (test_fsdp_quantized.py on 2
gloo ranks, test_fsdp_quantized_local.py in one process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minifloat.linear import QuantLinear

# Recipes under test; the gradients of all but DGE recipes are bit-exact (2 ranks: the average
# (a + b) / 2 equals a / 2 + b / 2 in fp32, and every operand is the same as unsharded).
# The named recipes form "inv" scales (fp8-delayed divides by its history's); the fp32 variant
# covers scales formed by division from the global amax.
RECIPES = ["fp8-tensorwise", "fp8-rowwise", "fp4-direct", "fp4-dge", "fp8-blockwise", "fp8-delayed"]
RECIPES += ["fp8-rowwise:scale_format=fp32"]


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, recipe: str) -> None:
        super().__init__()
        self.up = QuantLinear(dim, hidden, bias=False, recipe=recipe)
        self.down = QuantLinear(hidden, dim, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """Two residual MLP blocks of QuantLinear layers (`layers`, as apply_fsdp shards) + a head."""

    def __init__(self, recipe: str, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(dim, hidden, recipe) for _ in range(2)])
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def net(recipe: str) -> Net:
    torch.manual_seed(0)
    # 128x128 weight blocks must not cross the shard boundary: 256 rows, 128 a rank.
    return Net(recipe, 256, 256) if recipe == "fp8-blockwise" else Net(recipe)
