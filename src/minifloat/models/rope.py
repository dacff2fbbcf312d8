"""Rotary position embedding (RoPE), rotate-half layout, as one autograd Function.

    out = x·cos + rotate_half(x)·sin,   rotate_half(x) = [-x_hi, x_lo]    (in float32)
    dx  = g·cos + [ (g·sin)_hi, -(g·sin)_lo ]

Why a Function: under torch.compile (torch 2.11) the backward of the plain form reads g at
three offsets and sin at two, and inductor realizes a reused node past four reads. The reused
node is the `.float()` of the quantizers of the q and k projections' gradients: inductor stored
the rotated gradients as float32 [tokens, dim] buffers (the row maxima fused into the kernel
that writes them), which the column maxima and the casts read back: 4 bytes an entry written
once and read twice, where eager rounds them to bf16. Here the compiled backward is one
Triton kernel on CUDA (models/rope_triton.py, a `triton_op`) that writes dx in g's dtype, and
the quantizers read two bytes an entry: those kernels took 2.14 against 2.75 ms a 6-layer 1.3B
fp4 step, the kernel's own 0.44 included, in one profiled run each
(`train_e2e_1.3B_ours_s79_ropeop3_*`; docs/hopper_sessions.md, session 79). The attention
block's q and k are [B, T, H, D] projections seen as [B, H, T, D]: the Function works on the
former, so SDPA's gradient reaches the kernel contiguous (dynamo makes a Function's incoming
gradients contiguous: a [B, H, T, D] Function cost a copy of it, session 79).

The forward stays plain PyTorch (inductor fuses it with its neighbours). The backward has
eager autograd's bits of the plain form eagerly (any layout) and on the kernel's path (CUDA,
compiled, 4-D x, contiguous float32 [T, D] tables): its products and sum rounded once each, in
that order (tests/test_rope.py), except that Triton flushes float32 subnormals, operands and
results, to zero (as inductor's own kernels do). Elsewhere under compile inductor compiles
`rope_grad`, and may contract a product into an FMA (docs/hopper.md, "Rules learned"). Tables
that require grad, or that broadcast x to a larger shape, take the plain form.
"""

from __future__ import annotations

import math

import torch

from minifloat.exact import as_dtype

__all__ = ["rope_cos_sin", "apply_rope", "rope_grad"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.models.rope_triton import rope_grad_rows as _triton_rope_grad
except ImportError:  # pragma: no cover - depends on the installation
    _triton_rope_grad = None


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables of shape [seq_len, head_dim] in the rotate-half layout.

    Frequency ``j`` (of head_dim/2) appears at columns ``j`` and ``j + head_dim/2``.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim >= 2, got {head_dim!r}")
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"RoPE theta must be positive and finite, got {theta!r}")  # NaN tables
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The plain form. `as_dtype`, not `.to`: the Function returns this, and under torch 2.11 a
    no-op `.to` (float32 x) gave its compiled backward zeros for g (session 80)."""
    x_fp32 = x.float()
    return as_dtype(x_fp32 * cos + _rotate_half(x_fp32) * sin, x.dtype)


def rope_grad(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """dx of `apply_rope` for the upstream gradient g (x's shape and dtype), computed as eager
    autograd computes it from the plain form: in float32, rounded to g's dtype once."""
    g_fp32 = g.float()
    low, high = (g_fp32 * sin).chunk(2, dim=-1)
    return (g_fp32 * cos + torch.cat((high, -low), dim=-1)).to(g.dtype)


def _kernel_fits(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int) -> bool:
    """Whether the Triton kernel takes these: a contiguous 4-D CUDA gradient whose dim
    `seq_dim` is the tables' T, and contiguous float32 tables [T, D] (D even: `apply_rope`
    refuses odd sizes)."""
    if _triton_rope_grad is None or not g.is_cuda or g.dim() != 4 or g.numel() == 0:
        return False
    shape = (g.shape[seq_dim], g.shape[-1])
    tables = all(
        t.dtype == torch.float32 and t.is_contiguous() and t.shape == shape for t in (cos, sin)
    )
    return g.is_contiguous() and tables


class _RopeFunction(torch.autograd.Function):
    """out = x·cos + rotate_half(x)·sin in float32, rounded to x's dtype; no GEMM.

    Shapes: x and out [B, T, H, D] (`tokens_major`; cos and sin float32 [T, D], broadcast over
    H) or any shape cos and sin broadcast to. Backward: dx = g·cos + [(g·sin)_hi, -(g·sin)_lo]
    (`rope_grad`); the tables get none (`apply_rope` sends tables that require grad to the
    plain form).
    """

    @staticmethod
    def forward(ctx, x, cos, sin, tokens_major: bool):
        ctx.save_for_backward(cos, sin)
        ctx.tokens_major = tokens_major
        return _rope(x, *_broadcast(cos, sin, tokens_major))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos, sin = ctx.saved_tensors
        seq_dim = 1 if ctx.tokens_major else 2
        # under compile g is contiguous here: dynamo makes a Function's gradients contiguous
        # (a [B, H, T, D] Function cost a copy of SDPA's [B, T, H, D] gradient: session 79)
        if torch.compiler.is_compiling() and _kernel_fits(g, cos, sin, seq_dim):
            inner = g.shape[2] if ctx.tokens_major else 1  # a row's position: (r // inner) % T
            dx = torch.ops.minifloat.rope_grad_traced.default(g, cos, sin, inner)
        else:
            dx = rope_grad(g, *_broadcast(cos, sin, ctx.tokens_major))
        return dx, None, None, None


def _broadcast(cos: torch.Tensor, sin: torch.Tensor, tokens_major: bool):
    """The tables as x's layout broadcasts them: [T, 1, D] for [B, T, H, D]."""
    return (cos.unsqueeze(-2), sin.unsqueeze(-2)) if tokens_major else (cos, sin)


if _triton_rope_grad is not None:

    @torch.library.triton_op("minifloat::rope_grad_traced", mutates_args=())
    def _rope_grad_traced(
        g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inner: int
    ) -> torch.Tensor:  # pragma: no cover - GPU
        return _triton_rope_grad(g, cos, sin, inner, traced=True)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, head_dim] by position in fp32; returns x's dtype.

    Pairs (i, i + head_dim/2) form the complex number x_i + i*x_{i+half}, multiplied by
    exp(i * t * theta^(-2i/head_dim)). cos and sin: float tables that broadcast against x
    ([T, head_dim] from `rope_cos_sin`). The backward's bits: the module docstring.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"RoPE pairs the entries of x's last dim, got an odd size {x.shape[-1]}")
    if not x.is_floating_point():  # an int x came back rotated and truncated
        raise TypeError(f"RoPE rotates floating-point x, got {x.dtype}")
    if (
        cos.requires_grad
        or sin.requires_grad
        or torch.broadcast_shapes(x.shape, cos.shape, sin.shape) != x.shape
    ):
        return _rope(x, cos, sin)
    if x.dim() == 4 and cos.dim() == 2 and x.transpose(1, 2).is_contiguous():
        # the attention block's q and k: [B, T, H, D] projections seen as [B, H, T, D]. Their
        # gradient comes back in that layout (SDPA's keeps its input's strides), contiguous
        # as [B, T, H, D]: the kernel's rows, without a copy
        return _RopeFunction.apply(x.transpose(1, 2), cos, sin, True).transpose(1, 2)
    return _RopeFunction.apply(x, cos, sin, False)
