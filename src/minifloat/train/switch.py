"""The final-phase precision switch: a run that changes recipe in place after a given step.

``TrainConfig(recipe="fp4", switch_recipe="bf16", switch_at=0.9)`` trains the first 90 % of its
steps under fp4 and the rest under bf16 (NVIDIA's NVFP4 study switches to BF16 for the decay
phase). At the switch the quantized layers change recipe in place (:func:`minifloat.convert.
set_recipe`): same modules, same Parameter objects, same optimizer state, so the run goes on
seamlessly; to an autocast-only recipe (bf16) they compute exactly as the unconverted model does.

``switch_at`` is a fraction in (0, 1) of the run's steps or a whole step number (>= 1): the run
takes ``S = floor(switch_at × total_steps)`` steps (``S = switch_at`` for a step number) under
its recipe and the steps after S under the switch recipe. A run whose recipe quantizes nothing
(bf16) but whose switch recipe does (fp4) is converted with the switch recipe and set to its own
recipe until the switch. Both recipes must agree on fp16 loss scaling (a switch keeps the loss
scaler as it is).

A run with a switch is named ``RECIPE+switch=SWITCH+at=F`` (:func:`run_name`), e.g.
``fp4+switch=bf16+at=0.9``: the name ``minifloat compare --recipes`` accepts for it, its
directory there and the ``recipe`` of its :class:`~minifloat.train.result.TrainResult`. It uses
only the characters of recipe names (letters, digits, ``. _ + = : -``), so it is a safe directory
name; ``+switch=`` and ``+at=`` cannot occur inside a valid recipe name, so it parses unambiguously
(the switch recipe may be a variant such as ``fp4:dge.k=5``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from torch import nn

from minifloat import recipes
from minifloat.errors import first_line
from minifloat.recipes import Recipe
from minifloat.train.errors import ConfigError

if TYPE_CHECKING:
    from minifloat.train.config import TrainConfig

__all__ = [
    "RecipeSwitch",
    "check_switch_at",
    "check_switch_names",
    "parse_run_name",
    "recipe_switch",
    "run_name",
    "step_at",
    "switch_step",
]

_SWITCH, _AT = "+switch=", "+at="


def _format_at(switch_at: float) -> str:
    """``0.9`` or ``8240`` (a step number without its ``.0``), exactly as given otherwise."""
    value = float(switch_at)
    return str(int(value)) if value.is_integer() else repr(value)


def run_name(recipe: str, switch_recipe: str | None, switch_at: float | None) -> str:
    """The run's name: ``recipe``, or ``RECIPE+switch=SWITCH+at=F`` for a run with a switch."""
    if switch_recipe is None or switch_at is None:
        return recipe
    return f"{recipe}{_SWITCH}{switch_recipe}{_AT}{_format_at(switch_at)}"


def parse_run_name(name: str) -> dict[str, Any]:
    """``{"recipe", "switch_recipe", "switch_at"}`` of a run name (:func:`run_name`'s form);
    the switch fields are None for a plain recipe name. Raises :class:`ConfigError`."""
    recipe, sep, rest = name.partition(_SWITCH)
    if not sep:
        return {"recipe": name, "switch_recipe": None, "switch_at": None}
    switch, sep, at = rest.rpartition(_AT)
    if not sep or not recipe or not switch:
        raise ConfigError(
            f"run {name!r}: expected RECIPE+switch=SWITCH_RECIPE+at=F, e.g. fp4+switch=bf16+at=0.9"
        )
    try:
        value = float(at)
    except ValueError:
        raise ConfigError(f"run {name!r}: switch-at must be a number, got {at!r}") from None
    return {"recipe": recipe, "switch_recipe": switch, "switch_at": value}


def check_switch_at(switch_at: float, *, name: str = "switch-at") -> None:
    """Raise :class:`ConfigError` unless ``switch_at`` is a fraction in (0, 1) or a whole step
    number >= 1 (``name``: the setting, for another that counts steps the same way)."""
    number = isinstance(switch_at, int | float) and not isinstance(switch_at, bool)
    value = float(switch_at) if number else math.nan
    if not (math.isfinite(value) and value > 0 and (value < 1 or value.is_integer())):
        raise ConfigError(
            f"{name} must be a fraction in (0, 1) of the steps or a whole step number >= 1, "
            f"got {switch_at!r}"
        )


