"""The `BASE:KEY=VALUE[:KEY=VALUE...]` variant keys of the quantized recipes: parsing and range
checks of each value, and the variant built from the base recipe with `dataclasses.replace`.

`recipes.get("fp4:dge.k=3")` looks the base up and calls `build` here; the keys and what they
take are `VARIANT_KEYS` (re-exported by recipes.py). The micro-block recipes' own keys
(`sr`, `rht`, `rht.size`, `block`, `keep_last`) are applied by microblock_variants.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING

from minifloat import microblock_variants
from minifloat.recipe_specs import (
    OCC_COMPENSATION_FORMATS,
    OCC_THRESHOLDS,
    DGEConfig,
    OCCConfig,
    OperandSpec,
)

if TYPE_CHECKING:
    from minifloat.recipes import QuantRecipe

__all__ = ["VARIANT_KEYS", "build"]

# ':' separates the overrides because ',' separates recipes in `compare --recipes`; the whole
# string names the run directory, so only these characters are allowed (no '/', no spaces).
_NAME_CHARS = re.compile(r"[A-Za-z0-9._+=:-]+")
_ON, _OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
_SCALINGS = ("row", "tensor")
_OWN_SCALE_FORMATS = ("fp32", "pow2", "inv")  # scales from the operand's own maxima
_MAX_BLOCK = 2**16  # the longest micro-block (`block`), past any layer's width

VARIANT_KEYS: dict[str, str] = {
    "dge": "on|off: the DGE weight-gradient correction (on: k=5, cap=3)",
    "dge.k": "DGE sharpness k >= 1 (turns DGE on)",
    "dge.cap": "DGE derivative cap > 0 (turns DGE on)",
    "occ": "on|off: outlier clamping + compensation (on: alpha=0.99, sampled, e4m3)",
    "occ.alpha": "OCC clamp quantile alpha in (0.5, 1) (turns OCC on)",
    "occ.compensate": "on|off: add the clipped remainder back through a second GEMM",
    "occ.threshold": "exact|sampled quantiles",
    "occ.compensation_format": "e4m3|fp32: precision of the compensation (fp32: reference)",
    "occ.sample_size": "entries of the strided threshold sample, an integer >= 1024",
    "occ.one_gemm": "on|off: fprop's two compensated products as one GEMM over 2K (default on)",
    "scaling": "row|tensor: scale granularity of both input and weight, in every GEMM",
    "scaling.input": "row|tensor: scale granularity of the input x (per token or per tensor)",
    "scaling.weight": "row|tensor: scale granularity of the weight w (per channel or per tensor)",
    "scaling.grad_output": "row|tensor: scale granularity of the output gradient dy",
    "scale_format": (
        "fp32|pow2|inv: scales amax / max; the least power of two above (tensor, row); or "
        "values x * (max / amax), scales its reciprocal (torchao's form; tensor, row, blocks)"
    ),
    "fast_accum": "on|off: fprop GEMM with fast accumulation on FP8 tensor cores (default on)",
    "bwd_fast_accum": "on|off: dgrad and wgrad GEMMs with fast accumulation",
    # `recipes.variant_help` adds the recipes whose default is on, read from the registry
    "dgrad_fast_accum": "on|off: dgrad's GEMM with fast accumulation",
    "wgrad_fast_accum": "on|off: wgrad's GEMM with fast accumulation",
    "sr": "on|off: stochastic rounding of the gradient dy (micro-block recipes: nvfp4, mxfp4)",
    "rht": "on|off: random Hadamard transform on both wgrad operands, size = block (nvfp4, mxfp4)",
    "rht.size": (
        "power of two: size of the wgrad random Hadamard transform (turns it on); above the "
        "block, at most a step's tokens rounded up to a power of two"
    ),
    "block": (
        f"power of two in [2, {_MAX_BLOCK}]: micro-block length along the contraction dim "
        "(square weights NxN)"
    ),
    "keep_last": "integer >= 0: the model's last N blocks' linear layers stay in bf16 (convert)",
}


def _number(key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return number


def _integer(key: str, value: str, *, power_of_two: bool = False, most: int | None = None) -> int:
    """`value` as a decimal integer >= 0 (`power_of_two`: a power of two >= 2), at most `most`."""
    n = int(value) if value.isdigit() else -1
    if n < 0 or (power_of_two and (n < 2 or n & (n - 1))) or (most is not None and n > most):
        kind = "a power of two >= 2" if power_of_two else "a non-negative integer"
        if most is not None:
            kind += f" and at most {most}"
        raise ValueError(f"{key} must be {kind}, got {value!r}")
    return n


def _switch(key: str, value: str) -> bool:
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{key} must be one of {'|'.join(_ON + _OFF)}, got {value!r}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{key} must be one of {'|'.join(choices)}, got {value!r}")
    return value


def _set_granularity(r: QuantRecipe, operand: str, g: str) -> QuantRecipe:
    """`operand` ("input", "weight", "grad_output") at granularity g in every GEMM it enters.

    Reused backward operands keep the fprop values (and their scale), so only the GEMMs that
    quantize the tensor themselves change.
    """
    rep = dataclasses.replace
    if operand == "input":
        wgrad = r.wgrad if r.wgrad.rhs.reuse else rep(r.wgrad, rhs=rep(r.wgrad.rhs, granularity=g))
        return rep(r, fprop=rep(r.fprop, lhs=rep(r.fprop.lhs, granularity=g)), wgrad=wgrad)
    if operand == "weight":
        dgrad = r.dgrad if r.dgrad.rhs.reuse else rep(r.dgrad, rhs=rep(r.dgrad.rhs, granularity=g))
        return rep(r, fprop=rep(r.fprop, rhs=rep(r.fprop.rhs, granularity=g)), dgrad=dgrad)
    return rep(
        r,
        dgrad=rep(r.dgrad, lhs=rep(r.dgrad.lhs, granularity=g)),
        wgrad=rep(r.wgrad, lhs=rep(r.wgrad.lhs, granularity=g)),
    )


def _set_scale_format(r: QuantRecipe, scale_format: str) -> QuantRecipe:
    """Every operand a GEMM quantizes itself (not reused) with `scale_format` scales; only
    recipes whose scales come from the operand's own maxima: tensor- and row-scaled ones, and
    for "inv" block-scaled ones too (not the micro-block recipes' e4m3/e8m0 scales)."""
    gemms = {g: getattr(r, g) for g in ("fprop", "dgrad", "wgrad")}
    own = [s for gemm in gemms.values() for s in (gemm.lhs, gemm.rhs) if not s.reuse]
    if r.delayed is not None:
        raise ValueError(f"scale_format: {r.name}'s scales come from its amax history")
    groups = ("tensor", "row") if scale_format == "pow2" else ("tensor", "row", "block")
    if any(s.scale_format not in _OWN_SCALE_FORMATS
           or (s.granularity if isinstance(s.granularity, str) else "block") not in groups
           for s in own):  # fmt: skip
        kinds = "tensor- and row-" if scale_format == "pow2" else "tensor-, row- and block-"
        raise ValueError(
            f"scale_format={scale_format} applies to {kinds}scaled recipes, not {r.name}"
        )

    def with_format(s: OperandSpec) -> OperandSpec:
        return s if s.reuse else dataclasses.replace(s, scale_format=scale_format)

    return dataclasses.replace(r, **{
        g: dataclasses.replace(gemm, lhs=with_format(gemm.lhs), rhs=with_format(gemm.rhs))
        for g, gemm in gemms.items()
    })  # fmt: skip


def _apply(r: QuantRecipe, key: str, value: str) -> QuantRecipe:
    """One override; range checks are those of DGEConfig / OCCConfig / QuantRecipe."""
    rep = dataclasses.replace
    if key == "dge":
        return rep(r, dge=(r.dge or DGEConfig()) if _switch(key, value) else None)
    if key == "fast_accum":
        return rep(r, fprop_fast_accum=_switch(key, value))
    if key == "bwd_fast_accum":
        on = _switch(key, value)
        return rep(r, dgrad_fast_accum=on, wgrad_fast_accum=on)
    if key in ("dgrad_fast_accum", "wgrad_fast_accum"):
        return rep(r, **{key: _switch(key, value)})
    if key == "scale_format":
        return _set_scale_format(r, _choice(key, value, _OWN_SCALE_FORMATS))
    if key == "occ":
        on = _switch(key, value)
        return rep(r, occ=(r.occ or OCCConfig()) if on else None)
    if key in ("sr", "rht"):
        return microblock_variants.apply(r, key, _switch(key, value))
    if key in ("rht.size", "block", "keep_last"):
        pow2 = key != "keep_last"
        # a block pads every operand's contraction dim to its multiple: bounded here rather than
        # by the allocator (block=2**40 asked a 64-wide layer for 32 TiB)
        most = _MAX_BLOCK if key == "block" else None
        return microblock_variants.apply(r, key, _integer(key, value, power_of_two=pow2, most=most))
    group, _, field = key.partition(".")
    if group == "dge":
        return rep(r, dge=rep(r.dge or DGEConfig(), **{field: _number(key, value)}))
    if group == "occ":
        if field in ("compensate", "one_gemm"):
            parsed: object = _switch(key, value)
        elif field == "threshold":
            parsed = _choice(key, value, OCC_THRESHOLDS)
        elif field == "compensation_format":
            parsed = _choice(key, value, OCC_COMPENSATION_FORMATS)
        elif field == "sample_size":
            parsed = _integer(key, value)
        else:
            parsed = _number(key, value)
        return rep(r, occ=rep(r.occ or OCCConfig(), **{field: parsed}))
    g = _choice(key, value, _SCALINGS)
    for operand in ("input", "weight") if key == "scaling" else (field,):
        r = _set_granularity(r, operand, g)
    return r


def _parse_overrides(items: list[str]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"expected KEY=VALUE after ':', got {item!r}")
        if key not in VARIANT_KEYS:
            raise ValueError(f"unknown variant key {key!r}; valid: {', '.join(VARIANT_KEYS)}")
        if key in overrides:
            raise ValueError(f"variant key {key!r} is given twice")
        overrides[key] = value
    for switch in ("dge", "occ", "rht"):
        fields = [k for k in overrides if k.startswith(switch + ".")]
        if fields and switch in overrides and not _switch(switch, overrides[switch]):
            raise ValueError(f"{switch}=off contradicts {', '.join(fields)}")
    return overrides


_FIRST = {"block": 0, "rht": 1, "rht.size": 2}


def build(base: QuantRecipe, name: str, items: list[str]) -> QuantRecipe:
    """The variant of `base` that the overrides `items` ("KEY=VALUE" strings) name, called
    `name` (the whole `BASE:KEY=VALUE...` string); a bad name, key or value raises ValueError."""
    try:
        if not _NAME_CHARS.fullmatch(name):
            raise ValueError("a variant name may hold only letters, digits and . _ + = : -")
        overrides = _parse_overrides(items)
        recipe = base
        # block before rht before rht.size, wherever the name puts them: rht=on takes the final
        # block's size and an explicit rht.size wins over it (stable sort: others keep order)
        for key, value in sorted(overrides.items(), key=lambda kv: _FIRST.get(kv[0], 3)):
            recipe = _apply(recipe, key, value)
        description = f"{base.description}; variant {':'.join(items)}"
        return dataclasses.replace(recipe, name=name, description=description)
    except (ValueError, TypeError) as err:
        raise ValueError(f"recipe {name!r}: {err}") from None
