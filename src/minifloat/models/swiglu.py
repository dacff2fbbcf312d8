"""The SwiGLU's elementwise part, h = silu(g)·u, as one autograd Function with one sigmoid.

Why not `F.silu(g) * u`: under torch.compile inductor writes ATen's SiLU as g / (1 + exp(-g))
with libdevice's accurate exp, and its derivative (ATen's `silu_backward` decomposition) from a
sigmoid of its own. A quantized recipe recomputes that arithmetic in four kernels a layer (the
forward's amax and cast of h, the backward's amax and cast of dg and du; fp8-rowwise adds a
second maxima pass in backward: a current tensor or row scale needs the whole amax before any
cast), and those kernels are bound by their instructions, not their bytes. Here the sigmoid is
`torch.sigmoid` (Triton's exp2-based sigmoid once compiled), computed once, and the derivative
is written from it:

    h  = g·s·u                  s = sigmoid(g), all in float32, rounded once to the output dtype
    du = dh·g·s
    dg = dh·u·s·(1 + g·(1 - s))

Measured on an H200 (`benchmarks/silu_form_probe.py`, `silu_form_probe_s62_h200_2026-11-30.md`;
one compiled 1.3B-width MLP, 16384 tokens): the SwiGLU's kernels take 0.802 -> 0.722 ms a
layer under fp8-tensorwise, 0.912 -> 0.832 under fp8-rowwise, and 0.340 under bf16 either way
(its one pass each way is bound by bytes).

Numerics: the same function, rounded once where eager `F.silu(g) * u` rounds twice (silu(g) to
bf16, then the product). Against float64 of the same bf16 inputs the eager dg error falls from
4.7e-3 to 2.6e-3 of max |dg|; compiled, both forms are at 2.6e-3. Eager and compiled results
may differ in their last bit (the sigmoid's exp), as the model's other elementwise ops do, and
compiled code keeps h unrounded where inductor fuses it into its consumer (a quantizer), as it
does every bf16 intermediate unless `emulate_precision_casts` is set. Rounding h explicitly
(`exact.to_dtype`) would pin that, but costs most of the gain: 0.630 -> 0.686 ms a layer under
fp8-tensorwise (`silu_form_probe_s62lib_...`, against 0.705 for `F.silu`).

Saved for backward: g and u (as `F.silu(g) * u` saves them, and silu(g) too when eager).
"""

from __future__ import annotations

import torch

from minifloat.exact import as_dtype

__all__ = ["swiglu", "swiglu_grads"]


class _SwiGLUFunction(torch.autograd.Function):
    """h = silu(g)·u in float32 (float64 inputs: float64), rounded once to the inputs' promoted
    dtype.

    Shapes: g, u, h and dh [..., F]. No GEMM; backward: du = dh·g·s, dg = dh·u·s·(1 + g·(1 - s)),
    s = sigmoid(g) recomputed from the saved g.
    """

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        out_dtype = torch.promote_types(g.dtype, u.dtype)
        work = torch.promote_types(out_dtype, torch.float32)
        gf = g.to(work)
        # as_dtype, not `.to`: under torch 2.11 a no-op `.to` (float32, float64) gave the
        # compiled backward zeros for dh (docs/hopper.md, "Two torch versions"; session 80)
        return as_dtype(gf * torch.sigmoid(gf) * u.to(work), out_dtype)

    @staticmethod
    def backward(ctx, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = ctx.saved_tensors
        dg, du = swiglu_grads(g, u, dh)
        return dg.to(g.dtype), du.to(u.dtype)


def swiglu_grads(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor):
    """(dg, du) of h = silu(g)·u for the upstream gradient dh, unrounded: in float32 (float64
    for float64 inputs), from one sigmoid. `swiglu`'s backward rounds them to g's and u's
    dtypes; compiled, inductor keeps them unrounded where it fuses them into a quantizer, as
    these are (benchmarks/blockwise_swiglu_probe.py's reference)."""
    work = torch.promote_types(torch.promote_types(g.dtype, u.dtype), torch.float32)
    gf, uf, dhf = g.to(work), u.to(work), dh.to(work)
    s = torch.sigmoid(gf)
    return dhf * uf * s * (1 + gf * (1 - s)), dhf * gf * s


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g)·u (the LLaMA MLP's gate times its up projection) with one float32 sigmoid, in
    the dtype `g * u` would have. g and u: the same shape, floating point."""
    if g.shape != u.shape:
        raise ValueError(f"swiglu needs g and u of one shape, got {tuple(g.shape)} and "
                         f"{tuple(u.shape)}")  # fmt: skip
    if not (g.is_floating_point() and u.is_floating_point()):
        raise TypeError(f"swiglu needs floating-point g and u, got {g.dtype} and {u.dtype}")
    return _SwiGLUFunction.apply(g, u)
