"""The elementwise work of the fp8 gradient all-reduce, as plain-PyTorch passes fused when compiled.

The DDP fp8 hook (`distributed._mean_fp8`) averages a gradient bucket with four collectives: a
MAX all-reduce of the amax, an all-to-all of fp8 payloads, and one all-gather of every rank's
reduced fp8 chunk with its scale. Everything elementwise between them is one of these functions:

- `bucket_amax(flat, world)`: max |flat / W|, one reduction over the bucket;
- `encode(flat, amax, world, fmt, padded)`: the fp8 payload of flat / W with the shared scale,
  padded with zeros to W equal chunks: one pass, no fp32 copy of the bucket and no separate
  padding copy (compiled, the zero tail is written by the same kernel);
- `reduce_chunks_into(send, received, amax, fmt)`: the W received chunks summed in fp32 on
  receipt, times the shared scale, re-quantized with a scale of the chunk's own, written into
  the all-gather's send buffer: one reduction and one pass (one kernel on CPU);
- `decode_into(out, gathered, scales, fmt)`: every reduced chunk dequantized straight into
  `out` (the bucket itself in the DDP hook): one pass.

On CUDA, eager callers get compiled twins (`kernel`), which inductor fuses into the kernels
above; on CPU (and under the caller's torch.compile) the functions themselves run. Compiled or
not, the bits are the same, and they are the bits of the earlier unfused implementation on CPU
(`tests/test_grad_comm_fp8.py` keeps it as the reference):

- Every float32 division goes through `exact.div_rn` (correctly rounded in any compiled form;
  inductor would turn `x / W` into `x * (1 / W)`). The pre-division by W rounds once, as
  before, and the division by the scale once more.
- amax |flat / W| is computed as amax |flat| / W: rounding a quotient is monotone, so the
  largest rounded quotient is the rounded quotient of the largest value (NaN stays NaN).
- The W chunks are summed in rank order, ((c0 + c1) + c2) + ..., written out as a chain so that
  no compiled reduction reorders it. Eager CPU's `sum(0)` adds the rows in that order too
  (measured for W <= 8), starting from +0, so a zero sum is +0 there: the chain's -0 is
  made +0. E4M3 sums are exact for W <= 64 in any order (multiples of 2^-9
  below 2^24 * 2^-9); E5M2's range is wider, so order matters there.
- Scales: `amax / fmt.max` where amax > 0, else 1 (all-zero; and NaN, since NaN > 0 is false).
  An infinite amax gives an infinite scale, and the whole bucket then decodes to NaN.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from minifloat.exact import div_rn

__all__ = [
    "FP8_DTYPES",
    "SCALE_BYTES",
    "bucket_amax",
    "decode_into",
    "encode",
    "kernel",
    "reduce_chunks_into",
    "shared_scale",
    "twin",
]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE_BYTES = 4  # a float32 scale travels after each reduced chunk in the all-gather
_NEGATIVE_ZERO_BITS = -(2**31)  # float32 -0.0 viewed as int32


# ---- argument checks: one line at entry, in eager only ------------------------------------------
# Each pass checks its Python arguments unless it is being traced (`torch.compiler.is_compiling`:
# no guards or graph nodes in the compiled passes); the compiled twins check before they run.


def _check_fmt(fmt: object) -> None:
    if not isinstance(fmt, str) or fmt not in FP8_DTYPES:
        raise ValueError(f"fmt must be one of {', '.join(FP8_DTYPES)}, got {fmt!r}")


def _check_world(world: object) -> None:
    if isinstance(world, bool) or not isinstance(world, int):
        raise TypeError(f"world must be an int (the number of ranks), got {world!r}")
    if world < 1:
        raise ValueError(f"world must be >= 1 (the number of ranks), got {world}")


def _check_bucket_amax(flat: torch.Tensor, world: int) -> None:
    _check_world(world)
    if flat.numel() == 0:  # amax of nothing: torch's error names no argument
        raise ValueError("bucket_amax needs a non-empty flat (reduce_mean skips empty buckets)")


def _check_encode(
    flat: torch.Tensor, amax: torch.Tensor, world: int, fmt: str, padded: int
) -> None:
    _check_world(world)
    _check_fmt(fmt)
    # F.pad with a negative pad would crop: values past `padded` would be dropped silently
    if isinstance(padded, bool) or not isinstance(padded, int) or padded < flat.numel():
        raise ValueError(f"padded must be an int >= flat.numel() = {flat.numel()}, got {padded!r}")


def _check_reduce_chunks_into(
    send: torch.Tensor, received: torch.Tensor, amax: torch.Tensor, fmt: str
) -> None:
    _check_fmt(fmt)
    # the reduced chunk is written as fp8 bit patterns: a wider dtype would take them as numbers
    if send.dtype != torch.uint8:
        raise ValueError(f"send must be a uint8 buffer (fp8 bit patterns), got {send.dtype}")
    # a 1-D `received` would be summed as `numel` one-byte "ranks"; float32 viewed as fp8 as
    # four values an element
    if received.dtype != torch.uint8 or received.dim() != 2 or received.shape[0] < 1:
        raise ValueError(
            f"received must be uint8 [W >= 1, chunk], got {received.dtype} of shape "
            f"{tuple(received.shape)}"
        )
    if send.dim() != 1 or send.numel() < received.shape[1]:
        raise ValueError(
            f"send must be 1-D with at least chunk = {received.shape[1]} bytes, got shape "
            f"{tuple(send.shape)}"
        )


def _check_decode_into(
    out: torch.Tensor, gathered: torch.Tensor, scales: torch.Tensor, fmt: str
) -> None:
    _check_fmt(fmt)
    # float bytes would be read as fp8 codes; an integer `out` would truncate the mean
    if gathered.dtype != torch.uint8 or gathered.dim() != 2:
        raise ValueError(
            f"gathered must be uint8 [W, chunk + {SCALE_BYTES}], got {gathered.dtype} of shape "
            f"{tuple(gathered.shape)}"
        )
    world, chunk = gathered.shape[0], gathered.shape[1] - SCALE_BYTES
    if chunk < 0 or tuple(scales.shape) != (world, 1):
        raise ValueError(
            f"gathered {tuple(gathered.shape)} needs rows of chunk + {SCALE_BYTES} bytes and "
            f"scales [{world}, 1], got scales {tuple(scales.shape)}"
        )
    if not out.is_floating_point() or out.dim() != 1 or out.numel() > world * chunk:
        raise ValueError(
            f"out must be a 1-D float tensor of at most {world * chunk} elements, got "
            f"{out.dtype} of shape {tuple(out.shape)}"
        )


def shared_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The dequantization scale of `amax`: amax / fmt.max where amax > 0, else 1 (all-zero
    and NaN amaxes); +inf for an infinite amax, so that the bucket decodes to NaN."""
    if not torch.compiler.is_compiling():
        _check_fmt(fmt)
    fmax = torch.finfo(FP8_DTYPES[fmt]).max
    return torch.where(amax > 0, div_rn(amax, torch.full_like(amax, fmax)), torch.ones_like(amax))


