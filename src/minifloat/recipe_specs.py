"""The parts a `QuantRecipe` is built from: operand and GEMM specs, and the DGE, OCC and
delayed-scaling configs. Frozen, keyword-only dataclasses that validate themselves; recipes.py
assembles them into named recipes and re-exports every public name here (import them from
`minifloat.recipes`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from minifloat import formats
from minifloat.hadamard import check_size
from minifloat.quantize import Granularity, normalize_granularity

__all__ = [
    "OperandSpec",
    "GemmSpec",
    "DGEConfig",
    "OCC_THRESHOLDS",
    "OCC_COMPENSATION_FORMATS",
    "OCCConfig",
    "DelayedScaling",
]


# 2**margin must be finite in float32 (2**127 is, 2**128 is not): a larger margin multiplies every
# delayed scale to inf and every output to NaN.
DELAYED_MARGIN_MAX = 127


def check_real(name: str, value: object) -> None:
    """TypeError unless `value` is a real number (bool and str are not), ValueError unless it is
    finite: the messages of the variant strings ("dge.k must be a finite number")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite number, got {type(value).__name__}: {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_int(name: str, value: object) -> None:
    """TypeError unless `value` is an int (bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")


def check_bool(name: str, value: object) -> None:
    """TypeError unless `value` is True or False: a dataclass field accepts any object, and the
    string "no" or "off" would read as true."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}: {value!r}")


def check_instance(name: str, value: object, cls: type, *, optional: bool = False) -> None:
    """TypeError unless `value` is a `cls` (or None where `optional`): a wrong type would pass
    construction and fail at the first forward or backward, deep inside the layer."""
    if isinstance(value, cls) or (optional and value is None):
        return
    article = "an" if cls.__name__[0] in "AEIOU" else "a"
    allowed = f"{article} {cls.__name__}" + (" or None" if optional else "")
    raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}: {value!r}")


def _granularity_words(g: Granularity) -> str:
    return f"{g[0]}x{g[1]}" if isinstance(g, tuple) else g


@dataclass(frozen=True, kw_only=True)
class OperandSpec:
    """How one operand of one GEMM is quantized.

    `granularity` is relative to the operand's [rows, contraction] layout in that GEMM.
    `reuse=True` (backward GEMMs' rhs only) takes the fprop's quantized values of the same tensor,
    transposed, instead of quantizing again: a tensor or block scale is transposed with them; a
    row scale, which cannot be applied along the backward contraction dim, is folded into the
    gradient operand (DESIGN.md "FP4 on Hopper") and the reused values get a unit scale. A reused
    spec must name the fprop's format; its granularity is ignored.
    `hadamard` (wgrad operands only, 0 = off): the size n of a random Hadamard transform applied
    along the contraction dim before quantizing (minifloat/hadamard.py). "stochastic" rounding
    and the transform draw from the layer's counter-based random state (minifloat/counter_rng.py).
    """

    fmt: str
    granularity: Granularity = "tensor"
    scale_format: str = "fp32"
    rounding: str = "nearest"
    reuse: bool = False
    hadamard: int = 0

    def __post_init__(self) -> None:
        # the canonical (lower-case) names: the kernels compare them ("e2m1", "inv"), so "E2M1"
        # would validate here and then silently take other paths
        object.__setattr__(self, "fmt", formats.get(self.fmt).name)
        object.__setattr__(self, "scale_format", formats.get_scale_format(self.scale_format).name)
        check_bool("reuse", self.reuse)
        object.__setattr__(self, "granularity", normalize_granularity(self.granularity))
        if self.granularity == "column":
            raise ValueError("operand granularity 'column' cannot scale a GEMM operand; use 'row'")
        if self.rounding not in formats.ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {formats.ROUNDING_MODES}")
        if self.hadamard:
            check_size(self.hadamard)

    def words(self) -> str:
        """E.g. "E2M1 (row)"; reused operands read "E2M1 (fprop values)"."""
        if self.reuse:
            return f"{self.fmt.upper()} (fprop values)"
        # fp32 and "inv" scales are the same numbers, formed by division or by multiplication
        extra = [] if self.scale_format in ("fp32", "inv") else [f"{self.scale_format} scale"]
        extra += [] if self.rounding == "nearest" else [self.rounding]
        extra += [f"RHT {self.hadamard}"] if self.hadamard else []
        return f"{self.fmt.upper()} ({', '.join([_granularity_words(self.granularity), *extra])})"


@dataclass(frozen=True, kw_only=True)
class GemmSpec:
    """The two operands of one GEMM `a @ bᵀ`: lhs = a, rhs = b.

    fprop: lhs input, rhs weight. dgrad: lhs grad_output, rhs weight. wgrad: lhs grad_output,
    rhs input.
    """

    lhs: OperandSpec
    rhs: OperandSpec

    def __post_init__(self) -> None:
        check_instance("lhs", self.lhs, OperandSpec)
        check_instance("rhs", self.rhs, OperandSpec)

    def words(self) -> str:
        return f"{self.lhs.words()} x {self.rhs.words()}"


