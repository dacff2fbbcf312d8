"""Micro-block E2M1 operands (NVFP4, MXFP4): the quantizer and the GEMM, one PyTorch source.

`quantize_microscaled` computes exactly what `minifloat.quantize.quantize(x, "e2m1", block,
scale_format="e4m3" | "e8m0", rounding=..., noise=...)` computes, bit for bit, in the pinned forms
of kernels/operand.py (divisions by `exact.div_rn`, rounding by powers of two, `torch.round`
and FP8 casts, power-of-two ceilings by bit operations), so eager and compiled code agree. It
adds what the recipes put around the quantizer: a prescale, a transposed operand, a random
Hadamard transform along the contraction dim (minifloat/hadamard.py) and stochastic rounding
with counter-based uniforms (minifloat/counter_rng.py), both drawn from a seed tensor.

Scales. MXFP4 (e8m0): one power-of-two scale per block, `pow2_ceil(amax / 6)` clamped to
[2^-127, 2^125] (`formats.e8m0_max`). Below a block amax of 6 * 2^125 (~2.55e38) it never
saturates, so stochastic rounding needs no 3/4 pre-scaling. Above, the ceiling would be 2^126,
and a value rounded up to 4 would decode to 4 * 2^126 = inf (a finite operand, an inf or NaN
GEMM): the scale stays 2^125, OCP MX's shared exponent there, and the block's values saturate
to +-6 as OCP MX specifies, so finite input always gives finite `values * scale`. Blocks holding
NaN or +-inf keep NaN scales and values. NVFP4 (e4m3): an fp32 tensor scale
`ts = amax_tensor / (6 * 448)` and per block an E4M3 scale `b = e4m3(amax_block / 6 / ts)`; the
values are `round(x / fp32(b * ts))` as `quantize()` computes them. The operand keeps b (as
float8_e4m3fn, one byte a block) and ts apart: `QOperand.scale` = b, `QOperand.tensor_scale` = ts.

GEMM. An E2M1 value times an E4M3 or E8M0 block scale has at most 2 + 4 significant bits and an
exponent inside bf16's range, so `values * b` is exact in bf16 (tests/test_microscale.py checks
every product); times an fp32 tensor scale it is not. `dequantized_mm` therefore multiplies the
`values * b` operands (exact products, fp32 sums) and applies the tensor scales to the fp32
output, `(acc * ts_b) * ts_a`: what an FP4 tensor core with block scales computes, up to the
order of the fp32 accumulation. The emulation runs that GEMM in fp32 on the exact values; the
Hopper backend in bf16 with fp32 output (kernels/hopper.py): the numerics of FP4 at bf16 speed.
A native Blackwell path (`torch._scaled_mm` with FP4 operands and block scales) would override
`Backend.microscaled_mm`; none is claimed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minifloat import counter_rng, formats, hadamard
from minifloat.exact import div_rn, div_rn_by_scale, to_dtype
from minifloat.kernels import clip as occ_clip
from minifloat.kernels.backend import QOperand, block_scaled
from minifloat.kernels.operand import FP8_STORAGE, round_to_storage
from minifloat.quantize import expand_scale

if TYPE_CHECKING:
    from minifloat.kernels.backend import Backend
    from minifloat.recipes import OperandSpec

__all__ = [
    "SCALE_FORMATS",
    "supports",
    "is_microscaled",
    "quantize_microscaled",
    "quantize",
    "check_hadamard_size",
    "exact_bf16_values",
    "dequantized_mm",
]

SCALE_FORMATS = ("e4m3", "e8m0")
_E2M1_MAX, _E4M3_MAX, _E4M3_TINIEST = 6.0, 448.0, 2.0**-9
_FP32_TINIEST = 2.0**-149
# E8M0's least scale, and the largest whose E2M1 multiples are finite (6 * 2^125 < 2^128)
_E8M0_LO, _E8M0_E2M1_HI = 2.0**-127, formats.e8m0_max(_E2M1_MAX)


def supports(spec: OperandSpec) -> bool:
    """Whether `spec` is a micro-block E2M1 operand quantized here."""
    return (
        spec.fmt == "e2m1"
        and isinstance(spec.granularity, tuple)
        and spec.scale_format in SCALE_FORMATS
    )


def is_microscaled(q: QOperand) -> bool:
    """Whether `q` carries E4M3 or E8M0 block scales (its GEMM is `dequantized_mm`)."""
    return q.scale_format in SCALE_FORMATS


def _pow2_ceil_e8m0(raw: torch.Tensor) -> torch.Tensor:
    """`formats.pow2_ceil(raw).clamp(2^-127, 2^125)` for positive float32 raw, by bit operations
    (exact in every compiled form; frexp/ldexp lower to pow/exp2 on GPUs): the E8M0 scale of
    E2M1 blocks, `formats.represent_scale`'s. NaN in: garbage out, the caller masks it."""
    bits = raw.view(torch.int32)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    up = (exponent + (mantissa != 0).to(torch.int32)).clamp(max=255)
    normal = (up << 23).view(torch.float32)
    lo, mid = torch.full_like(raw, _E8M0_LO), torch.full_like(raw, 2.0**-126)
    subnormal = torch.where(raw <= _E8M0_LO, lo, mid)  # pow2_ceil of a subnormal is <= 2^-126
    # 2^125, not E8M0's 2^127: a block past 6 * 2^125 then saturates rather than decoding to inf
    return torch.where(exponent == 0, subnormal, normal).clamp(_E8M0_LO, _E8M0_E2M1_HI)