def _to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x / scale saturated to ±fmt.max and rounded to fp8 (nearest, ties to even), as uint8."""
    dtype = FP8_DTYPES[fmt]
    fmax = torch.finfo(dtype).max
    return div_rn(x, scale).clamp(-fmax, fmax).to(dtype).view(torch.uint8)


def _positive_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 x with -0 made +0, as a sum that starts from +0 (eager `sum`) leaves it. Done on
    the integer bits: inductor's C++ is built with -fno-signed-zeros, under which a compiler
    may drop `x + 0.0` or `where(x == 0, 0.0, x)`."""
    bits = x.view(torch.int32)
    return torch.where(bits == _NEGATIVE_ZERO_BITS, 0, bits).view(torch.float32)


def bucket_amax(flat: torch.Tensor, world: int) -> torch.Tensor:
    """max |flat / world| as a float32 [1] tensor (the quotient rounded as `encode` rounds it)."""
    if not torch.compiler.is_compiling():
        _check_bucket_amax(flat, world)
    amax = flat.float().abs().amax().reshape(1)
    return div_rn(amax, torch.full_like(amax, world))


def encode(
    flat: torch.Tensor, amax: torch.Tensor, world: int, fmt: str, padded: int
) -> torch.Tensor:
    """The fp8 payload (uint8 [padded]) of flat / world with the shared scale of the all-reduced
    `amax`; entries past flat's end are zero (padding to `world` equal chunks)."""
    if not torch.compiler.is_compiling():
        _check_encode(flat, amax, world, fmt, padded)
    h = div_rn(flat.float(), torch.full_like(amax, world))
    q = _to_fp8(h, shared_scale(amax, fmt), fmt)
    return F.pad(q, (0, padded - q.numel()))


