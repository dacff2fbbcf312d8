"""The fused AdamW update of one parameter as one hand-written Triton kernel (CUDA).

`adamw_update` in optim/fused.py is the reference: plain PyTorch that `torch.compile` fuses. On
an H200 its compiled form took 42-57 ms per 1.3B step against ~6 ms of memory traffic, because
inductor keeps the second moment's exact FMA (`exact.fma_rn`, float64 with round-to-odd) as two
float64 buffers between its kernels (docs/optim.md). Here each program owns whole state blocks
(ROWS x BLOCK elements), so decode, update, block absmax and encode stay in registers: one read
and one write of every byte (18 bytes per parameter for fp8-fp16 states on fp32 weights).

Same bits as `adamw_update` (the GPU tests compare them), operation by operation:
- FMAs are `tl.fma` (a hardware FMA is what `fma_rn` emulates) and the kernel is compiled with
  `enable_fp_fusion=False`, so no other multiply-add is contracted.
- Divisions are `exact.div_rn`'s formula, a * (1 / b) in float64 rounded once (Triton's
  float64 division is correctly rounded); square roots are `sqrt_rn`.
- Block absmax, the underflow floor and the scale follow `StateFormat.encode/decode`, NaN
  blocks included (torch's amax propagates NaN, so a NaN block gets scale 1).

Covers block-scaled, round-to-nearest moment formats (fp8, fp16, fp8-sqrt: the `fp8-fp16` and
`lean` presets) on contiguous tensors; `fused.triton_supports` says which calls it takes.
Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifloat.optim.codecs import StateFormat

__all__ = ["adamw_update_triton"]

# State blocks per program: 8 x 128 elements, 4 warps (untuned beyond a first measurement).
_ROWS = 8
_WARPS = 4


@triton.jit
def _div_rn(a, b):  # pragma: no cover - runs on the GPU
    """exact.div_rn: a * (1 / b) in float64, rounded once to float32 (Triton divides float64
    correctly rounded, `div.rn.f64`; only float32 division is approximate)."""
    return (a.to(tl.float64) * (1.0 / b.to(tl.float64))).to(tl.float32)


@triton.jit
def _nan_rows(x):  # pragma: no cover - runs on the GPU
    """Per row: does it hold a NaN (torch's amax would return NaN)."""
    return tl.max((x != x).to(tl.int32), axis=1) > 0


@triton.jit
def _decode(payload_ptr, scale_ptr, offs, rows, row_ok, in_range,
            SQRT: tl.constexpr, FLOOR: tl.constexpr, SMALLEST: tl.constexpr):  # fmt: skip
    """StateFormat.decode of whole blocks; elements past the tensor's end read as 0."""
    values = tl.load(payload_ptr + offs, mask=row_ok[:, None]).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
    if FLOOR:
        mag = tl.abs(values)
        live = (tl.max(mag, axis=1) > 0) & ~_nan_rows(values)
        values = tl.where((values == 0) & live[:, None], SMALLEST, values)
    hp = values * scale[:, None]
    if SQRT:
        hp = hp * hp
    return tl.where(in_range, hp, 0.0)


@triton.jit
def _encode(x, payload_ptr, scale_ptr, offs, rows, row_ok, in_range,
            SQRT: tl.constexpr, ELEMENT_MAX: tl.constexpr):  # fmt: skip
    """StateFormat.encode (round to nearest) of whole blocks; padding encodes as 0."""
    hp = x
    if SQRT:
        hp = tl.math.sqrt_rn(hp)
    hp = tl.where(in_range, hp, 0.0)
    amax = tl.max(tl.abs(hp), axis=1)
    amax = tl.where(_nan_rows(hp), float("nan"), amax)
    scale = tl.where(amax > 0, _div_rn(amax, tl.full(amax.shape, ELEMENT_MAX, tl.float32)), 1.0)
    scaled = _div_rn(hp, scale[:, None])
    clamped = tl.minimum(tl.maximum(scaled, -ELEMENT_MAX), ELEMENT_MAX)
    clamped = tl.where(scaled != scaled, scaled, clamped)
    tl.store(payload_ptr + offs, clamped.to(payload_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(scale_ptr + rows, scale, mask=row_ok)


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, master_ptr, weight_noise_ptr,
    m_ptr, m_scale_ptr, v_ptr, v_scale_ptr,
    m_out_ptr, m_scale_out_ptr, v_out_ptr, v_scale_out_ptr,
    decay_ptr, one_minus_beta1_ptr, beta2_ptr, one_minus_beta2_ptr,
    bias_correction2_sqrt_ptr, eps_ptr, step_size_ptr,
    numel, n_blocks,
    M_SQRT: tl.constexpr, M_MAX: tl.constexpr,
    V_SQRT: tl.constexpr, V_MAX: tl.constexpr, V_SMALLEST: tl.constexpr,
    WEIGHT: tl.constexpr,  # 0: the fp32 param; 1: an fp32 master; 2: bf16, stochastic rounding
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    row_ok = rows < n_blocks
    in_range = offs < numel

    decay = tl.load(decay_ptr)
    one_minus_beta1 = tl.load(one_minus_beta1_ptr)
    beta2 = tl.load(beta2_ptr)
    one_minus_beta2 = tl.load(one_minus_beta2_ptr)
    bias_correction2_sqrt = tl.load(bias_correction2_sqrt_ptr)
    eps = tl.load(eps_ptr)
    step_size = tl.load(step_size_ptr)

    g = tl.load(grad_ptr + offs, mask=in_range, other=0).to(tl.float32)
    if WEIGHT == 1:
        w = tl.load(master_ptr + offs, mask=in_range, other=0)
    else:
        w = tl.load(param_ptr + offs, mask=in_range, other=0).to(tl.float32)
    m = _decode(m_ptr, m_scale_ptr, offs, rows, row_ok, in_range, M_SQRT, False, 0.0)
    v = _decode(v_ptr, v_scale_ptr, offs, rows, row_ok, in_range, V_SQRT, True, V_SMALLEST)

    # adamw_update's sequence: decay, lerp (one FMA from the nearer end), addcmul, addcdiv.
    w = w * decay
    small = tl.abs(one_minus_beta1) < 0.5
    lerp_weight = tl.where(small, one_minus_beta1, one_minus_beta1 - 1)
    m = tl.fma(lerp_weight, g - m, tl.where(small, m, g))
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = _div_rn(tl.math.sqrt_rn(v), bias_correction2_sqrt) + eps
    w = w + _div_rn(step_size * m, denom)

    if WEIGHT == 0:
        tl.store(param_ptr + offs, w, mask=in_range)
    elif WEIGHT == 1:
        tl.store(master_ptr + offs, w, mask=in_range)
        tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=in_range)
    else:  # codecs.stochastic_round_bf16 with the pre-drawn int32 noise
        noise = tl.load(weight_noise_ptr + offs, mask=in_range, other=0)
        bits = w.to(tl.int32, bitcast=True)
        truncated = ((bits + noise) & -65536).to(tl.float32, bitcast=True)
        finite = tl.abs(w) < float("inf")
        tl.store(param_ptr + offs, tl.where(finite, truncated, w).to(tl.bfloat16), mask=in_range)

    _encode(m, m_out_ptr, m_scale_out_ptr, offs, rows, row_ok, in_range, M_SQRT, M_MAX)
    _encode(v, v_out_ptr, v_scale_out_ptr, offs, rows, row_ok, in_range, V_SQRT, V_MAX)


def adamw_update_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: tuple[torch.Tensor, torch.Tensor | None],
    exp_avg_sq: tuple[torch.Tensor, torch.Tensor | None],
    scalars: tuple[torch.Tensor, ...],
    noise: tuple[torch.Tensor | None, ...],
    *,
    formats: tuple[StateFormat, StateFormat],
    block_size: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`fused.adamw_update` for a call `fused.triton_supports` accepts, in one kernel launch
    (same arguments, same results: the weight written in place, the moments returned
    re-encoded as new tensors)."""
    m_fmt, v_fmt = formats
    numel = param.numel()
    n_blocks = triton.cdiv(numel, block_size)
    weight_mode = 1 if master is not None else 0 if param.dtype == torch.float32 else 2
    # Payloads are [n_blocks, block_size] and scales [n_blocks] as StateFormat.encode makes them.
    exp_avg = tuple(t.contiguous() for t in exp_avg)
    exp_avg_sq = tuple(t.contiguous() for t in exp_avg_sq)
    m_out, m_scale_out = torch.empty_like(exp_avg[0]), torch.empty_like(exp_avg[1])
    v_out, v_scale_out = torch.empty_like(exp_avg_sq[0]), torch.empty_like(exp_avg_sq[1])
    weight_noise = noise[2] if weight_mode == 2 else param
    grid = (triton.cdiv(n_blocks, _ROWS),)
    _adamw_kernel[grid](
        param, grad, master if master is not None else param, weight_noise,
        exp_avg[0], exp_avg[1], exp_avg_sq[0], exp_avg_sq[1],
        m_out, m_scale_out, v_out, v_scale_out,
        *scalars,
        numel, n_blocks,
        M_SQRT=m_fmt.sqrt_domain, M_MAX=m_fmt.element_max,
        V_SQRT=v_fmt.sqrt_domain, V_MAX=v_fmt.element_max, V_SMALLEST=v_fmt.smallest,
        WEIGHT=weight_mode, BLOCK=block_size, ROWS=_ROWS,
        num_warps=_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return (m_out, m_scale_out), (v_out, v_scale_out)
