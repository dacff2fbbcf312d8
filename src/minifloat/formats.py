"""Element formats and scale formats: exact grids and exact reference rounding.

An element format is the grid a quantized value lives on (E2M1 for FP4, E4M3/E5M2 for FP8, ...).
A scale format says how the per-group dequantization multiplier is stored (fp32, a power of two,
MX's E8M0, NVFP4's E4M3 block scale under an fp32 tensor scale, or the float32 reciprocal of a
float32 quantization multiplier, "inv").

Rounding here is the *reference*: plain float32 arithmetic that is exact by construction (every
step divides or multiplies by a power of two, then `torch.round`, which is round-half-to-even;
formats without mantissa bits, such as E3M0, search their 8-entry grid instead). Fast paths
(Triton kernels) are tested bit-exactly against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minifloat.exact import div_rn

__all__ = [
    "check_random_source",
    "ElementFormat",
    "FloatFormat",
    "IntFormat",
    "ScaleFormat",
    "SCALE_FORMATS",
    "ROUNDING_MODES",
    "e8m0_max",
    "get",
    "get_scale_format",
    "inv_scales",
    "names",
    "pow2_ceil",
    "represent_scale",
]

ROUNDING_MODES = ("nearest", "stochastic")


def check_random_source(
    generator: torch.Generator | None,
    noise: torch.Tensor | None,
    x: torch.Tensor | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> None:
    """ValueError when stochastic rounding gets both a generator and pre-drawn noise (the noise
    is used as given, so the generator would silently go unused), or, given `x`, noise not of
    x's shape (broadcast, one draw would round many entries alike) or not of `dtypes` (default:
    any floating dtype)."""
    if generator is not None and noise is not None:
        raise ValueError("give stochastic rounding a generator or noise, not both")
    if noise is None or x is None:
        return
    dtype_ok = noise.is_floating_point() if dtypes is None else noise.dtype in dtypes
    if noise.shape != x.shape or not dtype_ok:
        kinds = "floating" if dtypes is None else " or ".join(map(str, dtypes))
        kinds = f"a {kinds} tensor"
        raise ValueError(
            f"noise must be {kinds} of x's shape {tuple(x.shape)}, got {noise.dtype} of shape "
            f"{tuple(noise.shape)}"
        )


@dataclass(frozen=True, kw_only=True)
class ElementFormat:
    """Common interface of element formats: a symmetric grid of representable magnitudes."""

    name: str
    bits: int

    @property
    def max(self) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def grid(self) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def below_max(self) -> float:  # pragma: no cover - overridden
        """The largest representable magnitude below `max` (a Python float: no tensor read,
        so compiled code that needs it has no graph break)."""
        raise NotImplementedError

    def spacing(self, mag: torch.Tensor) -> torch.Tensor:  # pragma: no cover - overridden
        """The grid spacing (a power of two) of the binade holding each magnitude `mag` >= 0,
        floored at the subnormal spacing: the quantum that rounding at `mag` uses."""
        raise NotImplementedError

    def spacings(self, mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`spacing(mag)`, its reciprocal), both exact powers of two: a quantum and what to
        multiply by instead of dividing by it (a compiled float32 division is approximate)."""
        quantum = self.spacing(mag)
        return quantum, quantum.reciprocal()

    def round(
        self,
        x: torch.Tensor,
        rounding: str = "nearest",
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Round float32 `x` (already divided by its scale) onto the grid, saturating at ±max.

        "nearest" is round-to-nearest, ties-to-even, as hardware conversion does. "stochastic"
        picks one of the two neighbouring grid points with probability proportional to proximity
        (unbiased): `floor(|x| / quantum + u) * quantum`, with u the given `noise` (uniforms in
        [0, 1) of x's shape, e.g. `counter_rng.uniform`) or drawn from `generator`. NaN stays
        NaN; ±inf saturates to ±max (callers that must keep inf non-finite handle it before
        rounding).
        """
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
        check_random_source(generator, noise, x)
        x = x.float()
        mag = x.abs().clamp(max=self.max)  # saturate first; NaN passes through clamp
        quantum = self.spacing(mag)
        if rounding == "nearest" and self._ties_by_table:
            q = _round_nearest_even_by_table(mag, self.grid)
        elif rounding == "nearest":
            q = torch.round(mag / quantum) * quantum
        else:
            u = noise
            if u is None:
                device = generator.device if generator is not None else mag.device
                u = torch.rand(mag.shape, generator=generator, device=device, dtype=torch.float32)
            q = torch.floor(mag / quantum + u.to(mag.device)) * quantum
        q = q.clamp(max=self.max)
        return torch.copysign(q, x)

    @property
    def _ties_by_table(self) -> bool:
        # With no mantissa bits, "even" is the exponent field's parity, which the integer-multiple
        # rounding below can't see; such formats round by searching their (tiny) grid instead.
        return getattr(self, "mbits", 1) == 0

    def is_on_grid(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise: is `x` exactly a representable value (NaN is not)."""
        return self.round(x) == x


def _round_nearest_even_by_table(mag: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest grid point of non-negative `mag`; ties go to the even code (even grid index)."""
    g = grid.to(device=mag.device, dtype=torch.float32)
    hi = torch.searchsorted(g, mag.contiguous()).clamp(max=g.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - g[lo], g[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)) | (mag == g[hi])
    return torch.where(torch.isnan(mag), mag, torch.where(pick_hi, g[hi], g[lo]))


# dtype -> (same-width integer dtype, mantissa bits, exponent bias): the IEEE fields that
# `FloatFormat.spacing` reads. A non-negative float's exponent field is its bits shifted right by
# the mantissa width.
_FLOAT_BITS = {
    torch.float32: (torch.int32, 23, 127),
    torch.float64: (torch.int64, 52, 1023),
}


@dataclass(frozen=True, kw_only=True)
class FloatFormat(ElementFormat):
    """A sign-exponent-mantissa minifloat with subnormals and no infinities in the grid.

    Two flags remove codes that are not finite numbers from the top binade:
    `top_exponent_reserved` (IEEE-like, E5M2: the all-ones exponent is inf/NaN) and
    `nan_at_top_code` (E4M3 "fn": only S.1111.111 is NaN).
    """

    ebits: int
    mbits: int
    bias: int
    top_exponent_reserved: bool = False  # IEEE-like: top exponent field is inf/NaN (E5M2)
    nan_at_top_code: bool = False  # E4M3fn: only S.1111.111 is NaN
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        top = (1 << self.ebits) - 1 - (1 if self.top_exponent_reserved else 0)
        return top - self.bias

    @property
    def max(self) -> float:
        mant_top = (1 << self.mbits) - 1 - (1 if self.nan_at_top_code else 0)
        return float(2.0**self.emax * (1 + mant_top / (1 << self.mbits)))

    def __post_init__(self) -> None:
        # Built once, here: a lazy cache filled on first use would be a mutation inside whatever
        # first reads `grid`, and torch.compile breaks its graph on such side effects (e.g. in
        # DGE's backward).
        vals = {0.0}
        for m in range(1, 1 << self.mbits):  # subnormals
            vals.add(m * 2.0 ** (self.emin - self.mbits))
        for e in range(self.emin, self.emax + 1):
            for m in range(1 << self.mbits):
                v = 2.0**e * (1 + m / (1 << self.mbits))
                if v <= self.max:
                    vals.add(v)
        self._cache["grid"] = torch.tensor(sorted(vals), dtype=torch.float64)
        self._cache["below_max"] = sorted(vals)[-2]

    @property
    def grid(self) -> torch.Tensor:
        return self._cache["grid"]

    @property
    def below_max(self) -> float:
        return self._cache["below_max"]

    def spacing(self, mag: torch.Tensor) -> torch.Tensor:
        # Spacing of the grid around `mag`: 2^(e - mbits) with e the binade of mag, floored at the
        # subnormal spacing.
        if mag.dtype in _FLOAT_BITS:
            return self.spacings(mag)[0]
        # Other dtypes (bfloat16, float16): frexp gives mag = f * 2^exp with f in [0.5, 1), so
        # e = exp - 1; zero (frexp: exp 0) lies in the subnormal binade.
        _, exp = torch.frexp(mag)
        e = torch.where(mag == 0, self.emin, torch.clamp(exp - 1, min=self.emin))
        return torch.ldexp(torch.ones_like(mag), (e - self.mbits).to(torch.int32))

    def spacings(self, mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For float32/float64 `mag`, log2 of the spacing, e - mbits, is read from the exponent
        field and both powers of two are built as bits: exact, as frexp/ldexp are, but a few
        integer instructions where a GPU compiles those to libdevice calls (DGE runs this on
        every weight each step: 115.7 -> 77.9 us for a 5632 x 2048 weight's backward, H200,
        `results/dge_probe_h200_2026-11-28.md`), and no `torch.where` constants (see
        `kernels.operand._e2m1_magnitude`, which reads E2M1's spacing from the bits too).

        Zero and float subnormals (exponent field 0) fall below emin and are floored there;
        inf and NaN (all-ones field) are capped at the largest finite binade, so both powers
        of two are finite (NaN's value is discarded downstream anyway). The reciprocal is
        exact below 2^bias, far above every format's max."""
        if mag.dtype not in _FLOAT_BITS:
            return super().spacings(mag)
        int_t, mant, bias = _FLOAT_BITS[mag.dtype]
        low = self.emin - self.mbits
        e = ((mag.view(int_t) >> mant) - (bias + self.mbits)).clamp(low, bias - self.mbits)
        return ((e + bias) << mant).view(mag.dtype), ((bias - e) << mant).view(mag.dtype)


@dataclass(frozen=True, kw_only=True)
class IntFormat(ElementFormat):
    """Symmetric two's-complement integers in [-max, max], max = 2^(bits-1) - 1.

    The most negative code (-2^(bits-1)) is unused so that the grid is symmetric, as the
    absmax scaling of `quantize` assumes.
    """

    @property
    def max(self) -> float:
        return float((1 << (self.bits - 1)) - 1)

    @property
    def grid(self) -> torch.Tensor:
        return torch.arange(0, int(self.max) + 1, dtype=torch.float64)

    @property
    def below_max(self) -> float:
        return self.max - 1.0

    def spacing(self, mag: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(mag)

    def spacings(self, mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones_like(mag), torch.ones_like(mag)


_FORMATS: dict[str, ElementFormat] = {
    f.name: f
    for f in (
        # FP4 of 2501.17116 / OCP MX: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
        FloatFormat(name="e2m1", bits=4, ebits=2, mbits=1, bias=1),
        # Ablation formats of the paper. E1M2 with bias 1 is a uniform 8-level grid (0..1.75);
        # E3M0 with bias 3 is powers of two 0.25..16. Only the grid's shape matters: absmax
        # scaling maps any group's amax onto `max`.
        FloatFormat(name="e1m2", bits=4, ebits=1, mbits=2, bias=1),
        FloatFormat(name="e3m0", bits=4, ebits=3, mbits=0, bias=3),
        FloatFormat(name="e4m3", bits=8, ebits=4, mbits=3, bias=7, nan_at_top_code=True),
        FloatFormat(name="e5m2", bits=8, ebits=5, mbits=2, bias=15, top_exponent_reserved=True),
        IntFormat(name="int8", bits=8),
        IntFormat(name="int4", bits=4),
    )
}


def names() -> list[str]:
    """Names of the element formats."""
    return list(_FORMATS)


def get(fmt: str | ElementFormat) -> ElementFormat:
    """The element format called `fmt` (a format passes through unchanged)."""
    if isinstance(fmt, ElementFormat):
        return fmt
    try:
        return _FORMATS[str(fmt).lower()]
    except KeyError:
        raise ValueError(f"unknown element format {fmt!r}; valid: {', '.join(_FORMATS)}") from None


# ---------------------------------------------------------------------------------------------
# Scale formats
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ScaleFormat:
    """How a group's dequantization multiplier is represented.

    fp32: exact `amax / fmt.max`. pow2: the smallest power of two >= that (so no value overflows
    the grid), capped at 2^127, the largest power of two in float32. e8m0: pow2 limited to MX's
    exponent range [-127, 127] and at most `e8m0_max(fmt.max)`, so that every grid value times
    the scale is a finite float32 (groups above `fmt.max * e8m0_max(fmt.max)` saturate). e4m3:
    NVFP4's two-level scale, an E4M3 block scale times an fp32 per-tensor scale. inv: values
    are quantized by a *multiplication*, `round(x * m)` with `m = fmt.max / amax` rounded to
    float32, and the scale is `1 / m` rounded to float32 (`inv_scales`): the form of torchao's
    float8 and Transformer Engine, one float32 product per element where an exact quotient by an
    fp32 scale needs float64 arithmetic on a GPU. Its values differ from fp32's only where
    x / scale lies within an ulp or two of a rounding boundary of the grid.
    """

    name: str


SCALE_FORMATS: dict[str, ScaleFormat] = {
    n: ScaleFormat(name=n) for n in ("fp32", "pow2", "e8m0", "e4m3", "inv")
}


def get_scale_format(name: str | ScaleFormat) -> ScaleFormat:
    """The scale format called `name`."""
    if isinstance(name, ScaleFormat):
        return name
    try:
        return SCALE_FORMATS[str(name).lower()]
    except KeyError:
        valid = ", ".join(SCALE_FORMATS)
        raise ValueError(f"unknown scale format {name!r}; valid: {valid}") from None


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x, element-wise, exactly (for positive finite x)."""
    mant, exp = torch.frexp(x)
    # x = mant * 2^exp with mant in [0.5, 1): x is a power of two exactly when mant == 0.5.
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(x), exp.to(torch.int32))


_INV_MULTIPLIER_MAX = 2.0**126  # so that the scale 1 / m is a normal float32


def _check_fmt_max(fmt_max: object) -> None:
    """A format's max is a finite number > 0: 0, inf or NaN gave inf scales or 2^127."""
    if not (isinstance(fmt_max, (int, float)) and 0 < fmt_max < math.inf):
        raise ValueError(f"fmt_max must be a finite number > 0 (a format's max), got {fmt_max!r}")


def inv_scales(amax: torch.Tensor, fmt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The "inv" scale format's (multipliers m, scales 1 / m) of groups with maxima `amax`.

    m is `fmt_max / amax` correctly rounded to float32 and at most 2^126 (a subnormal amax: the
    group's values are `x * 2^126`, below `fmt_max`, and its scale 2^-126 a normal float32); 1
    for all-zero groups; NaN for groups whose amax is NaN or inf. The scale is 1 / m correctly
    rounded to float32.

    The one definition for the reference (`quantize`) and the GEMM operand quantizers
    (kernels/operand.py), written in forms that compile to the same bits: the quotient in
    float64 rounded once (`exact.div_rn`), the special groups by arithmetic rather than
    `torch.where` constants (kernels/operand.py's module docstring says why).
    """
    _check_fmt_max(fmt_max)
    amax = amax.float()
    zero = (amax == 0).to(amax.dtype)
    m = div_rn(torch.full_like(amax, fmt_max), amax.clamp(min=fmt_max / _INV_MULTIPLIER_MAX))
    # zero groups: 2^126 * 0 + 1 (both exact); `amax - amax` is NaN where amax is inf or NaN
    m = m * (1.0 - zero) + zero + (amax - amax)
    return m, div_rn(torch.ones_like(m), m)


E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
_E8M0_LO, _E8M0_HI = math.ldexp(1.0, E8M0_MIN_EXP), math.ldexp(1.0, E8M0_MAX_EXP)
_FP32_MAX_POW2 = math.ldexp(1.0, 127)


def e8m0_max(fmt_max: float) -> float:
    """The largest E8M0 scale for elements of largest magnitude `fmt_max`: 2^(127 - emax),
    emax = floor(log2 fmt_max) (2^125 for E2M1), at most 2^127.

    OCP MX's shared exponent `floor(log2 amax) - emax` never exceeds 127 - emax for float32
    input; the ceiling `pow2_ceil(amax / fmt_max)` can be one more (2^126 for E2M1 at amax >
    6 * 2^125), and a value that rounds up to 4 then decodes to 4 * 2^126 = inf. Capped, such
    a group's values saturate to +-fmt_max instead, and `fmt_max * scale` is always finite.
    """
    _check_fmt_max(fmt_max)
    emax = math.frexp(fmt_max)[1] - 1  # fmt_max = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
    return min(_E8M0_HI, math.ldexp(1.0, 127 - emax))


def represent_scale(
    raw_scale: torch.Tensor, scale_format: ScaleFormat, tensor_amax: torch.Tensor, fmt_max: float
) -> torch.Tensor:
    """Turn raw fp32 scales (`group_amax / fmt.max`, positive) into `scale_format`'s values.

    `tensor_amax` is only used by the two-level e4m3 format.
    """
    name = get_scale_format(scale_format).name
    if name == "fp32":
        return raw_scale
    if name == "inv":
        raise ValueError("the 'inv' scale format is formed from amax: see inv_scales")
    if name == "pow2":
        # 2^128 is inf in float32; the cap only matters for formats with max < 2 (E1M2), whose
        # largest groups then saturate on the grid instead of dividing by an infinite scale.
        return pow2_ceil(raw_scale).clamp(max=_FP32_MAX_POW2)
    if name == "e8m0":
        return pow2_ceil(raw_scale).clamp(_E8M0_LO, e8m0_max(fmt_max))
    # e4m3 block scale under an fp32 tensor scale chosen so the largest block scale is 448.
    e4m3 = get("e4m3")
    tensor_amax = tensor_amax.float()  # divide by a tensor: see quantize()
    tensor_scale = tensor_amax / torch.full_like(tensor_amax, fmt_max * e4m3.max)
    tensor_scale = torch.where(tensor_scale > 0, tensor_scale, torch.ones_like(tensor_scale))
    block = e4m3.round(raw_scale / tensor_scale)
    # A block scale that underflows to 0 would divide by zero: floor it at E4M3's smallest value.
    block = block.clamp(min=float(e4m3.grid[1]))
    return block * tensor_scale
