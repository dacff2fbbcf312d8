"""convert(model, recipe): swap a model's linear layers for quantized ones, in place.

A pure module swap: parameters are shared (the same Parameter objects, so an optimizer built
before the swap still updates them), state_dict keys and shapes stay those of the original model,
and nothing else changes. `convert` returns the model, like torchao's
`convert_to_float8_training`; what it did is a `ConversionReport` on the model's
`minifloat_report` attribute (or returned with the model when `return_report=True`). Nothing is
kept in high precision silently: the report lists every layer or matrix parameter left alone with
the reason, and a call that converts no layer at all warns.

Rules:
- Swapped: `nn.Linear` -> `QuantLinear`, and the `Conv1D` of `transformers` (GPT-2's linear
  layers, weight stored transposed as [in, out]) -> `QuantConv1D`. Subclasses of either, and
  layers whose dims the recipe's GEMMs cannot take (e.g. not a multiple of 16, or of 128 for the
  blockwise recipe), are reported and kept.
- Output head (kept with `keep_head=True`, the default): a linear layer whose weight is the same
  Parameter as an embedding's (a tied head, e.g. GPT-2's `lm_head`, BERT's
  `cls.predictions.decoder`), whatever its name; or an `nn.Linear` whose last name part is in
  `HEAD_NAMES` (lm_head / output / head) and whose fully qualified name has no numeric part.
  Numeric parts are the indices of repeated blocks (`layers.3`, `h.0`), so `output` and `lm_head`
  are heads while `layers.0.attention.output` is a projection inside a block and is converted.
- Embeddings are never quantized (convert swaps linear layers only) and always reported.
- The last blocks: a recipe with `keep_last_blocks = k` (nvfp4: 2) keeps the linear layers of the
  model's last k repeated blocks in high precision (bf16 under autocast). A layer's block is its
  first numeric name part (`layers.7.attention.wq` is in block 7 of `layers`); the last k are the
  k largest indices of that container among the model's modules.
- Random state: layers of recipes that draw random numbers (stochastic rounding, Hadamard signs)
  get a salt from their name (crc32), so each layer draws its own numbers, the same in every run.
- Any other parameter of two or more dims stays in high precision and is reported by its own
  name: e.g. the fused expert weights [experts, out, in] of Mixtral and Qwen2-MoE, or a MoE
  router's weight, which their modules multiply in their own forward. convert cannot swap
  those without rewriting that forward.
- User rules, applied after the built-in ones (so they can only keep more layers): `skip`,
  fnmatch patterns on the fully qualified name of layers to keep (a pattern that matches no
  linear layer warns: a typo would otherwise quantize the layers it meant to keep);
  `size_rule`, a `SizeRule` keeping the layers too small for quantization to pay (size_rule.py;
  none by default); `module_filter_fn(module, fqn) -> bool`, torchao's contract: True = convert.
- The root module itself is never swapped: convert() replaces submodules of `model` in place and
  has no parent to put a replacement into, so a bare `nn.Linear` is refused with a ValueError
  (use `QuantLinear.from_linear(linear, recipe)` for that).
- A model is converted once. The report on the root module marks it (a plain attribute: not in
  the state_dict, kept by `copy.deepcopy`); convert() refuses a model, or a model with a
  submodule, that carries a report or holds quantized layers, even where the first conversion
  swapped nothing (e.g. "bf16", which only relies on autocast).

`set_recipe(model, recipe)` changes the recipe of a converted model's quantized layers in place
(e.g. the last phase of a run in bf16): no module is swapped, so parameters, optimizer state and
state_dict keys stay (bar the fp8-delayed amax history, which a layer holds exactly when its
recipe is delayed). The report keeps the recipe the model was converted with.
"""

from __future__ import annotations

import fnmatch
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, TypeVar, overload

from torch import nn

from minifloat import recipes
from minifloat.conv1d import QuantConv1D
from minifloat.kernels.select import BACKEND_NAMES
from minifloat.linear import QuantLinear
from minifloat.recipes import QuantRecipe, Recipe
from minifloat.size_rule import SizeRule

