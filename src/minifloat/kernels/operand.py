"""GEMM operand quantization in plain PyTorch: the emulation eagerly, the GPU fast path compiled.

`quantize_operand` computes exactly what `minifloat.quantize.quantize` computes for the formats
and granularities the quantized GEMMs use (E2M1, E4M3, E5M2; tensor, row, 1 x bc and br x bc
blocks; fp32 and "inv" scales, and power-of-two ones for tensor and row groups;
round-to-nearest-even),
bit for bit, and stores the values in the FP8 byte
that feeds `torch._scaled_mm` (E2M1 values ride exactly in E4M3). It is written with ops that
inductor fuses (abs, amax, where, round, casts), so under `torch.compile` the quantizer becomes
one or two memory passes fused with whatever produced its input (a norm, an activation, a
residual), which is where the speed of FP8 training comes from (DESIGN.md "The fast path").

Pinned forms, so that compiled code equals eager code bit for bit:
- Quotients x / s through `minifloat.exact.div_rn_by_scale` (float64, rounded once): the
  correctly rounded float32 quotient the reference computes, whatever division inductor emits,
  with the scales' reciprocals computed once per group rather than per element. (Subnormal
  quotients may differ in their last bit; every format here rounds them to zero either way.)
  Power-of-two scales divide as float32 products by powers of two (`div_by_pow2`): exact, and
  no float64 per element. "inv" scales quantize by one float32 product, `x * m`, which is the
  definition (`formats.inv_scales`): the same bits in every compiled form.
- Grid rounding by adding and subtracting a power of two (E2M1, `_e2m1_magnitude`), or the
  saturating FP8 cast (E4M3/E5M2: round-to-nearest-even in ATen's CPU and CUDA casts and in
  Hopper's `cvt.rn.satfinite`), after a clamp to ±max only where a quotient can pass it by
  more than rounding (`round_to_storage`).

Few graph nodes. AOTAutograd's partitioner will not recompute in backward the end of a chain of
fusible forward ops that runs more than 100 graph nodes past its start ("ban if long fusible
chains"); it saves that tensor instead. At 1.3B the chain from the gate GEMM's output through
the SwiGLU to the down projection's E2M1 input holds two quantizers (the up projection's weight
and that input), and one more node in each was enough to save the input (+2 GiB;
docs/hopper_sessions.md, sessions 22 and 23). So the scales are formed with additions rather
than `torch.where`s, and the E2M1 spacing from the exponent bits.

`pack_e2m1` / `unpack_e2m1` store E2M1 values two per byte (the saved activation of fp4 recipes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minifloat import formats
from minifloat.exact import div_rn, div_rn_by_scale, written_once
from minifloat.formats import inv_scales
from minifloat.kernels import clip as occ_clip
from minifloat.quantize import Granularity

__all__ = [
    "FP8_STORAGE",
    "supports",
    "quantize_operand",
    "scale_from_amax",
    "times_multiplier",
    "row_amax",
    "abs_amax",
    "magnitude_bits",
    "from_magnitude_bits",
    "round_to_storage",
    "e2m1_values",
    "pack_e2m1",
    "unpack_e2m1",
]

# Element formats with a fast path, and the float8 dtype holding their values exactly.
FP8_STORAGE: dict[str, torch.dtype] = {
    "e2m1": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
_FP32_TINIEST = 2.0**-149  # the reference's floor of a positive group's scale


def supports(fmt: str, granularity: Granularity, scale_format: str, rounding: str) -> bool:
    """Whether `quantize_operand` covers this operand spec (else use `quantize.quantize`)."""
    if fmt not in FP8_STORAGE or rounding != "nearest":
        return False
    if scale_format == "pow2":
        return granularity in ("tensor", "row")
    return scale_format in ("fp32", "inv") and (
        granularity in ("tensor", "row") or isinstance(granularity, tuple)
    )


def scale_from_amax(amax: torch.Tensor, fmt_max: float, *, pow2: bool = False) -> torch.Tensor:
    """Dequantization scales `amax / fmt_max` of absmax groups, float32, as `quantize()` sets them.

    Positive groups: the correctly rounded float32 quotient (`exact.div_rn`), floored at the
    smallest positive float32, with `pow2` the least power of two above it (scale format
    "pow2"); all-zero groups: 1; groups whose amax is NaN or inf: NaN.
    """
    raw = div_rn(amax, torch.full_like(amax, fmt_max)).clamp(min=_FP32_TINIEST)
    if pow2:
        raw = pow2_ceil(raw)
    # Written with additions, not `torch.where`s (fewer graph nodes: the module docstring):
    # an all-zero group's raw is the floor, and floor + 1 rounds to 1; `amax - amax` is 0 where
    # amax is finite and NaN where it is inf or NaN (not a NaN literal: NaN != NaN defeats the
    # compiler's common-subexpression elimination, and the layers that share an input (q/k/v,
    # gate/up) would each quantize and save it again).
    return raw + (amax == 0).to(raw.dtype) + (amax - amax)


def pow2_ceil(raw: torch.Tensor) -> torch.Tensor:
    """`formats.pow2_ceil` of positive float32 `raw`, subnormals included, by bit operations on
    its float64 value (exact in every compiled form; frexp/ldexp lower to pow/exp2 on GPUs).
    Carrying the mantissa into the exponent rounds up to a power of two. NaN and inf in:
    garbage out, which `scale_from_amax` replaces."""
    mantissa = (1 << 52) - 1
    bits = raw.double().view(torch.int64)
    return ((bits + mantissa) & ~mantissa).view(torch.float64).float()


def div_by_pow2(v: torch.Tensor, scale: torch.Tensor, *, in_graph: bool = False) -> torch.Tensor:
    """v / scale for float32 power-of-two scales in [2^-149, 2^126] (NaN: NaN), as two float32
    products by powers of two. Each is exact unless its result falls below 2^-126, and then
    the quotient does too, which every format here rounds to zero, exact or not: the same
    grid values as `div_rn_by_scale`, with float32 arithmetic per element instead of float64.
    Two factors because 1 / scale alone exceeds float32's range for scales below 2^-127.
    `in_graph`: per-group factors are computed once per group (`exact.div_rn_by_scale`)."""
    r = scale.double().reciprocal()  # a power of two: exact
    f1, f2 = r.clamp(max=2.0**100).float(), (r * 2.0**-100).clamp(min=1.0).float()
    if in_graph and scale.numel() > 1 and torch.compiler.is_compiling():
        f1, f2 = written_once(f1), written_once(f2)
    return v * f1 * f2


def times_multiplier(
    v: torch.Tensor, amax: torch.Tensor, fmt_max: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """("inv" scale format) `(v * m, m, 1 / m)` with `formats.inv_scales(amax, fmt_max)`:
    the values before rounding, the multipliers and the scales. Under compile they are stored
    once (`written_once`), by the kernel that finishes the amax. Inlined, every element that
    reads a group's multiplier would compute its float64 quotient again (the cast here, and
    the backward's folds of the scales into dy, `prescale`: that cost fp4-dge 9 ms a 1.3B step,
    docs/hopper_sessions.md, session 38), and every thread of a cast would compute a tensor's
    single one from the amax: a float64 division and the zero and NaN terms of
    `formats.inv_scales`, in every thread of casts bound by their instructions. Stored,
    fp8-tensorwise ran 2.0-2.8 ms a 1.3B step faster (session 62)."""
    m, scale = inv_scales(amax, fmt_max)
    if torch.compiler.is_compiling():
        m, scale = written_once(m), written_once(scale)
    return v * m, m, scale


def _e2m1_magnitude(mag: torch.Tensor) -> torch.Tensor:
    """float32 `mag` in [0, 6] (or NaN) rounded to the nearest E2M1 magnitude, ties to even
    (the float32 just above 6, which unclamped "inv" quotients reach, rounds to 6 as well).

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]. With C = 2^23 x the spacing
    at `mag` (2^22, 2^23 or 2^24, built from the exponent bits), the float32 sum mag + C has
    exactly that spacing as its unit in the last place, so the addition rounds mag to a
    multiple of it, ties to even, and subtracting C again is exact: `round(mag / spacing) *
    spacing` in two additions. Every E2M1 quantizer runs this per element: against the
    product by 1/spacing, `round` and the product back it is the same bits (every float32 in
    [0, 6] checked, docs/hopper_sessions.md, session 52) and 1-2 % faster in a compiled cast
    (`benchmarks/fold_probe.py`). No compiler here reassociates (mag + C) - C: inductor's C++
    is built without unsafe math, and Triton does not reassociate. Few graph nodes (module
    docstring), and no `torch.where` constants, which every quantizer of a compiled graph
    shares: the partitioner's "used above/below fusible" rule then banned recomputing the
    later quantizers in backward, so it saved their E2M1 operands."""
    exponent = (mag.view(torch.int32) >> 23).clamp(127, 129)  # 2^0 .. 2^2 binades (NaN: 2^2)
    c = ((exponent + 22) << 23).view(torch.float32)
    return (mag + c) - c


def e2m1_values(q: torch.Tensor, *, saturate: bool = True) -> torch.Tensor:
    """float32 `q` rounded onto E2M1's grid, ties to even, as float32: the values
    `round_to_storage(q, "e2m1", saturate=saturate)` stores, exact in its E4M3 bytes where
    saturated or |q| <= 6 (1 + 2^-24) (the "inv" casts, `round_to_storage`). For
    callers that compute with the values next (OCC's joint operand and fold): reading them
    back from the bytes costs a conversion each way an element in kernels bound by their
    instructions."""
    mag = q.abs().clamp(max=6.0) if saturate else q.abs()
    return torch.copysign(_e2m1_magnitude(mag), q)


def round_to_storage(q: torch.Tensor, fmt: str, *, saturate: bool = True) -> torch.Tensor:
    """Round float32 `q` (already divided by its scale) onto `fmt`'s grid, saturating at ±max,
    ties to even; the result in `FP8_STORAGE[fmt]`. NaN stays NaN.

    `saturate=False` leaves out the clamp to ±max, for callers whose |q| cannot exceed the
    float32 just above max: the "inv" scale format's groups whose amax is the maximum of the
    very values cast, where |x * m| <= RN32(amax * RN32(max / amax)) <= RN32(max * (1 +
    2^-24)), and m <= max / amax where it is capped (`formats.inv_scales`). Every cast here
    rounds that float32 to max (the next grid value, or overflow, starts far above it): the
    same bits, one clamp fewer. Scales rounded the other way (the "fp32" and "pow2" formats,
    whose subnormal quotients may round down far below amax / max) keep it, and so does OCC's
    remainder, whose row maxima skip non-finite entries (`kernels/clip.py`).

    Why bother: inductor writes `clamp`'s bounds as NaN-propagating compares and selects
    (four instructions an element), and a scaled FP8 cast with them ran at 89-92 % of copy
    bandwidth, ~100 % without, at 16384 x 4096 and 16384 x 11008 on an H200: these casts are
    bound by their instructions (docs/hopper_sessions.md, session 58). So the FP8 bounds that
    remain are plain compare-selects (with OCC's clamped part cast unclamped, fp4 1.4-1.8 ms a
    1.3B step faster, session 73). E2M1's stays a clamp: as a select with a literal it made the
    compiled fp4 block save its E4M3 operands rather than recompute them (session 72;
    tests/test_transpose.py checks it)."""
    if fmt == "e2m1":
        return e2m1_values(q, saturate=saturate).to(FP8_STORAGE[fmt])
    if saturate:
        # Two compare-selects, NaN passing through both (a compare with NaN is false): the
        # clamp's bits, without its NaN-propagating form's two extra instructions an element
        # (a select-clamped E4M3 cast ran 67.1 against 73.7 us at 16384 x 5632, session 72)
        fmt_max = formats.get(fmt).max
        q = torch.where(q > fmt_max, fmt_max, torch.where(q < -fmt_max, -fmt_max, q))
    return q.to(FP8_STORAGE[fmt])


def _quantize_blocks(
    v: torch.Tensor, fmt: str, block: tuple[int, int], inv: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scale [ceil(R/br), ceil(C/bc)]) of 2-D float32 v in br x bc blocks (`inv`:
    the "inv" scale format)."""
    (r, c), (br, bc) = v.shape, block
    pad_r, pad_c = -r % br, -c % bc
    if pad_r or pad_c:  # zeros never change a block's amax
        v = F.pad(v, (0, pad_c, 0, pad_r))
    blocks = v.reshape(v.shape[0] // br, br, v.shape[1] // bc, bc)
    amax = abs_amax(blocks, dim=(1, 3))
    if inv:
        q, _, scale = times_multiplier(blocks, amax[:, None, :, None], formats.get(fmt).max)
        scale = scale[:, 0, :, 0]
    else:
        scale = scale_from_amax(amax, formats.get(fmt).max)
        q = div_rn_by_scale(blocks, scale[:, None, :, None], in_graph=True)
    return round_to_storage(q.reshape(v.shape)[:r, :c], fmt, saturate=not inv), scale


def quantize_operand(
    x: torch.Tensor,
    fmt: str,
    granularity: Granularity,
    *,
    clip: tuple[torch.Tensor, torch.Tensor] | None = None,
    remainder: bool = False,
    prescale: torch.Tensor | None = None,
    transpose: bool = False,
    scale: torch.Tensor | None = None,
    scale_format: str = "fp32",
    with_multiplier: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Quantize a 2-D GEMM operand: clip -> * prescale -> transpose -> absmax-quantize.

    Args:
        x: [R, C] floating tensor (any float dtype; computed in float32).
        fmt: "e2m1", "e4m3" or "e5m2".
        granularity: "tensor", "row" (one scale per row of the operand, i.e. along the GEMM's
            contraction dim) or a block shape (br, bc), relative to the (transposed) operand.
        clip: OCC's (lo, hi) bounds: finite entries are clamped to them first.
        remainder: with `clip`, quantize OCC's remainder x - clamp(x) instead of clamp(x).
        prescale: a [R, 1] or [1, C] multiplier applied before quantizing (folded row scales).
        transpose: quantize x.t(): values [C, R], a transposed view of a contiguous [R, C]
            tensor (see `_layout`).
        scale: a given [1, 1] tensor scale (delayed scaling) instead of the absmax one.
        scale_format: "fp32", "pow2" (tensor and row groups: each scale the least power of
            two at or above the fp32 one) or "inv" (values x * m, scales 1 / m, with
            m and 1 / m from `formats.inv_scales(amax, fmt.max)`).
        with_multiplier: also return the "inv" multipliers m (scale's shape; None for other
            scale formats and for blocks), for DGE (`QOperand.multiplier`).
    Returns:
        (values, scale): values on the grid in `FP8_STORAGE[fmt]`; scale float32,
        [1, 1] (tensor), [rows, 1] (row) or [ceil(rows/br), ceil(cols/bc)] (blocks).
        `with_multiplier`: (values, scale, multiplier).
    """
    _check_operand(x, fmt, granularity, scale)
    values, scale, m = _quantize(
        x, fmt, granularity, clip, remainder, prescale, transpose, scale, scale_format
    )
    return (values, scale, m) if with_multiplier else (values, scale)


def _check_operand(x: torch.Tensor, fmt: str, granularity: Granularity, scale) -> None:  # noqa: ANN001
    """quantize_operand's one-line errors. Checks of the arguments' types and shapes only:
    under torch.compile they run once, while tracing, and cost the compiled code nothing.
    (Values are the caller's contract: clip bounds in order, a positive given scale.)"""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"quantize_operand takes a floating-point tensor, got {what}")
    # (empty operands pass: an FSDP rank may hold no rows of a small weight)
    if x.dim() != 2:
        raise ValueError(f"quantize_operand takes a 2-D [R, C] operand, got {tuple(x.shape)}")
    if fmt not in FP8_STORAGE:
        raise ValueError(
            f"quantize_operand formats are {', '.join(FP8_STORAGE)}, got {fmt!r} "
            "(minifloat.quantize takes the others)"
        )
    block = isinstance(granularity, tuple) and len(granularity) == 2
    if block and not all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in granularity
    ):
        block = False
    if granularity not in ("tensor", "row") and not block:
        raise ValueError(
            "operand granularity must be 'tensor', 'row' or a block (rows, cols) of positive "
            f"ints, not {granularity!r}"
        )
    if scale is not None and not isinstance(scale, torch.Tensor):
        raise TypeError(f"a given scale must be a tensor, got {type(scale).__name__}")


def _quantize(
    x: torch.Tensor,
    fmt: str,
    granularity: Granularity,
    clip: tuple[torch.Tensor, torch.Tensor] | None,
    remainder: bool,
    prescale: torch.Tensor | None,
    transpose: bool,
    scale: torch.Tensor | None,
    scale_format: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`quantize_operand`'s (values, scale, "inv" multipliers or None)."""
    v = x.float()
    # The amaxes read x in its own dtype unless something changes it first: |x| and max are
    # exact in every float dtype, and under torch.compile the amax and the cast then share x
    # (bf16: 2 bytes an element) rather than its float32 copy, which inductor wrote out for
    # them (4 bytes; rope backward's dq and dk at 1.3B, session 20).
    src = x
    if remainder and clip is None:
        raise ValueError("quantizing OCC's remainder needs its clip bounds")
    if clip is not None:
        v = src = (occ_clip.remainder if remainder else occ_clip.clamp)(v, *clip)
    if prescale is not None:
        v = src = v * prescale.float()
    if scale_format not in ("fp32", "pow2", "inv"):
        raise ValueError(f"scale_format must be 'fp32', 'pow2' or 'inv', got {scale_format!r}")
    pow2, inv = scale_format == "pow2", scale_format == "inv"
    if pow2 and (scale is not None or granularity not in ("tensor", "row")):
        raise ValueError("power-of-two scales come from the operand's tensor or row maxima")
    if inv and scale is not None:
        raise ValueError("'inv' scales come from the operand's own maxima, not a given scale")
    if scale is not None:
        if granularity != "tensor":
            raise ValueError("a given (delayed) scale needs tensor granularity")
        scale = scale.float().reshape(1, 1)
        q = div_rn_by_scale(v, scale)
        # A scale from past steps would saturate ±inf to ±max: an infinite quotient (a
        # non-finite entry, or one over 2^128 times the scale) becomes NaN instead, as a NaN
        # group scale makes it elsewhere, so that a step guard sees it. Written from q alone
        # (q - q is 0 or NaN): a mask from v made the compiled fp8-delayed block save v and
        # the mask (tests/test_recompute.py).
        values = round_to_storage(q * ((q - q) + 1.0), fmt)
        return _layout(values, transpose), scale, None
    # A transposed operand is quantized in x's own layout, where its groups are columns or
    # column blocks, and written transposed at the end: the reductions then read rows of x
    # (coalesced) instead of columns of a transposed view.
    if isinstance(granularity, tuple):
        block = granularity[::-1] if transpose else granularity
        values, s = _quantize_blocks(v, fmt, block, inv)
        return _layout(values, transpose), (s.t().contiguous() if transpose else s), None
    if granularity == "tensor":
        amax = abs_amax(src).reshape(1, 1)
    elif granularity == "row" and clip is not None and prescale is None and not transpose:
        # from x's row extrema, so that compiled, the clamped x or its remainder has the cast
        # as its only reader and is not written out (kernels/clip.py)
        amax = (occ_clip.remainder_row_amax if remainder else occ_clip.clamped_row_amax)(x, *clip)
    elif granularity == "row":
        amax = (_column_amax(src) if transpose else row_amax(src)).float()
    else:
        raise ValueError(
            f"operand granularity must be 'tensor', 'row' or a block, not {granularity!r}"
        )
    m = None
    if inv:
        q, m, s = times_multiplier(v, amax, formats.get(fmt).max)
    else:
        s = scale_from_amax(amax, formats.get(fmt).max, pow2=pow2)
        q = div_by_pow2(v, s, in_graph=True) if pow2 else div_rn_by_scale(v, s, in_graph=True)
    # OCC's remainder keeps the clamp: its row maxima skip non-finite entries, so its values
    # may exceed them (`round_to_storage`). The clamped part's maxima are those of the very
    # values cast (NaN or inf where one is, `kernels/clip.py`): "inv" casts it unclamped.
    values = round_to_storage(q, fmt, saturate=not inv or remainder)
    if transpose:
        s, m = s.t().contiguous(), (None if m is None else m.t().contiguous())
    return _layout(values, transpose), s, m


def _layout(values: torch.Tensor, transpose: bool) -> torch.Tensor:
    """The operand's values: x's layout computed, returned as a transposed *view* if asked.

    Transposed values are never written here: the consumer that needs them contiguous (the
    GEMM, or a later transposition) copies them: eagerly in a kernel of its own, under
    torch.compile as a store of the cast's kernel (`hopper._row_major`). Writing the transposed
    copy while quantizing let inductor fuse that store into a row reduction, whose tiles are a
    few rows by a whole row wide: byte stores with a stride of a whole column, ~10x slower.
    """
    values = values.contiguous()
    return values.t() if transpose else values


_MAGNITUDE_MASK = {torch.int64: 0x7FFFFFFFFFFFFFFF, torch.int32: 0x7FFFFFFF, torch.int16: 0x7FFF}
_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def magnitude_bits(v: torch.Tensor) -> torch.Tensor:
    """|v|'s bits as an integer of v's width (v float64, float32, bfloat16 or float16): v's
    bits with the sign cleared. As integers these order as the magnitudes do, ±inf above
    every finite value and NaN above inf, so their maximum is the bits of max |v|, NaN
    wherever a NaN is (`from_magnitude_bits`).

    Why: a float maximum must propagate NaN, which inductor's Triton code does with a compare,
    a NaN test, an or and a select an element (`triton_helpers.maximum`), after the abs; the
    integer form is an and and a max. Quantizer kernels are bound by their instructions on an
    H200, not their bytes (docs/hopper_sessions.md, session 58)."""
    if v.dtype not in _SAME_WIDTH_INT:
        raise TypeError(f"maxima of {v.dtype} values are not supported; use a float type")
    itype = _SAME_WIDTH_INT[v.dtype]
    return v.view(itype) & _MAGNITUDE_MASK[itype]


def from_magnitude_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 magnitudes that `magnitude_bits` (of a `dtype` tensor) encoded."""
    return bits.view(dtype).float()


def abs_amax(
    v: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False
) -> torch.Tensor:
    """`v.abs().amax(dim, keepdim)` in float32 (all of v without `dim`), through
    `magnitude_bits`: the same values, NaN where the reduced entries hold one (its payload may
    differ; no result here depends on a NaN's payload)."""
    bits = magnitude_bits(v)
    bits = bits.amax() if dim is None else bits.amax(dim=dim, keepdim=keepdim)
    return from_magnitude_bits(bits, v.dtype)


def row_amax(v: torch.Tensor, cols_per_partial: int = 256) -> torch.Tensor:
    """|v|.amax over columns, [R, 1] float32, in two stages for long rows (`clip.row_reduce`),
    over `magnitude_bits`."""
    bits = occ_clip.row_reduce(magnitude_bits(v), torch.amax, cols_per_partial)
    return from_magnitude_bits(bits, v.dtype)


def _column_amax(v: torch.Tensor, rows_per_partial: int = 256) -> torch.Tensor:
    """|v|.amax over rows, [1, C] float32, in two stages over `magnitude_bits`: partial maxima
    of row bands (each reading whole rows, coalesced, with many bands in flight), then the
    maximum of the partials. Max is order-independent, so this equals a one-stage reduction bit
    for bit.

    Bands of 256 rows, not 64: inductor makes a reduction over at most 64 elements that are not
    contiguous in memory a persistent one, the band held in registers
    (`should_use_persistent_reduction` in torch/_inductor/choices.py), and at 1.3B the SwiGLU
    backward's three column maxima ran at ~1 TB/s that way (0.57 ms a layer); as a looped
    reduction over 256-row bands, 0.20 ms. fp8-rowwise at 1.3B: 250.7 -> 240.4 ms a step
    (docs/hopper_sessions.md, session 25)."""
    r, bits = v.shape[0], magnitude_bits(v)
    if occ_clip.one_stage(r, rows_per_partial):
        return from_magnitude_bits(bits.amax(dim=0, keepdim=True), v.dtype)
    bands = bits.reshape(r // rows_per_partial, rows_per_partial, v.shape[1]).amax(dim=1)
    return from_magnitude_bits(bands.amax(dim=0, keepdim=True), v.dtype)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values (any float dtype, e.g. their E4M3 storage) [R, C] -> uint8 [R, ceil(C/2)].

    Codes are sign << 3 | grid index (OCP MX FP4, `torch.float4_e2m1fn_x2`), the first element of
    each pair in the low nibble. NaN has no code: it packs as 0 (a NaN group's scale keeps it
    non-finite). Values off the E2M1 grid pack to a wrong code unchecked: the quantizers' output
    is on it, and a check would be one more pass in the hot path (`packing.pack_values` checks).
    """
    v = values.float()
    mag = v.abs()
    # grid index of |v| in {0, .5, 1, 1.5, 2, 3, 4, 6}: 2|v| below 2, |v| + 2 up to 3, |v|/2 + 4
    index = torch.where(mag < 2.0, mag * 2.0, torch.where(mag < 4.0, mag + 2.0, mag * 0.5 + 4.0))
    code = torch.where(torch.isnan(v), 0.0, index + torch.signbit(v).float() * 8.0)
    code = code.to(torch.uint8)
    if code.shape[-1] % 2:
        code = F.pad(code, (0, 1))
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of `pack_e2m1`: float8_e4m3fn values [R, cols]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[..., :cols]
    index = (codes & 0x7).float()
    mag = torch.where(
        index < 4.0, index * 0.5, torch.where(index < 6.0, index - 2.0, index * 2.0 - 8.0)
    )
    return torch.where((codes & 0x8) != 0, -mag, mag).to(torch.float8_e4m3fn)
