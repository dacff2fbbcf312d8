"""The whole AdamW update of one parameter as one plain-PyTorch function (fused when compiled).

`adamw_update` decodes the stored moments, applies the AdamW update (the operation sequence of
torch.optim.AdamW, as `AdamW._update_bucket` runs it) and re-encodes the moments with fresh
per-block scales, then writes the weight. Written as elementwise ops and per-block reductions
only, so `torch.compile` fuses it into a few kernels. On CUDA, eager callers go through a
hand-written Triton kernel of the same bits (optim/fused_triton.py) where it covers the state
formats, else through the compiled twin (`select_update` picks); the eager function is the
reference. The unfused path
(decode, foreach update over a bucket, encode per tensor) stays as `AdamW(fused=False)`.

Bit-exactness with the unfused path and between eager and compiled:
- Hyperparameters arrive as 0-d fp32 tensors on the parameter's device (`adamw_scalars`), each
  the float32 rounding of the same Python double the unfused path passes as a scalar, which the
  kernels round to float32 too. As tensors they are graph inputs, never constants: no recompile
  when lr or the step changes, and no `a / const` -> `a * (1 / const)` rewrite by inductor.
- Stochastic rounding draws nothing inside: `draw_step_noise` draws the uniforms (and the bf16
  weight noise) from the optimizer's generator before the call, in the order and shapes the
  unfused path draws them, so both consume the same random stream.
- Each AdamW op is written in the form its eager CPU kernel evaluates it: `lerp` is one FMA
  from the nearer end, `addcmul(v, g, g, c)` is fma(c * g, g, v), `addcdiv(w, m, d, c)` is
  w + c * m / d; the FMAs go through `exact.fma_rn` (inductor's C++ code never contracts, and
  on CUDA the compiled twin runs with Triton's contraction off: `emulate_precision_casts`).
  Divisions are plain on CPU and `exact.div_rn` elsewhere (Triton may divide approximately).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from minifloat.exact import div_rn, fma_rn, sqrt_eager
from minifloat.optim.codecs import StateFormat, draw_bf16_noise, stochastic_round_bf16

__all__ = [
    "FUSED_KERNELS",
    "AdamWScalars",
    "StepNoise",
    "adamw_scalars",
    "adamw_update",
    "check_fused_kernel",
    "draw_step_noise",
    "select_update",
    "triton_supports",
]


class AdamWScalars(NamedTuple):
    """The step's hyperparameters as 0-d fp32 tensors (see `adamw_scalars`)."""

    decay: torch.Tensor  # 1 - lr * weight_decay
    one_minus_beta1: torch.Tensor
    beta2: torch.Tensor
    one_minus_beta2: torch.Tensor
    bias_correction2_sqrt: torch.Tensor  # sqrt(1 - beta2^step)
    eps: torch.Tensor
    step_size: torch.Tensor  # -lr / (1 - beta1^step)


class StepNoise(NamedTuple):
    """Pre-drawn stochastic-rounding noise of one parameter's step (None where not used)."""

    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    weight: torch.Tensor | None


def adamw_scalars(
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: float,
    device: torch.device,
) -> AdamWScalars:
    """The hyperparameters of one step, computed in Python doubles exactly as the unfused path
    computes its scalars, as 0-d fp32 tensors on `device` (one host-to-device copy, from
    pinned memory on CUDA: a copy from pageable memory makes the host wait for the whole
    backward before it launches the update, measured as host time = step time at 1.3B)."""
    beta1, beta2 = betas
    values = (
        1.0 - lr * weight_decay,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        math.sqrt(1.0 - beta2**step),
        eps,
        -lr / (1.0 - beta1**step),
    )
    host = torch.tensor(values, dtype=torch.float32)
    if device.type == "cuda":
        host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
    return AdamWScalars(*host.to(device, non_blocking=True).unbind())


def draw_step_noise(
    numel: int,
    shape: torch.Size,
    device: torch.device,
    generator: torch.Generator | None,
    *,
    formats: tuple[StateFormat, StateFormat],
    weight_noise: bool,
    block_size: int,
) -> StepNoise:
    """Draw one parameter's stochastic-rounding noise from `generator` in the unfused path's
    order: exp_avg's uniforms, exp_avg_sq's, then the bf16 weight noise (`weight_noise`)."""
    m_fmt, v_fmt = formats
    return StepNoise(
        m_fmt.draw_noise(numel, device, generator, block_size=block_size),
        v_fmt.draw_noise(numel, device, generator, block_size=block_size),
        draw_bf16_noise(shape, device, generator) if weight_noise else None,
    )


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch.lerp as its eager kernels compute it: one FMA from the nearer end."""
    small = weight.abs() < 0.5
    return fma_rn(
        torch.where(small, weight, weight - 1), end - start, torch.where(small, start, end)
    )


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b correctly rounded: plain division on CPU (inductor's C++ divides exactly, as eager
    does); `div_rn` elsewhere, where compiled code may divide approximately."""
    return a / b if a.device.type == "cpu" else div_rn(a, b)