__all__ = [
    "convert",
    "ConversionReport",
    "AlreadyConvertedError",
    "HEAD_NAMES",
    "REPORT_ATTR",
    "check_recipe",
    "is_output_head",
    "set_recipe",
]

HEAD_NAMES = ("lm_head", "output", "head")

# The attribute of the root module that holds convert()'s report (and marks it as converted).
REPORT_ATTR = "minifloat_report"

ModuleT = TypeVar("ModuleT", bound=nn.Module)
ModuleFilter = Callable[[nn.Module, str], bool]
_QUANTIZED_LAYERS = (QuantLinear, QuantConv1D)


class AlreadyConvertedError(RuntimeError):
    """convert() was called on a model that was already converted (marked or holding
    quantized layers)."""


@dataclass
class ConversionReport:
    """What convert() did: converted layer names, and (name, reason) for everything kept in high
    precision (layers, embeddings, and matrix parameters outside linear layers)."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"convert(recipe={self.recipe}): {len(self.converted)} linear layers converted, "
            f"{len(self.skipped)} kept in high precision"
        ]
        lines += [f"  converted  {name}" for name in self.converted]
        lines += [f"  skipped    {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def is_output_head(fqn: str) -> bool:
    """Whether a linear layer named `fqn` is the model's output head by name (see the module
    docstring); convert() also finds a head tied to an embedding by its weight.

    A name inside a repeated block (any numeric part, as in `layers.0.attention.output`) is not.
    """
    if not isinstance(fqn, str):
        raise TypeError(f"is_output_head takes a module name (str), got {type(fqn).__name__}")
    parts = fqn.split(".")
    return parts[-1] in HEAD_NAMES and not any(part.isdigit() for part in parts)


def _conv1d_class() -> type | None:
    """`transformers.pytorch_utils.Conv1D` if that module is imported (any model holding a
    Conv1D has imported it), else None: minifloat never imports transformers itself."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _skip_patterns(skip: str | Iterable[str] | None) -> list[str]:
    """The fnmatch patterns of `skip`; a callable is refused (its meaning would be a guess)."""
    if skip is None:
        return []
    if callable(skip):
        raise TypeError(
            "skip takes fnmatch patterns on layer names (a string or a list of strings), not a "
            "callable; pass a predicate as module_filter_fn=lambda module, fqn: ... "
            "(True = convert, as in torchao)"
        )
    if not isinstance(skip, (str, Iterable)):
        raise TypeError(f"skip must be a pattern string or a list of them, got {skip!r}")
    patterns = [skip] if isinstance(skip, str) else list(skip)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"skip patterns must be strings, got {pattern!r}")
    return patterns


def _check_convertible(model: nn.Module, conv1d: type | None) -> None:
    """Refuse a model converted before, a sharded one, and a root module convert() would have
    to replace."""
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        # the swap would mix DTensor and plain parameters: a 21-frame error at the first forward
        raise ValueError("the model is already sharded (FSDP2): convert it before apply_fsdp")
    for name, module in model.named_modules():
        earlier = getattr(module, REPORT_ATTR, None)
        if isinstance(earlier, ConversionReport):
            where = "model" if not name else f"submodule {name!r}"
            raise AlreadyConvertedError(
                f"{where} was already converted with recipe {earlier.recipe!r}; "
                "convert a fresh copy of the original model instead"
            )
    done = [(name, m) for name, m in model.named_modules() if isinstance(m, _QUANTIZED_LAYERS)]
    if done:
        name, layer = done[0]
        raise AlreadyConvertedError(
            f"model is already converted ({len(done)} quantized layers, e.g. {name or '<root>'!r}"
            f" with recipe {layer.recipe.name!r}); convert a fresh copy of the original model "
            "instead"
        )
    if isinstance(model, nn.Linear):
        use = "QuantLinear.from_linear(linear, recipe)"
    elif conv1d is not None and isinstance(model, conv1d):
        use = "QuantConv1D.from_conv1d(conv1d, recipe)"
    else:
        return
    raise ValueError(
        f"convert() swaps submodules in place and cannot replace the root module itself; use {use}"
    )


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf


