"""Named precision recipes: frozen, keyword-only dataclasses, looked up by name.

A recipe states everything about how a model trains numerically: the autocast dtype of the
non-GEMM ops, whether fp16 loss scaling is needed, and (for quantized recipes) how each operand of
each of the three GEMMs is quantized. `get(name)` returns one; `dataclasses.replace` makes variants:

    r = dataclasses.replace(recipes.get("fp4"), name="fp4-k3", dge=recipes.DGEConfig(k=3.0))

Ablations are also nameable as strings (for `--recipe` and `minifloat compare --recipes`):
`BASE:KEY=VALUE[:KEY=VALUE...]`, e.g. "fp4:dge.k=3", "fp4:occ.alpha=0.97", "fp4:scaling=tensor";
`get()` parses them into a variant of the registered BASE whose `.name` is the whole string (see
`VARIANT_KEYS`).

GEMM convention (see DESIGN.md): every GEMM is `out = a @ bᵀ` with both operands laid out as
[rows, contraction]. fprop: a = input x [M,K], b = weight w [N,K]; dgrad: a = grad_output dy
[M,N], b = wᵀ [K,N]; wgrad: a = dyᵀ [N,M], b = xᵀ [K,M]. An operand's granularity is relative to
that layout: "row" is one scale per row along the contraction dim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from minifloat import recipe_variants
from minifloat.quantize import Granularity
from minifloat.recipe_specs import (
    DelayedScaling,
    DGEConfig,
    GemmSpec,
    OCCConfig,
    OperandSpec,
    check_bool,
    check_instance,
    check_int,
)
from minifloat.recipe_variants import VARIANT_KEYS

__all__ = [
    "Recipe",
    "OperandSpec",
    "GemmSpec",
    "DGEConfig",
    "OCCConfig",
    "DelayedScaling",
    "QuantRecipe",
    "VARIANT_KEYS",
    "get",
    "names",
    "register",
    "variant_help",
]


# The autocast dtypes a recipe may name, with their words in `describe` (None: fp32 throughout).
_AUTOCAST_WORDS: dict[torch.dtype | None, str] = {
    None: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base recipe: mixed precision without quantized GEMMs (fp32, fp16, bf16)."""

    name: str
    description: str = ""
    autocast_dtype: torch.dtype | None = torch.bfloat16  # None: everything in fp32
    loss_scaling: bool = False  # fp16 needs dynamic loss scaling

    def __post_init__(self) -> None:
        check_instance("recipe name", self.name, str)
        check_instance(f"recipe {self.name!r}: description", self.description, str)
        check_bool(f"recipe {self.name!r}: loss_scaling", self.loss_scaling)
        # here, not in describe() or at the first autocast: torch.int8 would fail far from its cause
        if not any(self.autocast_dtype is d for d in _AUTOCAST_WORDS):  # `in` hashes: a list fails
            raise ValueError(
                f"recipe {self.name!r}: autocast_dtype must be None (fp32), torch.bfloat16 or "
                f"torch.float16, got {self.autocast_dtype!r}"
            )

    @property
    def quantized(self) -> bool:
        """Whether `convert()` swaps linear layers for quantized ones under this recipe."""
        return False

    def describe(self) -> dict[str, str]:
        """Per-GEMM precision in words, for tables and `minifloat recipes`."""
        dtype = _AUTOCAST_WORDS[self.autocast_dtype]
        return {"fprop": dtype, "dgrad": dtype, "wgrad": dtype}