def reduce_chunks_into(
    send: torch.Tensor, received: torch.Tensor, amax: torch.Tensor, fmt: str
) -> torch.Tensor:
    """Sum the received chunks (uint8 [W, chunk], row r from rank r) in fp32, times the shared
    scale; write the sum re-quantized with its own scale into send[:chunk]; return that scale
    (float32 [1]).

    The sum runs in rank order (see the module docstring), the same on every device.
    """
    if not torch.compiler.is_compiling():
        _check_reduce_chunks_into(send, received, amax, fmt)
    rows = received.view(FP8_DTYPES[fmt]).float()
    acc = rows[0]
    for r in range(1, rows.shape[0]):
        acc = acc + rows[r]
    partial = _positive_zero(acc) * shared_scale(amax, fmt)
    chunk_scale = shared_scale(partial.abs().amax().reshape(1), fmt)
    send[: partial.numel()].copy_(_to_fp8(partial, chunk_scale, fmt))
    return chunk_scale


def decode_into(
    out: torch.Tensor, gathered: torch.Tensor, scales: torch.Tensor, fmt: str
) -> torch.Tensor:
    """out[:] = every reduced chunk times its scale, in rank order, cut to out's length.

    gathered: uint8 [W, chunk + k], each row a rank's chunk (its first `chunk` bytes are
    values); scales: float32 [W, 1]. `out` (1-D, any float dtype) receives the fp32 products
    rounded to its dtype, as a copy into it would round them. Returns `out`."""
    if not torch.compiler.is_compiling():
        _check_decode_into(out, gathered, scales, fmt)
    chunk = gathered.shape[1] - SCALE_BYTES
    values = gathered[:, :chunk].view(FP8_DTYPES[fmt]).float() * scales
    return out.copy_(values.reshape(-1)[: out.numel()])


# Eager CUDA callers get fused kernels through these compiled twins; under the caller's
# torch.compile (or on CPU) the functions themselves run. dynamic=True: one graph serves every
# bucket size. No fullgraph: past dynamo's recompile limit the functions run eagerly (the same
# bits, slower). emulate_precision_casts keeps Triton's casts of bf16 buckets as eager rounds.
_CHECKS: dict[Callable, Callable] = {
    bucket_amax: _check_bucket_amax,
    encode: _check_encode,
    reduce_chunks_into: _check_reduce_chunks_into,
    decode_into: _check_decode_into,
}


def _checked(fn: Callable) -> Callable:
    """`fn` compiled, behind its eager argument check (traced, `fn` skips it)."""
    compiled = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
    check = _CHECKS[fn]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return compiled(*args, **kwargs)

    return run


_COMPILED: dict[Callable, Callable] = {fn: _checked(fn) for fn in _CHECKS}


def twin(fn: Callable) -> Callable:
    """The compiled twin of `fn` (one of this module's passes), on any device (tests and
    benchmarks run it on CPU too)."""
    return _COMPILED[fn]


def kernel(fn: Callable, like: torch.Tensor) -> Callable:
    """The compiled twin of `fn` (one of this module's passes) for eager CUDA calls; `fn`
    itself while tracing or on other devices (the CPU emulation is the eager reference)."""
    if like.is_cuda and not torch.compiler.is_compiling():
        return _COMPILED[fn]
    return fn