def _head_reason(fqn: str, module: nn.Module, tied: dict[int, str]) -> str | None:
    embedding = tied.get(id(module.weight))
    if embedding is not None:
        return f"output head, weight tied to embedding {embedding!r} (kept in high precision)"
    if isinstance(module, nn.Linear) and is_output_head(fqn):
        return "output head (kept in high precision)"
    return None


def _recipe_reason(recipe: Recipe, module: nn.Module, conv1d: type | None) -> str | None:
    if not isinstance(recipe, QuantRecipe):
        return f"recipe {recipe.name} does not quantize linear layers (autocast only)"
    base = nn.Linear if isinstance(module, nn.Linear) else conv1d
    if type(module) is not base:
        return f"subclass {type(module).__name__} of {base.__name__} is not converted"
    return recipe.unsuitable(*_features(module))


def _block_of(fqn: str) -> tuple[str, int] | None:
    """(container, index) of the repeated block holding `fqn` (its first numeric part)."""
    parts = fqn.split(".")
    i = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if i is None else (".".join(parts[:i]), int(parts[i]))


def _last_blocks(model: nn.Module, k: int) -> dict[str, set[int]]:
    """{container: the k largest block indices among the model's modules} (k = 0: {})."""
    if k <= 0:
        return {}
    found: dict[str, set[int]] = {}
    for fqn, _ in model.named_modules():
        block = _block_of(fqn)
        if block is not None:
            found.setdefault(block[0], set()).add(block[1])
    return {c: set(sorted(indices)[-k:]) for c, indices in found.items()}


def _last_block_reason(fqn: str, recipe: Recipe, last: dict[str, set[int]]) -> str | None:
    block = _block_of(fqn)
    if block is None or block[1] not in last.get(block[0], ()):
        return None
    k = recipe.keep_last_blocks
    return f"in the last {k} blocks (recipe {recipe.name} keeps them in high precision)"


def _filter_reason(
    module_filter_fn: ModuleFilter | None, module: nn.Module, fqn: str
) -> str | None:
    if module_filter_fn is None:
        return None
    keep = module_filter_fn(module, fqn)
    if not isinstance(keep, bool):
        raise TypeError(
            f"module_filter_fn(module, fqn) must return a bool (True = convert), got {keep!r} "
            f"for {fqn!r}"
        )
    return None if keep else "module_filter_fn returned False"


def _plain_parameters(model: nn.Module, covered: set[int]) -> list[tuple[str, str]]:
    """(name, reason) for every parameter of 2+ dims outside the layers convert() looked at."""
    found = []
    for fqn, param in model.named_parameters():
        if param.dim() < 2 or id(param) in covered:
            continue
        owner = type(model.get_submodule(fqn.rpartition(".")[0])).__name__
        what = f"{param.dim()}-D parameter {list(param.shape)} of {owner}"
        if param.dim() == 3:
            what += " (a stack of matrices, e.g. fused MoE expert weights)"
        found.append(
            (
                fqn,
                f"{what}: a plain parameter, not in an nn.Linear or Conv1D layer (the only "
                "layers convert swaps), kept in high precision",
            )
        )
    return found


def _warn_nothing_converted(recipe: Recipe, report: ConversionReport, layers: list[str]) -> None:
    if not isinstance(recipe, QuantRecipe):
        why = "the recipe does not quantize linear layers (its precision comes from autocast)"
    elif not layers:
        why = "the model has no nn.Linear or Conv1D layer"
    else:
        first, reason = next((n, r) for n, r in report.skipped if n in layers)
        why = f"all {len(layers)} linear layers were kept, e.g. {first!r}: {reason}"
    warnings.warn(
        f"convert(recipe={recipe.name!r}) converted no layer: {why} (see the model's "
        f"{REPORT_ATTR})",
        UserWarning,
        stacklevel=3,
    )