# ---------------------------------------------------------------------------------------------
# Quantized recipes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class QuantRecipe(Recipe):
    """A recipe whose linear layers run quantized GEMMs (fprop, dgrad, wgrad)."""

    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec
    dge: DGEConfig | None = None
    occ: OCCConfig | None = None
    delayed: DelayedScaling | None = None
    min_multiple: int = 16  # in/out features must be multiples of this (FP8 tensor-core GEMMs)
    # fprop on FP8 tensor cores with fast accumulation (no periodic promotion of partial sums to
    # fp32), as torchao's float8 layers run their output GEMM: 7-20 % faster at LLaMA shapes.
    # Exact for E2M1 x E2M1 (every partial sum fits); the emulation always sums in fp32.
    fprop_fast_accum: bool = True
    # dgrad's GEMM and wgrad's with fast accumulation too (OCC's separate wgrad correction
    # keeps fp32 promotion): off unless a recipe's convergence was measured unchanged with it
    # (torchao and Transformer Engine keep both off). Both on save ~8 ms a 1.3B step with the
    # layer's SQNR unchanged, but wgrad's alone puts fp8-tensorwise 1.7 % behind in validation
    # loss at 125M (docs/hopper_sessions.md, sessions 36 and 37).
    dgrad_fast_accum: bool = False
    wgrad_fast_accum: bool = False
    # convert() keeps the linear layers of the model's last `keep_last_blocks` repeated blocks in
    # high precision (bf16 under autocast), as NVFP4 training does (arXiv 2509.25149).
    keep_last_blocks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_types()
        m = self.min_multiple
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"min_multiple must be a positive int, got {type(m).__name__}: {m!r}")
        if m < 1:  # 0 divides by zero in unsuitable(); a negative one would pass any dims
            raise ValueError(f"min_multiple must be a positive int, got {m}")
        if self.fprop.lhs.reuse or self.fprop.rhs.reuse or self.dgrad.lhs.reuse:
            raise ValueError("only the rhs of dgrad/wgrad can reuse fprop values")
        if self.wgrad.lhs.reuse:
            raise ValueError("only the rhs of dgrad/wgrad can reuse fprop values")
        for bwd, fwd in ((self.dgrad.rhs, self.fprop.rhs), (self.wgrad.rhs, self.fprop.lhs)):
            if bwd.reuse and bwd.fmt != fwd.fmt:
                raise ValueError(f"a reused operand must keep its fprop format {fwd.fmt}")
        if self.delayed is not None:
            specs = (self.fprop.lhs, self.fprop.rhs, self.dgrad.lhs, self.wgrad.lhs)
            if any(s.granularity != "tensor" for s in specs):
                raise ValueError("delayed scaling needs tensor granularity for all operands")
            if self.occ is not None:
                raise ValueError("delayed scaling and OCC do not combine")
        self._check_random_features()

    def _check_types(self) -> None:
        """TypeError for a field of the wrong type: `dataclasses.replace(r, dge=3.0)` or
        `occ=True` would otherwise pass here and fail at the first forward or backward."""
        for gemm in ("fprop", "dgrad", "wgrad"):
            check_instance(gemm, getattr(self, gemm), GemmSpec)
        for field, cls in (("dge", DGEConfig), ("occ", OCCConfig), ("delayed", DelayedScaling)):
            check_instance(field, getattr(self, field), cls, optional=True)
        for gemm in ("fprop", "dgrad", "wgrad"):
            check_bool(f"{gemm}_fast_accum", getattr(self, f"{gemm}_fast_accum"))
        check_int("keep_last_blocks", self.keep_last_blocks)

    def _check_random_features(self) -> None:
        if self.keep_last_blocks < 0:
            raise ValueError(f"keep_last_blocks must be >= 0, got {self.keep_last_blocks}")
        lhs, rhs = self.wgrad.lhs, self.wgrad.rhs
        if any(
            s.hadamard for s in (self.fprop.lhs, self.fprop.rhs, self.dgrad.lhs, self.dgrad.rhs)
        ):
            raise ValueError("a Hadamard transform applies to the wgrad operands only")
        if lhs.hadamard != rhs.hadamard or (rhs.hadamard and rhs.reuse):
            raise ValueError("both wgrad operands need the same Hadamard transform (no reuse)")

    @property
    def quantized(self) -> bool:
        return True

    @property
    def randomized(self) -> bool:
        """Whether a layer draws random numbers (stochastic rounding, Hadamard signs), so it keeps
        a counter-based random state (`QuantizedGemmMixin.rng_state`)."""
        specs = [getattr(self, g).lhs for g in ("fprop", "dgrad", "wgrad")]
        specs += [getattr(self, g).rhs for g in ("fprop", "dgrad", "wgrad")]
        return any(s.rounding == "stochastic" or s.hadamard for s in specs)

    def folds(self, gemm: str) -> bool:
        """Whether the backward `gemm` ("dgrad"/"wgrad") folds a fprop row scale into dy."""
        if gemm == "dgrad":
            return self.dgrad.rhs.reuse and self.fprop.rhs.granularity == "row"
        if gemm == "wgrad":
            return self.wgrad.rhs.reuse and self.fprop.lhs.granularity == "row"
        raise ValueError(f"gemm must be 'dgrad' or 'wgrad', got {gemm!r}")

    def describe(self) -> dict[str, str]:
        words = {g: getattr(self, g).words() for g in ("fprop", "dgrad", "wgrad")}
        if self.folds("dgrad"):
            words["dgrad"] = words["dgrad"].replace(")", ", x w_scale)", 1)
        if self.folds("wgrad"):
            words["wgrad"] = words["wgrad"].replace(")", ", x x_scale)", 1)
        if self.occ is not None:
            comp = "compensated" if self.occ.compensate else "no compensation"
            words["fprop"] += f" + OCC (alpha={self.occ.alpha}, {comp})"
        if self.dge is not None:
            words["wgrad"] += f" + DGE (k={self.dge.k:g}, cap={self.dge.cap:g})"
        # Accumulation on FP8 tensor cores, named where it departs from the rule: fprop fast,
        # dgrad and wgrad promoted to fp32 (the emulation always sums in fp32).
        if not self.fprop_fast_accum:
            words["fprop"] += ", promoted accum"
        for gemm in ("dgrad", "wgrad"):
            if getattr(self, f"{gemm}_fast_accum"):
                words[gemm] += ", fast accum"
        if self.delayed is not None:
            tag = f" [delayed: history {self.delayed.history_len}, margin {self.delayed.margin}]"
            words = {g: w + tag for g, w in words.items()}
        return words

    def unsuitable(self, in_features: int, out_features: int) -> str | None:
        """Why a linear layer of these dims cannot use this recipe (None if it can)."""
        m = self.min_multiple
        off = [f"{name}={n}" for name, n in (("in_features", in_features),
               ("out_features", out_features)) if n % m]  # fmt: skip
        if off:
            verb = "is not a multiple" if len(off) == 1 else "are not multiples"
            return f"{' and '.join(off)} {verb} of {m} (needed by recipe {self.name})"
        return None


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Recipe] = {}


