"""Absmax quantization onto an element format's grid: `quantize`, `fake_quantize`, `QTensor`.

This is the reference path every fast kernel is checked against bit-exactly. A tensor is split
into groups (the whole tensor, rows, columns or 2-D blocks); each group gets one dequantization
multiplier `scale = amax / fmt.max` (represented in a scale format), and each element becomes
`round(x / scale)` on the grid, so that `x ≈ values * scale`. The "inv" scale format (the named
recipes' default) multiplies instead: `round(x * m)`, m = fmt.max / amax rounded to float32,
scale = 1 / m (`formats.inv_scales`).

Non-finite input is never made finite: a group holding NaN or ±inf gets a NaN scale and NaN
values, so a downstream step guard sees the problem instead of a silently clipped number.
Finite input is never made non-finite: dequantized results saturate to the output dtype's finite
range (see `QTensor.dequantize`). Quantizing computes in float32, so float64 input with finite
values beyond float32's range is refused.

Scale shapes: `QTensor.scale` is compact, one entry per group. For "tensor" it is [1, ..., 1]
(x.dim() ones), for "row" [..., R, 1], for "column" [..., 1, C]: all three broadcast against x.
For a block shape (br, bc) it is [..., ceil(R/br), ceil(C/bc)] (a 1-D x counts as one row, giving
[1, ceil(C/bc)]), which does not broadcast; `QTensor.expand_scale()` gives the per-element scale.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minifloat import formats
from minifloat.formats import ElementFormat, ScaleFormat

__all__ = [
    "Granularity",
    "QTensor",
    "PackedQTensor",
    "quantize",
    "fake_quantize",
    "normalize_granularity",
    "group_amax",
    "expand_scale",
    "tensor_quantiles",
    "interpolate",
]

Granularity = str | tuple[int, int]
_NAMED_GRANULARITIES = ("tensor", "row", "column")
_VALID_GRANULARITIES = (
    "'tensor', 'row', 'column', or a block shape tuple of two positive ints such as (1, 16), "
    "(1, 32), (1, 128), (16, 16), (128, 128)"
)
# Smallest positive float32 (a subnormal): the floor of a raw scale whose group amax is positive.
_FP32_TINIEST = 2.0**-149


def normalize_granularity(granularity: Granularity) -> Granularity:
    """Validate a granularity: "tensor", "row", "column", or a block shape (rows, cols)."""
    if isinstance(granularity, str) and granularity in _NAMED_GRANULARITIES:
        return granularity
    if (
        isinstance(granularity, tuple | list)
        and len(granularity) == 2
        # bool is an int subclass, but (True, 16) is a typo, not a block of one row
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in granularity)
    ):
        return (int(granularity[0]), int(granularity[1]))
    raise ValueError(f"unknown granularity {granularity!r}; valid: {_VALID_GRANULARITIES}")


def _as_matrix(x: torch.Tensor) -> torch.Tensor:
    """View 1-D tensors as one row so row/column/block logic always sees [..., R, C]."""
    return x.unsqueeze(0) if x.dim() == 1 else x


def _fitted_block(block: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """`block` with each side at most the data's (at least 1): the same groups and scale shape,
    since a block as large as a dim is one group along it either way, without padding the data
    to the block (a block of 2**40 columns would allocate terabytes of zeros)."""
    return max(1, min(block[0], rows)), max(1, min(block[1], cols))


def _pad_to_blocks(x2: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = x2.shape[-2:]
    pad_r, pad_c = (-rows) % block[0], (-cols) % block[1]
    if pad_r or pad_c:  # zeros never change a block's amax
        x2 = torch.nn.functional.pad(x2, (0, pad_c, 0, pad_r))
    return x2


def _amax(a: torch.Tensor, dims: tuple[int, ...], *, keepdim: bool) -> torch.Tensor:
    """`a.amax(dims)`, except that an empty `a` gives zeros (empty groups count as all-zero)."""
    if a.numel() > 0:
        return a.amax(dim=dims, keepdim=keepdim)
    shape = list(a.shape)
    for d in sorted((d % a.dim() for d in dims), reverse=True):
        if keepdim:
            shape[d] = 1
        else:
            del shape[d]
    return a.new_zeros(shape)


def group_amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Absolute maximum of each group, in float32, NaN-propagating (empty groups give 0).

    Shapes: tensor -> all-ones dims; row -> [..., R, 1]; column -> [..., 1, C]; block (br, bc)
    -> [..., ceil(R/br), ceil(C/bc)] (1-D inputs are treated as a single row).
    """
    a = x.detach().float().abs()
    if granularity == "tensor":
        return _amax(a, tuple(range(a.dim())), keepdim=True)
    if granularity == "row":
        return _amax(a, (-1,), keepdim=True)
    if granularity == "column":
        if x.dim() < 2:
            raise ValueError("column granularity needs a tensor with at least 2 dims")
        return _amax(a, (-2,), keepdim=True)
    a2 = _as_matrix(a)
    br, bc = _fitted_block(granularity, *a2.shape[-2:])
    a2 = _pad_to_blocks(a2, (br, bc))
    lead, (rp, cp) = a2.shape[:-2], a2.shape[-2:]
    blocks = a2.reshape(*lead, rp // br, br, cp // bc, bc)
    return _amax(blocks, (-3, -1), keepdim=False)


def expand_scale(scale: torch.Tensor, shape: torch.Size, granularity: Granularity) -> torch.Tensor:
    """A per-element view (or copy, for blocks) of group scales, of the data's `shape`."""
    if not isinstance(granularity, tuple):
        return scale.expand(shape)
    rows = 1 if len(shape) == 1 else shape[-2]
    cols = shape[-1]
    br, bc = _fitted_block(granularity, rows, cols)
    full = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    full = full[..., :rows, :cols]
    return full.reshape(shape)


def tensor_quantiles(x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The [1-alpha, alpha] quantiles of the finite entries of x (linear interpolation).

    Matches `torch.quantile`'s default but works on any size and ignores non-finite entries.
    """
    return _quantiles(x.detach().float().flatten(), (1.0 - alpha, alpha))


def _quantiles(
    flat: torch.Tensor, qs: tuple[float, ...], *, select: str = "auto"
) -> tuple[torch.Tensor, ...]:
    """Linearly interpolated quantiles of the finite entries of 1-D float32 `flat` (NaN if none).

    `select`: "kthvalue" (a selection per order statistic, fastest on CPU), "sort" (one sort
    for all of them, with static shapes throughout: CUDA's kthvalue runs one thread block per
    slice, ~20x slower than a sort on a long 1-D tensor, pytorch/pytorch#75599, and dropping the
    non-finite entries first would give torch.compile a data-dependent shape), or "auto" (sort
    on CUDA and under torch.compile). Both give the same values: an order statistic does not
    depend on how it is found.
    """
    if select == "auto":
        select = "sort" if flat.is_cuda or torch.compiler.is_compiling() else "kthvalue"
    if select not in ("sort", "kthvalue"):
        raise ValueError(f"select must be 'auto', 'sort' or 'kthvalue', got {select!r}")
    if flat.numel() == 0:
        nan = torch.tensor(float("nan"), device=flat.device)
        return tuple(nan for _ in qs)
    if select == "sort":
        return _quantiles_by_sort(flat, qs)
    finite = flat[torch.isfinite(flat)]
    if finite.numel() == 0:
        nan = torch.tensor(float("nan"), device=flat.device)
        return tuple(nan for _ in qs)
    n = finite.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = int(pos)
        frac = torch.tensor(pos - lo, dtype=torch.float32, device=flat.device)
        v_lo = torch.kthvalue(finite, lo + 1).values
        if frac == 0 or lo + 1 >= n:
            out.append(v_lo)
        else:
            out.append(interpolate(v_lo, torch.kthvalue(finite, lo + 2).values, frac))
    return tuple(out)


def interpolate(v_lo: torch.Tensor, v_hi: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """A quantile from its two neighbouring order statistics and float32 `frac` (the fraction
    of the way from v_lo to v_hi), as `torch.quantile`'s linear interpolation; v_lo itself
    where frac is 0 (v_hi - v_lo may overflow to inf, and inf · 0 is NaN). Shared by the
    paths that find the order statistics (this module's sort, kernels/quantiles.py's select).

    The product is formed in float64 (exact: 24 x 24 bits) and rounded once to float32, which
    is float32's own product; a float32 multiply followed by the add is one that ptxas may fuse
    into an FMA in inductor's Triton code (one rounding fewer), and compiled thresholds then
    differed from eager ones in the last bit (session 67)."""
    step = ((v_hi - v_lo).double() * frac.double()).float()
    return torch.where(frac == 0, v_lo, v_lo + step)


def _quantiles_by_sort(flat: torch.Tensor, qs: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    # NaNs become +inf first: CPU's sort puts every NaN last, but on CUDA a NaN with the sign
    # bit set came first (observed, session 68: both bounds came out wrong). Then the ascending
    # sort puts -inf first and +inf last, so the finite entries are the slice [n_neg_inf,
    # n_neg_inf + n); the positions use the same float64 arithmetic as the selection path, so
    # the results are bit-identical.
    ordered = torch.sort(torch.where(flat.isnan(), float("inf"), flat)).values
    n = torch.isfinite(flat).sum()
    first = (flat == float("-inf")).sum()
    last = flat.numel() - 1
    out = []
    for q in qs:
        pos = (n - 1).double() * q
        lo = pos.floor()
        frac = (pos - lo).float()
        lo_i = lo.long().clamp(min=0)
        hi_i = torch.minimum(lo_i + 1, (n - 1).clamp(min=0))
        # index_select with a 1-element index keeps shapes static (no .item(), no graph break)
        v_lo = ordered.index_select(0, (first + lo_i).clamp(max=last).reshape(1)).squeeze(0)
        v_hi = ordered.index_select(0, (first + hi_i).clamp(max=last).reshape(1)).squeeze(0)
        value = interpolate(v_lo, v_hi, frac)
        # NaN when no entry is finite, as `ordered[last] - ordered[last]` (±inf - ±inf there:
        # NaNs are +inf by now), not a NaN literal: NaN != NaN defeats common-subexpression
        # elimination
        none = ordered[last] - ordered[last]
        out.append(torch.where(n > 0, value, none))
    return tuple(out)


@dataclass
class QTensor:
    """A quantized tensor: grid values and group scales, with `x ≈ values * scale`.

    `values` are float32 on `fmt`'s grid (unscaled) with x's shape. `scale` is float32, one entry
    per group: [1, ..., 1] for "tensor", [..., R, 1] for "row", [..., 1, C] for "column" (these
    broadcast against x); for a block shape (br, bc) it is compact, [..., ceil(R/br),
    ceil(C/bc)] ([1, ceil(C/bc)] for 1-D x), and `expand_scale()` gives it per element.
    A group that held NaN or ±inf has a NaN scale and NaN values. `multiplier`: with the "inv"
    scale format, the group multipliers m the values were rounded with (round(x * m), scale's
    shape); None otherwise.
    """

    values: torch.Tensor
    scale: torch.Tensor
    fmt: ElementFormat
    granularity: Granularity
    scale_format: ScaleFormat
    multiplier: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def expand_scale(self) -> torch.Tensor:
        """The scale of every element, x's shape."""
        return expand_scale(self.scale, self.values.shape, self.granularity)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scale, computed in float32, saturated to `dtype`'s finite range, cast to it.

        Saturation matters at the top of the range: rounding up to the next grid point, or a
        pow2/e8m0 scale above amax / fmt.max, can put a group's largest result past the largest
        finite float32 or `dtype` value (fp16 65504 quantized to E2M1 with a pow2 scale gives
        4 * 2^14 = 65536), and finite input must not come back as inf. The bound is the smaller
        of `dtype`'s and float32's largest finite values. NaN groups (input NaN or ±inf) stay NaN.
        """
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dequantize needs a floating-point dtype, got {dtype!r}")
        out = self.values * self.expand_scale()
        bound = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
        return out.clamp(-bound, bound).to(dtype)  # clamp keeps NaN

    def pack(self) -> PackedQTensor:
        """Store values in their bit width: E2M1 as `torch.float4_e2m1fn_x2` (two per byte),
        other 4-bit formats as nibble-packed uint8, E4M3/E5M2 as torch float8, INT8 as int8."""
        from minifloat.packing import pack_values

        return PackedQTensor(
            data=pack_values(self.values, self.fmt),
            scale=self.scale,
            fmt=self.fmt,
            granularity=self.granularity,
            scale_format=self.scale_format,
            shape=self.values.shape,
        )


@dataclass
class PackedQTensor:
    """`QTensor` with values stored in the format's bit width; `unpack()` restores it exactly."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: ElementFormat
    granularity: Granularity
    scale_format: ScaleFormat
    shape: torch.Size

    def unpack(self) -> QTensor:
        from minifloat.packing import unpack_values

        values = unpack_values(self.data, self.fmt, self.shape)
        # Formats without a NaN code store NaN groups as zeros; their NaN scale restores them.
        nan_group = torch.isnan(expand_scale(self.scale, self.shape, self.granularity))
        values = torch.where(nan_group, torch.full_like(values, float("nan")), values)
        return QTensor(values, self.scale, self.fmt, self.granularity, self.scale_format)


def _check_randomness(
    x: torch.Tensor, rounding: str, generator: torch.Generator | None, noise: torch.Tensor | None
) -> None:
    """The random source of stochastic rounding: a Generator, or uniforms of x's own shape
    (a broadcast one would give every element the same draw); none with "nearest", where it
    would be ignored. That the uniforms lie in [0, 1) is the caller's contract (no pass here)."""
    if rounding == "nearest" and (generator is not None or noise is not None):
        raise ValueError("generator and noise are for rounding='stochastic'; 'nearest' draws none")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if noise is None:
        return
    if not isinstance(noise, torch.Tensor) or not noise.is_floating_point():
        got = noise.dtype if isinstance(noise, torch.Tensor) else type(noise).__name__
        raise TypeError(f"noise must be a floating-point tensor of uniforms, got {got}")
    if noise.shape != x.shape:
        raise ValueError(f"noise must have x's shape {tuple(x.shape)}, got {tuple(noise.shape)}")


def _check_args(
    x: torch.Tensor,
    rounding: str,
    clip_quantile: float | None,
    generator: torch.Generator | None,
    noise: torch.Tensor | None,
) -> None:
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"quantize expects a floating-point tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("quantize expects a tensor with at least one dimension")
    # It computes in float32, where such values would be infinite and their group NaN: refused
    # rather than breaking "finite input is never made non-finite" (float64 input only).
    if x.dtype == torch.float64:
        beyond = x.isfinite() & (x.abs() > torch.finfo(torch.float32).max)
        if beyond.any():
            raise ValueError(
                "quantize computes in float32: finite float64 values beyond its range "
                f"(|x| up to {x[beyond].abs().max().item():.3g} > 3.4e38); scale them down first"
            )
    if rounding not in formats.ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {formats.ROUNDING_MODES}, got {rounding!r}")
    _check_randomness(x, rounding, generator, noise)
    if clip_quantile is None:
        return
    # bool is a numbers.Real, but clip_quantile=True is a mistake, not the quantile 1.0
    if isinstance(clip_quantile, bool) or not isinstance(clip_quantile, numbers.Real):
        raise TypeError(
            "clip_quantile must be None or a real number in the open interval (0.5, 1), "
            f"got {type(clip_quantile).__name__} {clip_quantile!r}"
        )
    if not 0.5 < float(clip_quantile) < 1.0:
        raise ValueError(
            f"clip_quantile must lie in the open interval (0.5, 1), got {clip_quantile!r}"
        )


def clip_to_quantiles(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Clamp finite entries of x to its per-tensor [1-alpha, alpha] quantiles (non-finite kept)."""
    lo, hi = tensor_quantiles(x, alpha)
    clipped = torch.clamp(x, lo.to(x.dtype), hi.to(x.dtype))
    return torch.where(torch.isfinite(x), clipped, x)


def quantize(
    x: torch.Tensor,
    fmt: str | ElementFormat,
    granularity: Granularity = "tensor",
    *,
    scale_format: str | ScaleFormat = "fp32",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    clip_quantile: float | None = None,
    noise: torch.Tensor | None = None,
) -> QTensor:
    """Quantize `x` onto `fmt`'s grid with one absmax scale per group.

    Each group's scale is `amax / fmt.max` in `scale_format` (1 for an all-zero or empty group,
    NaN for a group holding NaN or ±inf, whose values are then NaN too); values are
    `round(x / scale)` on the grid (with scale format "inv", `round(x * m)` and scale `1 / m`,
    from `formats.inv_scales(amax, fmt.max)`). An empty `x` gives empty values and scales of
    the usual shape (see `QTensor`).

    Args:
        x: floating-point tensor with at least one dim (any dtype; computed in float32).
        fmt: element format or its name ("e2m1", "e4m3", "e5m2", "int8", ...).
        granularity: "tensor", "row" (reduce over the last dim), "column" (reduce over dim -2),
            or a block shape such as (1, 32) or (128, 128); ragged edges are padded internally.
        scale_format: "fp32", "pow2", "e8m0", "e4m3" (NVFP4's block scale x fp32 tensor scale)
            or "inv" (quantized by a float32 multiplication, as torchao and Transformer Engine).
        rounding: "nearest" (ties to even, saturating) or "stochastic" (unbiased).
        generator: random source for stochastic rounding (for reproducibility).
        noise: uniforms in [0, 1) of x's shape for stochastic rounding, instead of drawing them
            (the counter-based draws of `minifloat.counter_rng`, as the FP4 recipes use).
        clip_quantile: if set to alpha, a real number in (0.5, 1), clamp x's finite entries to
            its [1-alpha, alpha] per-tensor quantiles first.

    Raises:
        TypeError: non-floating `x` or `noise`, a `generator` that is not a torch.Generator, or
            a `clip_quantile` that is not a real number.
        ValueError: unknown format, scale format, granularity or rounding, 0-dim `x`, column
            granularity on 1-D `x`, `clip_quantile` outside (0.5, 1), `noise` not of x's
            shape, `noise`/`generator` with rounding "nearest", or both of them.
    """
    _check_args(x, rounding, clip_quantile, generator, noise)
    fmt = formats.get(fmt)
    sfmt = formats.get_scale_format(scale_format)
    granularity = normalize_granularity(granularity)
    xf = x.float()
    if clip_quantile is not None:
        xf = clip_to_quantiles(xf, float(clip_quantile))

    amax = group_amax(xf, granularity)
    if sfmt.name == "inv":  # values round(x * m), scale 1 / m (formats.ScaleFormat)
        m, scale = formats.inv_scales(amax, fmt.max)
        values = fmt.round(
            xf * expand_scale(m, xf.shape, granularity),
            rounding=rounding, generator=generator, noise=noise,
        )  # fmt: skip
        return QTensor(values, scale, fmt, granularity, sfmt, multiplier=m)
    positive = amax > 0
    # Divide by a tensor, not a Python float: on CUDA, ATen turns division by a scalar into a
    # multiplication by its reciprocal, which is not correctly rounded.
    raw = torch.where(positive, amax / torch.full_like(amax, fmt.max), torch.ones_like(amax))
    # A subnormal amax can underflow to a zero scale, and 0 / 0 would turn the group's zeros
    # into NaN: floor at the smallest positive float32. Underflow means amax < max * 2^-150, so
    # x / 2^-149 still lies below max and nothing saturates.
    raw = raw.clamp(min=_FP32_TINIEST)
    # NVFP4's tensor scale comes from the finite groups, so one bad block doesn't poison the rest.
    finite_amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    tensor_amax = _amax(finite_amax, tuple(range(amax.dim())), keepdim=False)
    scale = formats.represent_scale(raw, sfmt, tensor_amax, fmt.max)
    scale = torch.where(positive, scale, torch.ones_like(scale))  # all-zero groups: scale 1
    # NaN as `amax - amax` (NaN exactly where amax is not finite): a NaN literal would defeat
    # the compiler's common-subexpression elimination (NaN != NaN)
    scale = torch.where(torch.isfinite(amax), scale, amax - amax)

    scale_full = expand_scale(scale, xf.shape, granularity)
    values = fmt.round(xf / scale_full, rounding=rounding, generator=generator, noise=noise)
    return QTensor(values, scale, fmt, granularity, sfmt)


class _StraightThrough(torch.autograd.Function):
    """Forward: `fn(x)`, exactly (computed without autograd); backward: dy unchanged.

    Rounding has a zero derivative almost everywhere, so without this a fake-quantized forward
    would give every upstream parameter a zero gradient. `x + (fn(x) - x).detach()`, the usual
    form, is not bit-exact: the difference rounds.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def fake_quantize(
    x: torch.Tensor,
    fmt: str | ElementFormat,
    granularity: Granularity = "tensor",
    *,
    scale_format: str | ScaleFormat = "fp32",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    clip_quantile: float | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """`quantize(x, ...).dequantize(x.dtype)`: x with its quantization error, in x's dtype.

    Arguments are those of `quantize`. Finite results saturate to x.dtype's finite range (see
    `QTensor.dequantize`); groups holding NaN or ±inf come back as NaN. Differentiable with the
    straight-through estimator: the gradient passes through unchanged (clipped entries too), as
    in quantization-aware training; the result's values are the same bits either way. For the
    paper's estimator of the weights' gradient (DGE) use a recipe's `QuantLinear`.
    """

    def run(t: torch.Tensor) -> torch.Tensor:
        q = quantize(
            t,
            fmt,
            granularity,
            scale_format=scale_format,
            rounding=rounding,
            generator=generator,
            clip_quantile=clip_quantile,
            noise=noise,
        )
        return q.dequantize(t.dtype)

    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, run)
    return run(x)