@dataclass(frozen=True, kw_only=True)
class DGEConfig:
    """Differentiable Gradient Estimator on the weights (2501.17116): wgrad *= f'(w / w_scale)."""

    k: float = 5.0
    cap: float = 3.0

    def __post_init__(self) -> None:
        # inf would pass the range check: k = inf zeroes every weight gradient
        check_real("dge.k", self.k)
        check_real("dge.cap", self.cap)
        if not (self.k >= 1 and self.cap > 0):  # k = 1: straight-through; below: not a quantizer
            raise ValueError("DGE needs k >= 1 and cap > 0")
        # k and cap as text, from which dge.py reads its constants: under torch.compile a float
        # attribute that changed between compilations is traced as a symbol, and torch 2.13's
        # inductor computed DGE wrongly with a symbolic k (session 42); a string stays a
        # constant of the graph (one graph per config). Not a field: equality and repr are
        # k's and cap's.
        object.__setattr__(self, "key", f"{float(self.k).hex()} {float(self.cap).hex()}")

    def __setstate__(self, state: dict) -> None:
        """Unpickling: a config pickled before `key` existed (session 42) gets it here."""
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()


OCC_THRESHOLDS = ("exact", "sampled")
OCC_COMPENSATION_FORMATS = ("fp32", "e4m3")


@dataclass(frozen=True, kw_only=True)
class OCCConfig:
    """Outlier Clamping and Compensation on the inputs (2501.17116); the math is in occ.py.

    The input is clamped to its per-tensor [1-alpha, alpha] quantiles before quantization; with
    `compensate` the clipped remainder Δx = x - x_c is multiplied by the weight and added.
    `threshold`: "exact" quantiles of the whole tensor (one sort of it: a reference), or
    "sampled": the quantiles of a strided sample of about `sample_size` entries (every s-th
    entry, s a prime that does not divide the row length, so the sample visits every column).
    `compensation_format`: "e4m3": Δx quantized row-wise to E4M3 in a second FP8 GEMM of fprop,
    and in wgrad folded into the saved input (occ.fold_remainder); or "fp32": dense fp32 GEMMs,
    the paper's high-precision compensation, kept as the reference it is measured against.
    `one_gemm` (E4M3 compensation of E2M1 row-scaled "inv" operands; the default): fprop's two
    products as one GEMM over 2K, Δx on x_q's row scale over a per-row factor
    (occ_gemm.joint_fprop, occ.joint_lhs): 1.3B fp4 6-9 ms a step faster than the separate
    GEMM (off), 1.00x bf16 against 0.98x, y's SQNR within 0.06 dB of it
    (docs/hopper_sessions.md, session 66).
    """

    alpha: float = 0.99
    compensate: bool = True
    compensation_format: str = "e4m3"
    threshold: str = "sampled"
    sample_size: int = 65536
    one_gemm: bool = True

    def __post_init__(self) -> None:
        check_real("occ.alpha", self.alpha)
        check_bool("occ.compensate", self.compensate)
        check_bool("occ.one_gemm", self.one_gemm)
        if not 0.5 < self.alpha < 1.0:
            raise ValueError(f"OCC alpha must lie in (0.5, 1), got {self.alpha}")
        if self.threshold not in OCC_THRESHOLDS:
            raise ValueError(f"OCC threshold must be one of {OCC_THRESHOLDS}")
        if self.compensation_format not in OCC_COMPENSATION_FORMATS:
            raise ValueError(f"OCC compensation_format must be one of {OCC_COMPENSATION_FORMATS}")
        if not (isinstance(self.sample_size, int) and self.sample_size >= 1024):
            raise ValueError(f"OCC sample_size must be an integer >= 1024, got {self.sample_size}")


@dataclass(frozen=True, kw_only=True)
class DelayedScaling:
    """Tensorwise scales from an amax history (Transformer Engine / MS-AMP style).

    The scale of step t is `max(amax of the previous history_len steps) * 2**margin / fmt.max`;
    while the history is still empty (first step) the current amax is used.
    `history_len`: an int >= 1; `margin`: an int in [0, DELAYED_MARGIN_MAX] = [0, 127], the
    range where 2**margin is finite in float32 (useful margins are a few binades).
    """

    history_len: int = 16
    margin: int = 0

    def __post_init__(self) -> None:
        check_int("delayed history_len", self.history_len)
        check_int("delayed margin", self.margin)
        if self.history_len < 1 or not 0 <= self.margin <= DELAYED_MARGIN_MAX:
            raise ValueError(
                f"delayed scaling needs history_len >= 1 and margin in [0, "
                f"{DELAYED_MARGIN_MAX}] (2**margin finite in float32), got history_len="
                f"{self.history_len}, margin={self.margin}"
            )