def _decode(
    fmt: StateFormat, payload: torch.Tensor, scale: torch.Tensor | None, shape: torch.Size, *,
    floor_underflow: bool,
) -> torch.Tensor:  # fmt: skip
    if fmt.name == "fp32":
        return payload
    return fmt.decode(payload, scale, shape, floor_underflow=floor_underflow)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: tuple[torch.Tensor, torch.Tensor | None],
    exp_avg_sq: tuple[torch.Tensor, torch.Tensor | None],
    scalars: AdamWScalars,
    noise: StepNoise,
    *,
    formats: tuple[StateFormat, StateFormat],
    block_size: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
    """One AdamW step of one parameter (a plain tensor: the local shard of a DTensor).

    param: updated in place (from `master` when given, by stochastic rounding when it is bf16
    without a master, else it is its own fp32 weight). exp_avg, exp_avg_sq: (payload, scale or
    None) in `formats`; fp32 moments are updated in place, the others are returned re-encoded
    (new tensors, as the unfused path stores them). Returns the two (payload, scale) pairs.
    """
    m_fmt, v_fmt = formats
    s = scalars
    g = grad.float()
    weight = master if master is not None else param
    m = _decode(m_fmt, *exp_avg, param.shape, floor_underflow=False)
    v = _decode(v_fmt, *exp_avg_sq, param.shape, floor_underflow=True)

    # The unfused path's foreach ops, one by one, in the forms their eager kernels evaluate.
    w = weight.float() * s.decay
    m = _lerp(m, g, s.one_minus_beta1)
    v = fma_rn(s.one_minus_beta2 * g, g, v * s.beta2)  # addcmul(v * beta2, g, g, 1 - beta2)
    denom = _div(sqrt_eager(v), s.bias_correction2_sqrt) + s.eps
    w = w + _div(s.step_size * m, denom)  # addcdiv(w, m, denom, step_size)

    if weight.dtype == torch.float32:
        weight.copy_(w)
    if master is not None:
        param.copy_(w)
    elif param.dtype != torch.float32:  # bf16 (AdamW refuses other master-less dtypes)
        param.copy_(stochastic_round_bf16(w, noise=noise.weight))
    outs = []
    moments = ((m_fmt, exp_avg, m, noise.exp_avg), (v_fmt, exp_avg_sq, v, noise.exp_avg_sq))
    for fmt, stored, value, u in moments:
        if fmt.name == "fp32":
            stored[0].copy_(value)
            outs.append(stored)
        else:
            outs.append(fmt.encode(value, block_size=block_size, noise=u))
    return outs[0], outs[1]


# Eager CUDA callers get fused kernels through this compiled twin (or the Triton kernel); under
# the caller's torch.compile (or on CPU) the function itself runs. dynamic=True: one graph
# serves every parameter shape (static shapes would compile twice per configuration), so the
# graphs are one per state format, parameter dtype, master and padding case. No fullgraph:
# should a process build more configurations than dynamo's recompile limit, the rest run this
# function eagerly (the same bits, slower) instead of failing; tests/test_optim_fused.py checks
# it traces whole.
_COMPILED: dict[Callable, Callable] = {
    fn: torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
    for fn in (adamw_update,)
}

FUSED_KERNELS = ("auto", "inductor")


def check_fused_kernel(kernel: str) -> None:
    """Raise ValueError (one line) unless `kernel` names one of FUSED_KERNELS."""
    if kernel not in FUSED_KERNELS:
        raise ValueError(f"fused_kernel must be one of {FUSED_KERNELS}, got {kernel!r}")


def triton_supports(
    formats: tuple[StateFormat, StateFormat],
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    block_size: int = 128,
) -> bool:
    """Whether the hand-written Triton kernel (optim/fused_triton.py) takes this call: both
    moments block-scaled and rounded to nearest (exp_avg not sqrt-domain) with a power-of-two
    block size, an fp32 weight (the param or its master) or a bf16 param rounded
    stochastically, contiguous CUDA tensors."""
    if not all(f.scaled and not f.stochastic for f in formats) or formats[0].sqrt_domain:
        return False
    if block_size <= 0 or block_size & (block_size - 1):
        return False
    if master is None and param.dtype not in (torch.float32, torch.bfloat16):
        return False
    tensors = (param, grad) if master is None else (param, grad, master)
    return all(t.is_cuda and t.is_contiguous() for t in tensors)


def select_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    formats: tuple[StateFormat, StateFormat],
    *,
    kernel: str = "auto",
    block_size: int = 128,
) -> Callable:
    """The implementation of `adamw_update` for one eager call (all take the same arguments
    and give the same bits): the function itself off CUDA and while tracing (the caller's
    compile fuses it); on CUDA the Triton kernel where `triton_supports` the call and `kernel`
    is "auto" (an fp8-fp16 step at 1.3B: 14.5 ms against the twin's 41.1, docs/optim.md),
    else the twin."""
    check_fused_kernel(kernel)
    if not param.is_cuda or torch.compiler.is_compiling():
        return adamw_update
    if kernel == "auto" and triton_supports(formats, param, grad, master, block_size):
        from minifloat.optim.fused_triton import adamw_update_triton

        return adamw_update_triton
    return _COMPILED[adamw_update]
