"""The SwiGLU backward's tensor-scaled GEMM operands as one opaque op (mlp.py's unit).

Under a tensor-scaled recipe (fp8-tensorwise) the backward of `w_down(silu(g)·u)` needs, from
the saved g = x·w_gateᵀ, u = x·w_upᵀ and the down projection's dgrad output dh:
- h_qᵀ: h = silu(g)·u quantized under h's scale from forward, transposed (w_down's wgrad);
- dg_q, du_q: dg = silu'(g)·u·dh and du = silu(g)·dh quantized under one scale each (w_gate's
  and w_up's dgrad), and their transposes dg_qᵀ, du_qᵀ (their wgrad).
Compiled as three QuantLinears, inductor spreads these over six kernels, which at 7B width ran
at ~57 % of copy bandwidth; `swiglu_triton.py` writes all five from one read of g, u and dh
after one pass for the two maxima (docs/hopper_sessions.md, session 35).

One definition, two implementations. `reference` is plain PyTorch: h, dg and du in float32 from
the inputs through ATen's `silu` and `silu_backward`, then `quantize_operand`. On CUDA with
Triton the op runs the kernels, which compute what inductor generates for that same reference
(tests/test_swiglu.py, GPU: bit for bit against `torch.compile(reference)`): inductor's float32
division is Triton's approximate `div.full.f32`, not ATen's correctly rounded one, so the
compiled forms differ from eager ATen in the last bit of some quotients. mlp.py computes
forward's h through the backend's compiled twin on CUDA, so that the h_qᵀ made here is the
h_q its forward used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minifloat import formats
from minifloat.kernels.operand import FP8_STORAGE, quantize_operand, scale_from_amax

__all__ = ["swiglu_backward_tensorwise", "reference", "swiglu_hp", "FORMATS"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels import swiglu_triton as _triton
except ImportError:  # pragma: no cover - depends on the installation
    _triton = None

FORMATS = ("e4m3", "e5m2")  # the op's formats (FP8 storage without group scales)


def swiglu_hp(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """h = silu(g)·u in float32 from g and u of any float dtype (no rounding between)."""
    return F.silu(g.float()) * u.float()


def reference(
    g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, h_scale: torch.Tensor,
    h_fmt: str, grad_fmt: str,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(h_qᵀ [F, M], dg_q [M, F], dg_qᵀ [F, M], du_q, du_qᵀ, dg's scale, du's scale [1, 1]) in
    plain PyTorch; see the module docstring."""
    g32, u32, dh32 = g.float(), u.float(), dh.float()
    silu = F.silu(g32)
    h, du = silu * u32, dh32 * silu
    dg = torch.ops.aten.silu_backward(dh32 * u32, g32)
    h_t, _ = quantize_operand(h, h_fmt, "tensor", scale=h_scale, transpose=True)
    dg_q, s_g = quantize_operand(dg, grad_fmt, "tensor")
    du_q, s_u = quantize_operand(du, grad_fmt, "tensor")
    # clones, not `.contiguous()`: with one row or column a transposed view is contiguous,
    # and an op's outputs may not alias each other
    h_t = h_t.clone(memory_format=torch.contiguous_format)
    return h_t, dg_q, _t(dg_q), du_q, _t(du_q), s_g, s_u


def _t(q: torch.Tensor) -> torch.Tensor:
    return q.t().clone(memory_format=torch.contiguous_format)


# Library-defined (not `torch.library.custom_op`: its Python wrapper costs ~19 us of host time
# a call against ~3 us, kernels/transpose.py).
_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define(
    "swiglu_backward_tensorwise(Tensor g, Tensor u, Tensor dh, Tensor h_scale, str h_fmt, "
    "str grad_fmt) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _swiglu_backward(g, u, dh, h_scale, h_fmt, grad_fmt):
    if g.is_cuda and _triton is not None and g.numel() > 0:
        return _on_gpu(g.contiguous(), u.contiguous(), dh.contiguous(), h_scale, h_fmt, grad_fmt)
    return reference(g, u, dh, h_scale, h_fmt, grad_fmt)


def _on_gpu(g, u, dh, h_scale, h_fmt, grad_fmt):  # pragma: no cover - runs on the GPU
    """The Triton kernels, with the scales between them in plain PyTorch (a few scalars)."""
    s = scale_from_amax(_triton.swiglu_backward_maxima(g, u, dh), formats.get(grad_fmt).max)
    outs = _triton.swiglu_backward_cast(
        g, u, dh, h_scale.float().reshape(1).double().reciprocal(), s.double().reciprocal(),
        FP8_STORAGE[h_fmt], FP8_STORAGE[grad_fmt],
    )  # fmt: skip
    # each scale a tensor of its own: outputs may not alias, and cuBLAS wants 16-byte aligned
    # scale pointers
    return (*outs, s[0:1].reshape(1, 1).clone(), s[1:2].reshape(1, 1).clone())


_LIB.impl("swiglu_backward_tensorwise", _swiglu_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("minifloat::swiglu_backward_tensorwise")
def _(g, u, dh, h_scale, h_fmt, grad_fmt):
    m, n = g.shape
    h_dtype, grad_dtype = FP8_STORAGE[h_fmt], FP8_STORAGE[grad_fmt]
    scale = g.new_empty((1, 1), dtype=torch.float32)
    return (
        g.new_empty((n, m), dtype=h_dtype), g.new_empty((m, n), dtype=grad_dtype),
        g.new_empty((n, m), dtype=grad_dtype), g.new_empty((m, n), dtype=grad_dtype),
        g.new_empty((n, m), dtype=grad_dtype), scale, scale.clone(),
    )  # fmt: skip


def swiglu_backward_tensorwise(
    g: torch.Tensor,
    u: torch.Tensor,
    dh: torch.Tensor,
    h_scale: torch.Tensor,
    h_fmt: str = "e4m3",
    grad_fmt: str = "e5m2",
) -> tuple[torch.Tensor, ...]:
    """The five FP8 operands of a SwiGLU's backward and dg's and du's scales, in one opaque op.

    Args:
        g, u: the gate and up projections' outputs [M, F] (saved by forward), any float dtype.
        dh: the gradient of h = silu(g)·u, [M, F] (the down projection's dgrad output).
        h_scale: h's tensor scale [1, 1] from forward (its h_q fed the down projection).
        h_fmt, grad_fmt: h's format and dg's and du's ("e4m3" or "e5m2").
    Returns:
        (h_qᵀ [F, M] under `h_scale`, dg_q [M, F], dg_qᵀ [F, M], du_q, du_qᵀ, dg's scale,
        du's scale): FP8 values (`FP8_STORAGE`), float32 scales [1, 1] from each tensor's amax.
    """
    if g.dim() != 2 or g.shape != u.shape or g.shape != dh.shape:
        raise ValueError(
            f"g, u and dh must be 2-D of one shape, got {tuple(g.shape)}, {tuple(u.shape)}, "
            f"{tuple(dh.shape)}"
        )
    for name, fmt in (("h_fmt", h_fmt), ("grad_fmt", grad_fmt)):
        if fmt not in FORMATS:
            raise ValueError(f"{name} must be one of {FORMATS}, got {fmt!r}")
    if h_scale.numel() != 1:
        raise ValueError(f"h_scale must hold one tensor scale, got shape {tuple(h_scale.shape)}")
    return torch.ops.minifloat.swiglu_backward_tensorwise.default(
        g, u, dh, h_scale.float().reshape(1, 1), h_fmt, grad_fmt
    )