def step_at(point: float, total_steps: int) -> int:
    """The step that ``point`` names: ``floor(point × total_steps)`` for a fraction (of the
    decimal value as written: 0.29 × 100 is 29), ``point`` itself for a step number."""
    value = float(point)
    return math.floor(Fraction(repr(value)) * total_steps) if value < 1 else int(value)


def switch_step(switch_at: float, total_steps: int) -> int:
    """Steps trained before the switch (:func:`step_at`). Raises :class:`ConfigError` unless
    at least one step comes before and after it."""
    check_switch_at(switch_at)
    value = float(switch_at)
    step = step_at(value, total_steps)
    if step < 1:
        raise ConfigError(
            f"switch-at {_format_at(value)} of {total_steps} steps leaves no step before the "
            "switch; give a later switch-at"
        )
    if step >= total_steps:
        raise ConfigError(
            f"switch-at step {step} is not before the last step ({total_steps} steps): the "
            "switch would never happen"
        )
    return step


def numerics_key(recipe: Recipe) -> Recipe:
    """`recipe` without its name and description: equal keys compute the same numbers."""
    return dataclasses.replace(recipe, name="", description="")


def check_switch_names(config: TrainConfig) -> None:
    """Fail fast on a switch recipe that is unknown, computes as the run's recipe, or differs
    from it in fp16 loss scaling; and on a run name given as ``recipe`` (a compare form)."""
    if _SWITCH in config.recipe:
        parts = parse_run_name(config.recipe)
        raise ConfigError(
            f"recipe {config.recipe!r} is a run name of `minifloat compare`; to train it give "
            f"--recipe {parts['recipe']} --switch-recipe {parts['switch_recipe']} --switch-at "
            f"{_format_at(parts['switch_at'])}"
        )
    if config.switch_recipe is None:
        return
    before = recipes.get(config.recipe)
    try:
        after = recipes.get(config.switch_recipe)
    except ValueError as exc:
        raise ConfigError(f"switch-recipe: {first_line(exc)}") from None
    if numerics_key(before) == numerics_key(after):
        raise ConfigError(
            f"switch-recipe {after.name} computes exactly as recipe {before.name}: the switch "
            "would change nothing"
        )
    if before.loss_scaling != after.loss_scaling:
        raise ConfigError(
            f"recipe {before.name} and switch-recipe {after.name} differ in fp16 loss scaling, "
            "which a switch cannot turn on or off mid-run"
        )


@dataclass(frozen=True, kw_only=True)
class RecipeSwitch:
    """A run's switch: ``step`` steps under ``before``, the steps after them under ``after``."""

    before: Recipe
    after: Recipe
    step: int

    @property
    def convert_recipe(self) -> Recipe:
        """The recipe to convert the model with: the first of the two that quantizes (the
        model then holds quantized layers for either phase), else ``before``."""
        return self.after if self.after.quantized and not self.before.quantized else self.before

    def recipe_after(self, steps_done: int) -> Recipe:
        """The recipe of the step that follows ``steps_done`` steps."""
        return self.after if steps_done >= self.step else self.before

    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`ConfigError` now, not at the switch, when a quantized layer of
        ``model`` cannot take ``after``; the model is not changed."""
        from minifloat.convert import check_recipe

        try:
            check_recipe(model, self.after)
        except ValueError as exc:
            raise ConfigError(f"switch-recipe {self.after.name}: {first_line(exc)}") from None


def recipe_switch(config: TrainConfig, total_steps: int) -> RecipeSwitch | None:
    """The switch ``config`` asks for over a run of ``total_steps`` steps (None: no switch)."""
    if config.switch_recipe is None or config.switch_at is None:
        return None
    return RecipeSwitch(
        before=recipes.get(config.recipe),
        after=recipes.get(config.switch_recipe),
        step=switch_step(config.switch_at, total_steps),
    )