def _block_scales(
    amax: torch.Tensor, scale_format: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block scale b, tensor scale ts [1, 1], divisor fp32(b * ts)) of block maxima `amax`,
    with quantize()'s conventions: all-zero blocks 1, non-finite blocks NaN."""
    raw = div_rn(amax, torch.full_like(amax, _E2M1_MAX)).clamp(min=_FP32_TINIEST)
    if scale_format == "e8m0":
        block = _pow2_ceil_e8m0(raw)
        ts = torch.ones(1, 1, dtype=torch.float32, device=amax.device)
        divisor = block
    else:  # e4m3 block scale under an fp32 tensor scale that maps the largest block to 448
        finite = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        tensor_amax = finite.amax().reshape(1, 1)
        ts = div_rn(tensor_amax, torch.full_like(tensor_amax, _E2M1_MAX * _E4M3_MAX))
        ts = torch.where(ts > 0, ts, torch.ones_like(ts))
        block = div_rn(raw, ts).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn).float()
        block = block.clamp(min=_E4M3_TINIEST)
        divisor = block * ts
    positive, finite = amax > 0, torch.isfinite(amax)
    nan = amax - amax  # NaN where amax is not finite; no NaN literal (it defeats CSE)
    divisor = torch.where(finite, torch.where(positive, divisor, torch.ones_like(block)), nan)
    block = torch.where(finite, torch.where(positive, block, torch.ones_like(block)), nan)
    return block, ts, divisor