def _warn_unmatched_patterns(patterns: list[str], layers: list[str]) -> None:
    """A skip pattern that matches no linear layer is almost always a typo ("layer.0.*" for
    "layers.0.*"), and the layers it meant to keep would be quantized without a word."""
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in layers)]
    if unmatched and layers:
        warnings.warn(
            f"convert: skip pattern(s) {unmatched} matched no linear layer (layer names look "
            f"like {layers[0]!r})",
            UserWarning,
            stacklevel=3,
        )


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@overload
def convert(
    model: ModuleT,
    recipe: str | Recipe,
    *,
    skip: str | Iterable[str] | None = None,
    module_filter_fn: ModuleFilter | None = None,
    size_rule: SizeRule | None = None,
    keep_head: bool = True,
    backend: str = "auto",
    return_report: Literal[False] = False,
) -> ModuleT: ...


@overload
def convert(
    model: ModuleT,
    recipe: str | Recipe,
    *,
    skip: str | Iterable[str] | None = None,
    module_filter_fn: ModuleFilter | None = None,
    size_rule: SizeRule | None = None,
    keep_head: bool = True,
    backend: str = "auto",
    return_report: Literal[True],
) -> tuple[ModuleT, ConversionReport]: ...


def convert(
    model: ModuleT,
    recipe: str | Recipe,
    *,
    skip: str | Iterable[str] | None = None,
    module_filter_fn: ModuleFilter | None = None,
    size_rule: SizeRule | None = None,
    keep_head: bool = True,
    backend: str = "auto",
    return_report: bool = False,
) -> ModuleT | tuple[ModuleT, ConversionReport]:
    """Swap the linear layers of `model` for quantized ones under `recipe`, in place.

    Args:
        model: any module; it is modified in place and returned. Quantized layers share its
            parameters.
        recipe: a Recipe or a name. Recipes that do not quantize (fp32, fp16, bf16) convert
            nothing: their precision comes from autocast in the training loop.
        skip: layers to keep in high precision, as fnmatch patterns on the fully qualified name
            (a string or a list of strings), e.g. "layers.0.*". A callable is refused: pass a
            predicate as `module_filter_fn`.
        module_filter_fn: `(module, fqn) -> bool`, torchao's contract: True = convert, False =
            keep. Called for each linear layer the built-in rules and `skip` would convert; it
            must return a bool.
        size_rule: keep the layers whose (in_features, out_features) the `SizeRule` names too
            small for quantization to pay (e.g. `minifloat.TORCHAO_TENSORWISE`); None: no rule.
        keep_head: keep the output head (tied to an embedding, or named lm_head / output / head
            outside repeated blocks, see `is_output_head`) in high precision (the default, as
            all the recipes prescribe). Embeddings are never quantized.
        backend: the quantized layers' backend: "auto", "emulated" or "hopper".
        return_report: also return the report: `(model, report)`.
    Returns:
        `model`; the ConversionReport (converted layers, and (name, reason) for everything kept)
        is `model.minifloat_report` either way.
    Warns:
        UserWarning: no layer was converted (the message says why).
    Raises:
        AlreadyConvertedError: convert() already ran on the model (or on one of its submodules),
            whatever it swapped, or the model holds quantized layers.
        ValueError: unknown recipe or backend, or `model` is itself a linear layer.
        TypeError: `model` is not an nn.Module, `skip` is not patterns, `module_filter_fn` is
            not a callable returning bool, `size_rule` is not a SizeRule, or `keep_head` or
            `return_report` is not a bool.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert takes an nn.Module, got {type(model).__name__}")
    recipe = recipes.get(recipe)
    patterns = _checked_arguments(backend, skip, module_filter_fn, size_rule, keep_head)
    if not isinstance(return_report, bool):  # a non-empty string would count as True
        raise TypeError(f"return_report must be True or False, got {return_report!r}")
    conv1d = _conv1d_class()
    _check_convertible(model, conv1d)
    report = ConversionReport(recipe=recipe.name)
    layers, targets = _plan(
        model, recipe, report, conv1d=conv1d, patterns=patterns, keep_head=keep_head,
        size_rule=size_rule, module_filter_fn=module_filter_fn,
    )  # fmt: skip
    _warn_unmatched_patterns(patterns, layers)
    # Every place a layer object is used (named_modules lists a module reused under a second
    # name once): each gets the same quantized layer, not only the first name.
    places: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        places.setdefault(id(m), []).append(name)
    for fqn, module in targets:  # swap after the walk: never mutate while iterating
        if isinstance(module, nn.Linear):
            new = QuantLinear.from_linear(module, recipe, backend=backend)
        else:
            new = QuantConv1D.from_conv1d(module, recipe, backend=backend)
        new.seed_rng(zlib.crc32(fqn.encode()) & 0x7FFFFFFF)
        for name in places[id(module)]:
            _set_submodule(model, name, new)
        report.converted.append(fqn)
        report.converted += [name for name in places[id(module)] if name != fqn]
    # A plain attribute (Module.__setattr__ keeps non-tensor values in __dict__): outside the
    # state_dict, copied by deepcopy and pickling.
    setattr(model, REPORT_ATTR, report)
    if not report.converted:
        _warn_nothing_converted(recipe, report, layers)
    return (model, report) if return_report else model


def _checked_arguments(
    backend: str,
    skip: str | Iterable[str] | None,
    module_filter_fn: ModuleFilter | None,
    size_rule: SizeRule | None,
    keep_head: bool,
) -> list[str]:
    """convert()'s options checked (one-line errors, before anything changes); the skip
    patterns as a list."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKEND_NAMES)}")
    patterns = _skip_patterns(skip)
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            f"module_filter_fn must be a callable (module, fqn) -> bool, got {module_filter_fn!r}"
        )
    if size_rule is not None and not isinstance(size_rule, SizeRule):
        raise TypeError(f"size_rule must be a minifloat.SizeRule or None, got {size_rule!r}")
    if not isinstance(keep_head, bool):  # a non-empty string would count as True
        raise TypeError(f"keep_head must be True or False, got {keep_head!r}")
    return patterns


