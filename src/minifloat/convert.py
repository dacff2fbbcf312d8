"""convert(model, recipe): swap a model's eligible nn.Linear layers for QuantLinear, in place.

A pure module swap: parameters are shared (the same Parameter objects, so an optimizer built
before the swap still updates them), state_dict keys stay those of the original model, and nothing
else changes. Layers that stay in high precision are listed with the reason, never silently:
the output head and embeddings by default, layers matched by `skip`, and layers whose dims the
recipe's GEMMs cannot take (e.g. not a multiple of 16, or of 128 for the blockwise recipe).

Rules:
- Output head: an `nn.Linear` whose last name part is in `HEAD_NAMES` (lm_head / output / head)
  and whose fully qualified name has no numeric part. Numeric parts are the indices of repeated
  blocks (`layers.3`, `h.0`), so `output` and `lm_head` are heads while `layers.0.attention.output`
  is an ordinary projection inside a block and is converted.
- The root module itself is never swapped: convert() replaces submodules of `model` in place and
  has no parent to put a replacement into, so a bare `nn.Linear` is refused with a ValueError
  (use `QuantLinear.from_linear(linear, recipe)` for that).
- A model is converted once. convert() marks the root module with the recipe's name (a plain
  attribute: not in the state_dict, kept by `copy.deepcopy`), and refuses a model that carries
  the mark or holds QuantLinear layers, even where the first conversion swapped nothing (e.g.
  "bf16", which only relies on autocast).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from minifloat import recipes
from minifloat.kernels.select import BACKEND_NAMES
from minifloat.linear import QuantLinear
from minifloat.recipes import QuantRecipe, Recipe

__all__ = ["convert", "ConversionReport", "AlreadyConvertedError", "HEAD_NAMES", "is_output_head"]

HEAD_NAMES = ("lm_head", "output", "head")

# The attribute convert() sets on the root module: the name of the recipe it converted under.
_MARK = "_minifloat_converted_recipe"

SkipRule = Callable[[str, nn.Module], bool] | str | Iterable[str] | None


class AlreadyConvertedError(RuntimeError):
    """convert() was called on a model that was already converted (marked or holding
    QuantLinear layers)."""


@dataclass
class ConversionReport:
    """What convert() did: converted layer names and skipped (name, reason) pairs."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"convert(recipe={self.recipe}): {len(self.converted)} linear layers converted, "
            f"{len(self.skipped)} modules kept in high precision"
        ]
        lines += [f"  converted  {name}" for name in self.converted]
        lines += [f"  skipped    {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _skip_predicate(skip: SkipRule) -> Callable[[str, nn.Module], bool]:
    if skip is None:
        return lambda fqn, module: False
    if callable(skip):
        return skip
    patterns = [skip] if isinstance(skip, str) else list(skip)
    return lambda fqn, module: any(fnmatch.fnmatchcase(fqn, p) for p in patterns)


def is_output_head(fqn: str) -> bool:
    """Whether a linear layer named `fqn` is the model's output head (see the module docstring).

    A name inside a repeated block (any numeric part, as in `layers.0.attention.output`) is not.
    """
    parts = fqn.split(".")
    return parts[-1] in HEAD_NAMES and not any(part.isdigit() for part in parts)


def _default_reason(fqn: str, module: nn.Module) -> str | None:
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return "embedding (kept in high precision)"
    if isinstance(module, nn.Linear) and is_output_head(fqn):
        return "output head (kept in high precision)"
    return None


def _check_convertible(model: nn.Module) -> None:
    """Refuse a model converted before, and a root module convert() would have to replace."""
    marked = [(name, getattr(m, _MARK)) for name, m in model.named_modules() if hasattr(m, _MARK)]
    if marked:
        name, earlier = marked[0]
        where = "model" if not name else f"submodule {name!r}"
        raise AlreadyConvertedError(
            f"{where} was already converted with recipe {earlier!r}; "
            "convert a fresh copy of the original model instead"
        )
    done = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    if done:
        name, layer = done[0]
        raise AlreadyConvertedError(
            f"model is already converted ({len(done)} QuantLinear layers, e.g. {name or '<root>'!r}"
            f" with recipe {layer.recipe.name!r}); convert a fresh copy of the original model "
            "instead"
        )
    if isinstance(model, nn.Linear):
        raise ValueError(
            "convert() swaps submodules in place and cannot replace the root module itself; "
            "use QuantLinear.from_linear(linear, recipe)"
        )


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def convert(
    model: nn.Module,
    recipe: str | Recipe,
    *,
    skip: SkipRule = None,
    keep_head: bool = True,
    backend: str = "auto",
) -> ConversionReport:
    """Swap eligible `nn.Linear` modules of `model` for `QuantLinear` under `recipe`, in place.

    Args:
        model: any module; it is modified in place (and returned layers share its parameters).
        recipe: a Recipe or a name. Recipes that do not quantize (fp32, fp16, bf16) convert
            nothing: their precision comes from autocast in the training loop.
        skip: extra layers to keep: a callable (fqn, module) -> bool, or fnmatch patterns on the
            fully qualified name (a string or a list), e.g. "layers.0.*".
        keep_head: keep the output head (lm_head / output / head outside repeated blocks, see
            `is_output_head`) and embeddings in high precision (the default, as all the recipes
            prescribe).
        backend: the QuantLinear backend: "auto", "emulated" or "hopper".
    Raises:
        AlreadyConvertedError: convert() already ran on the model (or on one of its submodules),
            whatever it swapped, or the model holds QuantLinear layers.
        ValueError: unknown recipe or backend, or `model` is itself an `nn.Linear`.
    """
    recipe = recipes.get(recipe)
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKEND_NAMES)}")
    _check_convertible(model)
    report = ConversionReport(recipe=recipe.name)
    user_skip = _skip_predicate(skip)
    targets: list[tuple[str, nn.Linear]] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear | nn.Embedding | nn.EmbeddingBag):
            continue
        reason = _default_reason(fqn, module) if keep_head else None
        if reason is None and user_skip(fqn, module):
            reason = "matched skip"
        if reason is None and isinstance(module, nn.Linear):
            reason = _recipe_reason(recipe, module)
        if reason is None and isinstance(module, nn.Linear):
            targets.append((fqn, module))
        elif reason is not None:
            report.skipped.append((fqn, reason))
    for fqn, module in targets:  # swap after the walk: never mutate while iterating
        _set_submodule(model, fqn, QuantLinear.from_linear(module, recipe, backend=backend))
        report.converted.append(fqn)
    # A plain attribute (Module.__setattr__ keeps non-tensor values in __dict__): outside the
    # state_dict, copied by deepcopy and pickling.
    setattr(model, _MARK, recipe.name)
    return report


def _recipe_reason(recipe: Recipe, module: nn.Linear) -> str | None:
    if not isinstance(recipe, QuantRecipe):
        return f"recipe {recipe.name} does not quantize linear layers (autocast only)"
    if type(module) is not nn.Linear:
        return f"subclass {type(module).__name__} of nn.Linear is not converted"
    return recipe.unsuitable(module.in_features, module.out_features)