def _round_e2m1(q: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """q on the E2M1 grid in its FP8 storage: nearest-even, or stochastic with uniforms `noise`
    (`floor(|q| / step + u) * step`, the reference `FloatFormat.round`'s form)."""
    if noise is None:
        return round_to_storage(q, "e2m1")
    mag = q.abs().clamp(max=_E2M1_MAX)
    inv_step = torch.where(mag < 2.0, 2.0, torch.where(mag < 4.0, 1.0, 0.5))
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    r = (torch.floor(mag * inv_step + noise) * step).clamp(max=_E2M1_MAX)
    return torch.copysign(r, q).to(FP8_STORAGE["e2m1"])


def quantize_microscaled(
    x: torch.Tensor,
    block: tuple[int, int],
    scale_format: str,
    *,
    prescale: torch.Tensor | None = None,
    clip: tuple[torch.Tensor, torch.Tensor] | None = None,
    transpose: bool = False,
    stochastic: bool = False,
    hadamard_size: int = 0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D operand to E2M1 in `block`s: clip -> * prescale -> transpose -> rotate
    -> absmax-quantize (round to nearest even, or stochastically).

    Args:
        x: [R, C] floating tensor (computed in float32).
        block: (br, bc) relative to the (transposed) operand [rows, contraction].
        scale_format: "e4m3" (NVFP4: E4M3 block scales x an fp32 tensor scale) or "e8m0" (MX).
        prescale, clip, transpose: as in `operand.quantize_operand`.
        stochastic: stochastic rounding with `counter_rng.uniform(derive(seed, "noise"), shape)`
            (one uniform per element of the operand, row-major in its [rows, contraction] layout).
        hadamard_size: n > 0 rotates the operand along its contraction dim in blocks of n with the
            signs `counter_rng.random_signs(derive(seed, "signs"), n)` (zero-padded to a multiple
            of n: the operand then has that many more contraction columns).
        seed: 0-dim int64 tensor for the random draws (zero if None).
    Returns:
        (values, block_scale, tensor_scale): values on the E2M1 grid in float8_e4m3fn, [rows,
        contraction] (a transposed view if `transpose`); block scales [ceil(rows/br),
        ceil(contraction/bc)], float8_e4m3fn for "e4m3" (exact), float32 for "e8m0";
        tensor_scale [1, 1] float32 (1 for "e8m0").
    """
    v = x.float()
    if clip is not None:
        v = occ_clip.clamp(v, *clip)
    if prescale is not None:
        v = v * prescale.float()
    if seed is None:
        seed = torch.zeros((), dtype=torch.int64, device=v.device)
    if hadamard_size:  # along the contraction dim: x's dim 0 when transposed
        signs = counter_rng.random_signs(counter_rng.derive(seed, "signs"), hadamard_size, v.device)
        v = hadamard.rotate(v, signs, dim=0 if transpose else 1)
    noise = None
    if stochastic:
        shape = (v.shape[1], v.shape[0]) if transpose else tuple(v.shape)
        noise = counter_rng.uniform(counter_rng.derive(seed, "noise"), shape, v.device)
        noise = noise.t() if transpose else noise
    # Computed in x's layout (the block transposed with it), written transposed as a view.
    (r, c), (br, bc) = v.shape, (block[::-1] if transpose else block)
    padded = F.pad(v, (0, -c % bc, 0, -r % br))  # zeros never change a block's amax
    blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    b, ts, divisor = _block_scales(blocks.abs().amax(dim=(1, 3)), scale_format)
    # The reciprocals come from the opaque op here, not from the graph (in_graph): at 1.3B
    # width inductor fused the in-graph ones into an mxfp4 backward kernel that Triton 3.6
    # could not compile (docs/hopper_sessions.md, session 24).
    q = div_rn_by_scale(blocks, divisor[:, None, :, None]).reshape(padded.shape)[:r, :c]
    values = _round_e2m1(q, noise).contiguous()
    if scale_format == "e4m3":
        b = b.to(torch.float8_e4m3fn)
    if transpose:
        return values.t(), b.t().contiguous(), ts
    return values, b, ts


def quantize(
    backend: Backend,
    x: torch.Tensor,
    spec: OperandSpec,
    *,
    prescale: torch.Tensor | None = None,
    transpose: bool = False,
    clip: tuple[torch.Tensor, torch.Tensor] | None = None,
    seed: torch.Tensor | None = None,
) -> QOperand:
    """The `Backend.quantize` of a micro-block spec (`supports(spec)`), through `backend.kernel`
    (the Hopper backend runs a compiled twin for eager CUDA calls). ValueError for a Hadamard
    transform longer than the operand's contraction dim needs (`check_hadamard_size`)."""
    if spec.hadamard:
        check_hadamard_size(spec.hadamard, spec.granularity[1], x.shape[0 if transpose else 1])
    values, b, ts = backend.kernel(quantize_microscaled, x)(
        x.detach(), spec.granularity, spec.scale_format,
        prescale=prescale, clip=clip, transpose=transpose,
        stochastic=spec.rounding == "stochastic", hadamard_size=spec.hadamard, seed=seed,
    )  # fmt: skip
    tensor_scale = ts if spec.scale_format == "e4m3" else None
    return QOperand(
        values, b, spec.fmt, spec.granularity, tensor_scale, spec.scale_format, transpose, None
    )


def check_hadamard_size(n: int, block: int, length: int) -> None:
    """ValueError if a Hadamard transform of size n is longer than both the block and the
    contraction length rounded up to a power of two (wgrad's: the step's tokens).

    Such a transform cannot spread an outlier further: the shorter one already mixes all the
    tokens, and the rest of it rotates zero padding (`hadamard.rotate`), while both rotated
    operands, one saved from forward, grow to n columns. The block's own size (`rht=on`) stays
    allowed on any input. Only knowable from the input's shape, so checked at each call (a
    Python comparison of static sizes, traced away under torch.compile); for a power of two n,
    `n >= 2 * length` is `n > pow2_ceil(length)`.
    """
    if n > block and n >= 2 * length > 0:
        cover = 1 << (int(length) - 1).bit_length()  # length rounded up to a power of two
        most = max(block, cover)
        raise ValueError(
            f"rht.size={n}: this wgrad rotates {length} tokens, and a transform longer than "
            f"{most} only rotates zero padding; use rht.size <= {most}"
        )


def exact_bf16_values(q: QOperand) -> torch.Tensor:
    """values * block scale, float32 (exactly representable in bf16), the operand's shape."""
    if isinstance(q.granularity, tuple):
        return block_scaled(q.values(), q.scale.float(), q.granularity)
    return q.values() * expand_scale(q.scale.float(), q.shape, q.granularity)


def dequantized_mm(
    a: QOperand,
    b: QOperand,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """a @ bᵀ of micro-block operands: `gemm(a_vb, b_vb)` (default: fp32 `a_vb @ b_vbᵀ`) on the
    bf16-exact `values * block scale` operands, then `(acc * ts_b) * ts_a`, + bias, cast."""
    a_vb, b_vb = exact_bf16_values(a), exact_bf16_values(b)
    out = gemm(a_vb, b_vb) if gemm is not None else a_vb @ b_vb.t()
    if b.tensor_scale is not None:
        out = out * b.tensor_scale
    if a.tensor_scale is not None:
        out = out * a.tensor_scale
    if bias is not None:
        out = out + bias.float()
    return to_dtype(out, out_dtype)