def _plan(
    model: nn.Module,
    recipe: Recipe,
    report: ConversionReport,
    *,
    conv1d: type | None,
    patterns: list[str],
    keep_head: bool,
    size_rule: SizeRule | None,
    module_filter_fn: ModuleFilter | None,
) -> tuple[list[str], list[tuple[str, nn.Module]]]:
    """Walk `model` once: (every linear layer's name, the (name, layer) pairs to convert).

    Each layer kept gets its reason in `report.skipped`, the first rule that keeps it in this
    order: output head, skip pattern, recipe, last blocks, size rule, module_filter_fn.
    Embeddings and parameters outside any linear or embedding are reported too.
    """
    layer_types = (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)
    embedding_types = (nn.Embedding, nn.EmbeddingBag)
    tied = {
        id(m.weight): name for name, m in model.named_modules() if isinstance(m, embedding_types)
    }
    last = _last_blocks(model, getattr(recipe, "keep_last_blocks", 0))
    covered: set[int] = set()  # parameters of the modules looked at below
    layers: list[str] = []
    targets: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, layer_types + embedding_types):
            continue
        covered.update(id(p) for p in module.parameters(recurse=False))
        if isinstance(module, embedding_types):
            report.skipped.append((fqn, "embedding (kept in high precision)"))
            continue
        layers.append(fqn)
        reason = _head_reason(fqn, module, tied) if keep_head else None
        if reason is None:
            matched = next((p for p in patterns if fnmatch.fnmatchcase(fqn, p)), None)
            reason = None if matched is None else f"matched skip pattern {matched!r}"
        reason = reason or _recipe_reason(recipe, module, conv1d)
        reason = reason or _last_block_reason(fqn, recipe, last)
        if reason is None and size_rule is not None:
            reason = size_rule.reason(*_features(module))
        reason = reason or _filter_reason(module_filter_fn, module, fqn)
        if reason is None:
            targets.append((fqn, module))
        else:
            report.skipped.append((fqn, reason))
    report.skipped += _plain_parameters(model, covered)
    return layers, targets


