"""The `BASE:KEY=VALUE` variant keys of the micro-block FP4 recipes (nvfp4, mxfp4).

`recipes.get("nvfp4:rht=off")` parses the value (recipe_variants.py) and calls `apply` here,
which builds the variant with `dataclasses.replace`:

- `sr` (bool): stochastic (on) or nearest-even (off) rounding of the gradient dy in dgrad and
  wgrad;
- `rht` (bool): the random Hadamard transform of both wgrad operands, of the size of their block
  (16 for nvfp4, 32 for mxfp4), on or off; `rht.size` (a power of two) sets its size: a size
  above the block that exceeds a step's tokens rounded up to a power of two is refused at the
  layer's first training call (`microscale.check_hadamard_size`: it would only rotate zeros);
- `block` (a power of two, at most 65536): the micro-block length along each GEMM's
  contraction dim: 1 x N for activations and gradients, N x N for a square-blocked weight
  (nvfp4's 16x16); the layer dims must then be multiples of max(16, N);
- `keep_last` (int): how many of the model's last blocks `convert` keeps in bf16.

The name's keys apply in one order whatever their order in it (recipe_variants.build): `block`,
then `rht` (so `rht=on` takes the final block's size), then `rht.size` (an explicit size wins),
then the rest. `block` alone keeps the recipe's transform size (nvfp4:block=32: RHT 16).

Only recipes whose operands all have block granularity and E4M3 or E8M0 block scales take the
first four keys (`sr` and `rht` draw from the micro-block quantizer's counter-based random state).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minifloat.recipes import OperandSpec, QuantRecipe

__all__ = ["KEYS", "apply"]

KEYS = ("sr", "rht", "rht.size", "block", "keep_last")
_GEMMS = ("fprop", "dgrad", "wgrad")


def _is_microblock(r: QuantRecipe) -> bool:
    specs = [s for g in _GEMMS for s in (getattr(r, g).lhs, getattr(r, g).rhs) if not s.reuse]
    return all(
        isinstance(s.granularity, tuple) and s.scale_format in ("e4m3", "e8m0") for s in specs
    )


def _resize(s: OperandSpec, n: int) -> OperandSpec:
    """A block spec with contraction length n: (1, n), or (n, n) for square blocks."""
    if s.reuse:
        return s
    square = s.granularity[0] == s.granularity[1]
    return dataclasses.replace(s, granularity=(n, n) if square else (1, n))


def apply(r: QuantRecipe, key: str, value: bool | int) -> QuantRecipe:
    """The variant of `r` with `key` (one of `KEYS`) set to the parsed `value`."""
    rep = dataclasses.replace
    if key == "keep_last":
        return rep(r, keep_last_blocks=int(value))
    if not _is_microblock(r):
        raise ValueError(f"{key} applies to the micro-block recipes (nvfp4, mxfp4) only")
    gemms = {g: getattr(r, g) for g in _GEMMS}
    if key == "sr":
        rounding = "stochastic" if value else "nearest"
        for g in ("dgrad", "wgrad"):
            gemms[g] = rep(gemms[g], lhs=rep(gemms[g].lhs, rounding=rounding))
    elif key in ("rht", "rht.size"):
        size = int(value) if key == "rht.size" else (r.wgrad.lhs.granularity[1] if value else 0)
        w = gemms["wgrad"]
        gemms["wgrad"] = rep(w, lhs=rep(w.lhs, hadamard=size), rhs=rep(w.rhs, hadamard=size))
    elif key == "block":
        gemms = {g: rep(s, lhs=_resize(s.lhs, value), rhs=_resize(s.rhs, value))
                 for g, s in gemms.items()}  # fmt: skip
        r = rep(r, min_multiple=max(16, int(value)))
    else:
        raise ValueError(f"unknown micro-block variant key {key!r}")
    return rep(r, **gemms)