# A registered name: no ':' (variants), ',' (`--recipes` lists), '+' (switches), '/' or spaces.
_NAME = re.compile(r"[A-Za-z0-9._-]+")


def register(recipe: Recipe) -> Recipe:
    """Add a recipe to the registry (names are unique)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"register takes a Recipe (e.g. dataclasses.replace(recipes.get('fp4'), name=...)), "
            f"got {type(recipe).__name__}: {recipe!r}"
        )
    if not _NAME.fullmatch(recipe.name):
        # ':' starts a variant's keys, ',' separates `--recipes`, '+' a switch; a name is also a
        # run directory's name
        raise ValueError(
            f"a recipe name is letters, digits, '.', '_' and '-', got {recipe.name!r} "
            "(':' is reserved for variants, e.g. fp4:dge.k=3)"
        )
    if recipe.name in _REGISTRY:
        raise ValueError(f"recipe {recipe.name!r} is already registered")
    _REGISTRY[recipe.name] = recipe
    return recipe


def names() -> list[str]:
    """Registered recipe names, in registration order."""
    return list(_REGISTRY)


def variant_help() -> dict[str, str]:
    """`VARIANT_KEYS`' help, each backward fast-accumulation key naming the registered recipes
    whose default is on (read from the registry, so it cannot fall behind a changed default)."""
    help_ = dict(VARIANT_KEYS)
    for gemm in ("dgrad", "wgrad"):
        key = f"{gemm}_fast_accum"
        on = [n for n in _REGISTRY if getattr(_REGISTRY[n], key, False)]
        help_[key] += f" (on: {', '.join(on)})"
    return help_


def get(name: str | Recipe) -> Recipe:
    """The recipe called `name` (a Recipe passes through).

    `name` is a registered name or a variant `BASE:KEY=VALUE[:KEY=VALUE...]` of one (keys in
    `VARIANT_KEYS`); a variant is built with `dataclasses.replace` and named by the whole string.
    """
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a recipe is a name or a Recipe, got {type(name).__name__}: {name!r}")
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _variant(name)
    raise ValueError(
        f"unknown recipe {name!r}; valid: {', '.join(_REGISTRY)} "
        "(or a variant BASE:KEY=VALUE, e.g. fp4:dge.k=3)"
    )


register(Recipe(name="fp32", description="full fp32 (reference)", autocast_dtype=None))
register(
    Recipe(
        name="fp16",
        description="fp16 autocast + dynamic loss scaling",
        autocast_dtype=torch.float16,
        loss_scaling=True,
    )
)
register(Recipe(name="bf16", description="bf16 autocast (the baseline)"))


# The scale format of every registered recipe whose scales come from its operands' own maxima:
# values x * (max / amax), scales the reciprocal (torchao's and Transformer Engine's form). The
# same SQNR as dividing by an fp32 scale (`scale_format=fp32`), one float32 product an element
# where the exact quotient needs float64: 1.3B steps 1.0-6.4 ms faster (fp8-tensorwise 1.3,
# fp8-rowwise 2.6, fp4-dge 3.9, fp4 6.4; docs/hopper_sessions.md, session 38).
_SCALE_FORMAT = "inv"


def _op(fmt: str, granularity: Granularity = "tensor", **kw) -> OperandSpec:
    return OperandSpec(fmt=fmt, granularity=granularity, **{"scale_format": _SCALE_FORMAT, **kw})


def _reuse(fmt: str) -> OperandSpec:
    return OperandSpec(fmt=fmt, reuse=True)


def _tensorwise(scale_format: str) -> dict[str, GemmSpec]:
    """E4M3 x and w, E5M2 dy, one scale per tensor; backward reuses fprop's values."""
    e4m3, e5m2 = (_op(f, scale_format=scale_format) for f in ("e4m3", "e5m2"))
    return dict(
        fprop=GemmSpec(lhs=e4m3, rhs=e4m3),
        dgrad=GemmSpec(lhs=e5m2, rhs=_reuse("e4m3")),
        wgrad=GemmSpec(lhs=e5m2, rhs=_reuse("e4m3")),
    )


