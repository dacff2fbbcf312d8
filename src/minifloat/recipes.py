"""Named precision recipes: frozen, keyword-only dataclasses, looked up by name.

A recipe states everything about how a model trains numerically: the autocast dtype of the
non-GEMM ops, whether fp16 loss scaling is needed, and (for quantized recipes) how each operand of
each of the three GEMMs is quantized. `get(name)` returns one; `dataclasses.replace` makes variants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Recipe", "get", "names", "register"]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base recipe: mixed precision without quantized GEMMs (fp32, fp16, bf16)."""

    name: str
    description: str = ""
    autocast_dtype: torch.dtype | None = torch.bfloat16  # None: everything in fp32
    loss_scaling: bool = False  # fp16 needs dynamic loss scaling

    @property
    def quantized(self) -> bool:
        """Whether `convert()` swaps linear layers for quantized ones under this recipe."""
        return False

    def describe(self) -> dict[str, str]:
        """Per-GEMM precision in words, for tables and `minifloat recipes`."""
        dtype = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.autocast_dtype]
        return {"fprop": dtype, "dgrad": dtype, "wgrad": dtype}


_REGISTRY: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Add a recipe to the registry (names are unique)."""
    if recipe.name in _REGISTRY:
        raise ValueError(f"recipe {recipe.name!r} is already registered")
    _REGISTRY[recipe.name] = recipe
    return recipe


def names() -> list[str]:
    """Registered recipe names, in registration order."""
    return list(_REGISTRY)


def get(name: str | Recipe) -> Recipe:
    """The recipe called `name` (a Recipe passes through)."""
    if isinstance(name, Recipe):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(_REGISTRY)}") from None


register(Recipe(name="fp32", description="full fp32 (reference)", autocast_dtype=None))
register(Recipe(name="fp16", description="fp16 autocast + dynamic loss scaling",
                autocast_dtype=torch.float16, loss_scaling=True))  # fmt: skip
register(Recipe(name="bf16", description="bf16 autocast (the baseline)"))