def check_recipe(model: nn.Module, recipe: str | Recipe) -> None:
    """Raise ValueError, naming the first, when a quantized layer of `model` cannot take
    `recipe` (its dims; see `QuantRecipe.unsuitable`), or when `recipe` keeps other blocks in
    high precision than the recipe the model was converted with (`keep_last_blocks`: a switch
    cannot change which layers are quantized); change nothing. `set_recipe` checks this itself:
    call it alone to fail early, before a change planned for later."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    recipe = recipes.get(recipe)
    if not isinstance(recipe, QuantRecipe):
        return
    report = getattr(model, REPORT_ATTR, None)
    converted = recipes.get(report.recipe) if isinstance(report, ConversionReport) else None
    kept = getattr(converted, "keep_last_blocks", 0)
    if converted is not None and converted.quantized and kept != recipe.keep_last_blocks:
        raise ValueError(
            f"recipe {recipe.name} keeps the last {recipe.keep_last_blocks} blocks in high "
            f"precision, the model was converted with {converted.name} (keeps {kept}): a "
            f"switch cannot change which layers are quantized; convert a fresh model with "
            f"{recipe.name}"
        )
    for name, layer in model.named_modules():
        if isinstance(layer, _QUANTIZED_LAYERS):
            reason = recipe.unsuitable(layer.in_features, layer.out_features)
            if reason is not None:
                raise ValueError(f"layer {name!r} cannot take recipe {recipe.name}: {reason}")


def set_recipe(model: nn.Module, recipe: str | Recipe) -> list[str]:
    """Change the recipe of every quantized layer of `model` in place; return their names.

    The layers stay the same modules with the same Parameter objects, so an optimizer and its
    state carry on. To a recipe that quantizes nothing ("bf16", "fp32") the layers compute as
    the plain layers do (`F.linear`, Conv1D's `addmm`) under the caller's autocast, i.e. as a
    model never converted would. Layers convert() kept in high precision are not touched. A
    compiled model picks the change up at its next call: each layer's recipe is an attribute
    its forward reads, which torch.compile guards on (a recompile, not a stale graph). The
    layers' buffers follow the recipe (QuantLinear.set_recipe): switching to fp8-delayed adds
    `amax_history` keys to the state_dict, to a recipe that draws random numbers (stochastic
    rounding, random Hadamard signs) `rng_state` keys, and switching away drops them.

    Raises:
        ValueError: unknown recipe, or a layer whose dims the recipe cannot take (checked for
            every layer before any changes, so the model is left as it was).
    Warns:
        UserWarning: the model holds no quantized layer (never converted, or convert kept
            every layer), so nothing changes.
    """
    check_recipe(model, recipe)  # the model's type and the recipe first: one-line errors
    recipe = recipes.get(recipe)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, _QUANTIZED_LAYERS)]
    if not layers:
        report = getattr(model, REPORT_ATTR, None)
        advice = (
            "convert it first; a recipe switch acts on the layers convert() swapped"
            if not isinstance(report, ConversionReport)
            else f"it was converted with {report.recipe!r}, which swapped none: convert a fresh "
            "copy with a quantized recipe, then set_recipe(model, 'bf16') to start in bf16"
        )
        warnings.warn(
            f"set_recipe({recipe.name!r}) changed nothing: the model holds no quantized layer "
            f"({advice})",
            stacklevel=2,
        )
    for _, layer in layers:
        layer.set_recipe(recipe)
    return [name for name, _ in layers]