register(
    QuantRecipe(
        name="fp8-tensorwise",
        description="FP8 with one dynamic scale per tensor",
        # 125M: dgrad with fast accumulation +0.06 % validation loss at 600 steps, -1.06 % at
        # 900; wgrad +1.7 % at 600 (docs/hopper_sessions.md, session 37)
        dgrad_fast_accum=True,
        **_tensorwise(_SCALE_FORMAT),
    )
)
_ROW = _op("e4m3", "row")
register(
    QuantRecipe(
        name="fp8-rowwise",
        description="FP8 E4M3, one scale per row along each GEMM's contraction dim",
        # 125M, 600 steps: dgrad with fast accumulation -1.68 / +0.17 / -0.13 % validation loss
        # over three seeds (session 39; +0.36 % in session 37's run); with wgrad fast too
        # +1.18 % (session 37)
        dgrad_fast_accum=True,
        fprop=GemmSpec(lhs=_ROW, rhs=_ROW),
        dgrad=GemmSpec(lhs=_ROW, rhs=_ROW),
        wgrad=GemmSpec(lhs=_ROW, rhs=_ROW),
    )
)
_TILE = _op("e4m3", (1, 128))
register(
    QuantRecipe(
        name="fp8-blockwise",
        description="DeepSeek-V3: 1x128 tiles for activations/gradients, 128x128 weight blocks",
        fprop=GemmSpec(lhs=_TILE, rhs=_op("e4m3", (128, 128))),
        dgrad=GemmSpec(lhs=_TILE, rhs=_reuse("e4m3")),
        wgrad=GemmSpec(lhs=_TILE, rhs=_TILE),
        min_multiple=128,
    )
)
register(
    QuantRecipe(
        name="fp8-delayed",
        description="FP8 tensorwise, scales from amax history",
        delayed=DelayedScaling(),
        **_tensorwise("fp32"),  # x divides by the scales its history gives
    )
)


def _fp4_like(name: str, description: str, w_fmt: str, x_fmt: str, **kw) -> QuantRecipe:
    """fprop x (row, per token) x w (row, per output channel); backward folds the row scales."""
    grad = _op("e5m2", "row")
    return QuantRecipe(
        name=name,
        description=description,
        fprop=GemmSpec(lhs=_op(x_fmt, "row"), rhs=_op(w_fmt, "row")),
        dgrad=GemmSpec(lhs=grad, rhs=_reuse(w_fmt)),
        wgrad=GemmSpec(lhs=grad, rhs=_reuse(x_fmt)),
        **kw,
    )


