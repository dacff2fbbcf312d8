"""Find a model's repeated blocks (the transformer layers), whatever the model calls them.

The rule (`find_repeated_blocks`): a *block list* is an `nn.ModuleList` or `nn.ModuleDict` with at
least two children, all of exactly the same class, each holding at least one parameter. The
blocks are the children of the outermost block lists, in module order: once a list is taken,
nothing inside its blocks is searched (an MoE layer's list of experts stays part of its decoder
layer). `nn.Sequential` is not a block list: it composes different steps of one computation.
A model with a single layer has no list of two: then the outermost one-child lists count (a
1-layer model is sharded like a deeper one of its kind).

This finds `layers` in minifloat's Llama, `model.layers` in `transformers` Llama, Mistral and
Qwen2, and `transformer.h` in GPT-2.
"""

from __future__ import annotations

from torch import nn

__all__ = ["NoRepeatedBlocksError", "find_repeated_blocks"]

_BLOCK_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class NoRepeatedBlocksError(ValueError):
    """The model holds no list of two or more blocks of the same class."""


def _is_block_list(module: nn.Module, min_children: int) -> bool:
    if not isinstance(module, _BLOCK_CONTAINERS):
        return False
    children = list(module.children())
    return (
        len(children) >= min_children
        and len({type(c) for c in children}) == 1
        and all(any(True for _ in c.parameters()) for c in children)
    )


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of `model`'s outermost block lists, in module order (see the module
    docstring for the rule). Raises NoRepeatedBlocksError when there are none."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_repeated_blocks takes an nn.Module, got {type(model).__name__}")
    blocks = _outermost_blocks(model, min_children=2) or _outermost_blocks(model, min_children=1)
    if not blocks:
        raise NoRepeatedBlocksError(
            f"{type(model).__name__} has no nn.ModuleList/ModuleDict of blocks of one class "
            "with parameters; name the blocks to shard explicitly"
        )
    return blocks


def _outermost_blocks(model: nn.Module, min_children: int) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:  # depth first, children in registration order
        module = stack.pop()
        if id(module) in seen:  # a module shared by two parents is visited once
            continue
        seen.add(id(module))
        if _is_block_list(module, min_children):
            blocks.extend(module.children())
            continue
        stack.extend(reversed(list(module.children())))
    return blocks
