"""Float32 arithmetic pinned to the same bits in eager and compiled code.

torch.compile may lower a float32 division to an approximate one (Triton's `div.full.f32`, up to
2 ulp) or rewrite it as a multiplication by a reciprocal; eager PyTorch divides correctly
rounded. Quantizers round quotients onto coarse grids, where a last-bit difference next to a
rounding boundary becomes a different grid value, so their divisions go through `div_rn`.
"""

from __future__ import annotations

import torch

__all__ = [
    "as_dtype", "div_rn", "div_rn_by_scale", "fma_rn", "round_to_bf16", "sqrt_eager",
    "to_dtype", "written_once",
]  # fmt: skip


def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b correctly rounded to float32, in any compiled form (a, b float32, broadcastable).

    Computed as `a * (1 / b)` in float64 and rounded once to float32. The float64 value lies
    within 2^-52 (relative) of a / b however the compiler forms it; the exact quotient of two
    24-bit numbers is either a float32 rounding boundary (impossible for normal results: a 25-bit
    midpoint times a 24-bit divisor needs more than 24 bits) or at least 2^-49 (relative) away
    from every one, so both round to the same float32. Subnormal quotients may differ in their
    last bit; callers that round them onto a quantization grid get zero either way.
    """
    return (a.double() * b.double().reciprocal()).float()


def written_once(t: torch.Tensor) -> torch.Tensor:
    """t, contiguous, through `as_strided` with strides computed from its shape (the identity).
    Under torch.compile inductor writes an `as_strided` input to a buffer of its own, and every
    later reader loads that buffer instead of recomputing the expression inline (the strides
    come from the shape: a `stride()` query in traced backward code breaks dynamo's inlining,
    docs/hopper.md)."""
    t = t.contiguous()
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= n
    return t.as_strided(t.shape, tuple(reversed(strides)))


# Library-defined (not `torch.library.custom_op`, whose Python wrapper costs ~19 us of host time
# per call against ~3 us, measured on the CPU): one call per quantization with group scales.
_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define("reciprocal_f64(Tensor b) -> Tensor")
_LIB.impl("reciprocal_f64", lambda b: b.double().reciprocal(), "CompositeExplicitAutograd")


@torch.library.register_fake("minifloat::reciprocal_f64")
def _(b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(b, dtype=torch.float64)


def div_rn_by_scale(
    a: torch.Tensor, scale: torch.Tensor, *, in_graph: bool = False
) -> torch.Tensor:
    """`div_rn(a, scale)` for a `scale` broadcast over many elements of `a` (a quantizer's
    per-tensor, per-row or per-block scales): the same bits, faster compiled.

    The float64 reciprocals of non-scalar scales are computed once per group: inductor would
    otherwise inline them into the elementwise kernel and divide in float64 for every element
    (measured on an H200: a SwiGLU backward quantizing four row- and column-scaled operands took
    0.82 ms for 0.9 GB of traffic). With `in_graph` (the FP8 and row-scaled E2M1 GEMM
    operands' quantizers, operand.py, and OCC's fold since session 75) the compiled graph
    computes them and `written_once` stores them from a kernel inductor runs anyway; otherwise
    an opaque op does, two eager kernels a call (600 calls a 1.3B fp4-dge step before session
    23; docs/hopper_sessions.md, sessions 22 to 24). Neither DGE's division nor the fold was
    faster in the graph at 1.3B (session 24); the fold went in for its launches, 96 fewer a
    step in session 75's profile under CUDA graphs. DGE's keeps the opaque op, and so do the
    micro-block quantizers (in the graph, an mxfp4 kernel at 1.3B width did not compile in
    Triton 3.6). Eager and Triton float64 reciprocals are both correctly rounded. A single
    (tensor-wise) scale stays inline: a kernel computes a scalar once per thread.
    """
    if scale.numel() == 1:
        return div_rn(a, scale)
    if in_graph and torch.compiler.is_compiling():
        reciprocal = written_once(scale.float().double().reciprocal())
    else:
        reciprocal = torch.ops.minifloat.reciprocal_f64.default(scale.float())
    return (a.double() * reciprocal).float()


def fma_rn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32 (a fused multiply-add), in any compiled form
    (a, b, c float32, broadcastable).

    Eager CPU and CUDA kernels evaluate lerp and addcmul as hardware FMAs; torch.compile on CPU
    never emits one (and Triton contracts only where it likes), so code that must match them
    computes the FMA explicitly. The product of two float32 values is exact in float64; the
    float64 sum p + c is rounded to odd (TwoSum gives the exact error; when it is non-zero, the
    sum is truncated toward zero and its last bit set), and rounding to odd at 53 bits followed
    by round-to-nearest at 24 bits equals one round-to-nearest of the exact value (Boldo and
    Melquiond, 2008), subnormal float32 results included. A contracted float64 a * b + c gives
    the same sum (the product is exact), and the TwoSum steps have no products to contract.
    Non-finite values propagate as in an FMA.
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    t = s - p
    err = (p - (s - t)) + (c64 - t)  # p + c64 == s + err exactly
    away = ((err < 0) & (s > 0)) | ((err > 0) & (s < 0))  # s was rounded away from zero
    odd = (s.view(torch.int64) - away.to(torch.int64)) | 1
    inexact = (err != 0) & torch.isfinite(err)
    return torch.where(inexact, odd.view(torch.float64), s).float()


@torch.library.custom_op("minifloat::sqrt_eager", mutates_args=())
def _sqrt_cpu(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x)


@_sqrt_cpu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def sqrt_eager(x: torch.Tensor) -> torch.Tensor:
    """torch.sqrt with eager's bits in compiled code too.

    Eager float32 sqrt on CPU is not correctly rounded (measured: the last bit differs from
    the exact result for ~15 % of inputs on an AVX2 build), while inductor's C++ vector sqrt is
    exact; so on CPU the compiled graph calls the eager kernel through an opaque custom op (a
    graph split, acceptable on CPU). CUDA eager and Triton (`sqrt_rn`) both round correctly:
    there it is a plain sqrt that fuses.
    """
    return _sqrt_cpu(x) if x.device.type == "cpu" else x.sqrt()


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 `x` rounded to the nearest bfloat16 (ties to even), as float32, in any compiled form.

    Inductor drops a `.to(torch.bfloat16).to(torch.float32)` round trip inside a fused kernel
    (it keeps the fp32 value), so a GEMM output meant to be bf16 and cast back to fp32 would
    differ compiled vs eager; integer operations on the bits cannot be dropped. inf stays inf,
    values past bf16's max round to inf as the cast does, NaN stays NaN. TypeError for other
    dtypes (their bits read as float32 would be other numbers).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bf16 takes a float32 tensor, got {x.dtype}")
    bits = x.view(torch.int32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) & -65536).view(torch.float32)  # -65536 = 0xFFFF0000
    return torch.where(torch.isnan(x), x, rounded)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, and `x` itself where it has `dtype` (the same tensor `.to` returns, but no
    traced node): torch 2.11's dynamo gives an autograd.Function whose forward returns a no-op
    `.to` of its result zero gradients when compiled (docs/hopper.md, "Two torch versions";
    tests/test_compile.py's float32 cases, sessions 42 and 80)."""
    if not isinstance(dtype, torch.dtype):  # `.to("bfloat16")` reads a device, `.to(None)` no-op
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return x if x.dtype == dtype else x.to(dtype)


def to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `x` cast to `dtype` (`as_dtype`), a bf16 cast through `round_to_bf16` (so a later
    cast back to float32 keeps the rounding in compiled code too)."""
    if dtype == torch.bfloat16 and x.dtype == torch.float32:
        x = round_to_bf16(x)
    return as_dtype(x, dtype)