_DGE, _OCC = DGEConfig(), OCCConfig()
for _r in (
    # dgrad with fast accumulation (fp4-dge's dgrad GEMM, E5M2 dy x the reused E2M1 weight):
    # 125M validation loss -0.49 / -0.36 / -0.73 % over three seeds at step 400 (session 40).
    # OCC's wgrad keeps fp32 promotion (its correction GEMM is a separate sum).
    _fp4_like(
        "fp4",
        "2501.17116: W4A4 E2M1 + DGE + OCC",
        "e2m1",
        "e2m1",
        dge=_DGE,
        occ=_OCC,
        dgrad_fast_accum=True,
    ),
    # Both backward GEMMs with fast accumulation: E2M1 x_q's own rounding dwarfs the
    # accumulation's. 125M validation loss: fp4-direct -0.66 / +0.01 / +0.45 % over three seeds
    # (session 39), fp4-dge -0.08 / -0.18 % after 600 / 900 steps (docs/hopper_sessions.md,
    # session 37).
    _fp4_like(
        "fp4-direct",
        "W4A4 E2M1 direct cast (no DGE, no OCC)",
        "e2m1",
        "e2m1",
        dgrad_fast_accum=True,
        wgrad_fast_accum=True,
    ),
    _fp4_like(
        "fp4-dge",
        "W4A4 E2M1 + DGE only",
        "e2m1",
        "e2m1",
        dge=_DGE,
        dgrad_fast_accum=True,
        wgrad_fast_accum=True,
    ),
    # fp4's dgrad GEMM exactly (OCC and DGE act on the other two), so fp4's default
    _fp4_like("fp4-occ", "W4A4 E2M1 + OCC only", "e2m1", "e2m1", occ=_OCC, dgrad_fast_accum=True),
    # dgrad with fast accumulation, wgrad promoted: dgrad's alone gave 125M validation loss
    # -0.35 % over three paired seeds (standard error 0.28 %, none behind) and a 1.3B step 2.2 %
    # faster on an H100 (session 104); both backward GEMMs fast cost +0.48 % (four paired seeds,
    # standard error 0.20 %; session 103), presumably wgrad's E4M3 input operand.
    _fp4_like(
        "fp4-w4a8",
        "E2M1 weights, E4M3 inputs, direct cast",
        "e2m1",
        "e4m3",
        dgrad_fast_accum=True,
    ),
    # Both backward GEMMs with fast accumulation: 125M validation loss -0.23 % over four paired
    # seeds (standard error 0.37 %), a 1.3B step 3.3 % faster on an H100 (session 103).
    _fp4_like(
        "fp4-w8a4",
        "E4M3 weights, E2M1 inputs, direct cast",
        "e4m3",
        "e2m1",
        dgrad_fast_accum=True,
        wgrad_fast_accum=True,
    ),
):
    register(_r)
del _r


def _microblock(
    name: str,
    description: str,
    scale_format: str,
    block: int,
    weight_block: tuple[int, int],
    rht: int,
    keep_last_blocks: int,
) -> QuantRecipe:
    """E2M1 in 1 x `block` blocks along each GEMM's contraction dim with `scale_format` block
    scales; the weight in `weight_block` blocks (square: dgrad reuses the fprop values, else
    it quantizes wᵀ again); stochastic rounding of dy; a random Hadamard transform of size `rht`
    (0: none) on both wgrad operands."""

    def op(granularity=(1, block), rounding="nearest", hadamard=0) -> OperandSpec:
        return _op("e2m1", granularity, scale_format=scale_format, rounding=rounding,
                   hadamard=hadamard)  # fmt: skip

    square = weight_block[0] == weight_block[1]
    return QuantRecipe(
        name=name,
        description=description,
        fprop=GemmSpec(lhs=op(), rhs=op(weight_block)),
        dgrad=GemmSpec(lhs=op(rounding="stochastic"), rhs=_reuse("e2m1") if square else op()),
        wgrad=GemmSpec(lhs=op(rounding="stochastic", hadamard=rht), rhs=op(hadamard=rht)),
        min_multiple=max(16, *weight_block),
        keep_last_blocks=keep_last_blocks,
    )


register(
    _microblock(
        "nvfp4", "2509.25149: NVFP4 (1x16 E4M3 x fp32 scales, 16x16 weights, SR, 16-point RHT)",
        "e4m3", 16, (16, 16), rht=16, keep_last_blocks=2,
    )
)  # fmt: skip
register(
    _microblock(
        "mxfp4", "OCP MXFP4: 1x32 E8M0 scales, stochastic rounding of gradients",
        "e8m0", 32, (1, 32), rht=0, keep_last_blocks=0,
    )
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Variants: "BASE:KEY=VALUE[:KEY=VALUE...]" (recipe_variants.py)
# ---------------------------------------------------------------------------------------------


def _variant(name: str) -> Recipe:
    """Parse `BASE:KEY=VALUE[:KEY=VALUE...]` into a variant of the registered BASE."""
    base_name, *items = name.split(":")
    base = get(base_name)
    if not isinstance(base, QuantRecipe):
        raise ValueError(
            f"recipe {name!r}: variants need a quantized base recipe; {base_name} is autocast only"
        )
    return recipe_variants.build(base, name, items)
