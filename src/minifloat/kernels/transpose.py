"""The transposed copy of a 2-D tensor as one opaque kernel, for FP8 GEMM operands.

Hopper's FP8 GEMMs read both operands K-major, so wgrad needs dyᵀ and xᵀ, and dgrad wᵀ, written
out. The quantizers return those operands as transposed *views* (kernels/operand.py), and the
GEMM makes them contiguous. Left to inductor, that copy is fused into the kernel that produced
the values (a SwiGLU or RMSNorm backward, an unpack of saved E2M1 bytes), which then stores
single bytes a whole column apart: a 1.3B profile showed those kernels at 2-3x the time of their
bytes. `transpose_copy` is a custom op, so the compiler cannot fuse into it: the producer
writes its values row-major (coalesced) and this kernel transposes them in tiles.

On CUDA with Triton (the GPU machine) it runs a tiled Triton kernel (kernels/transpose_triton.py);
elsewhere ATen's copy. Only bytes move: the result equals `x.t().contiguous()` bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["transpose_copy"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.transpose_triton import transpose_2d as _triton_transpose
except ImportError:  # pragma: no cover - depends on the installation
    _triton_transpose = None


# A Library-defined op, not `torch.library.custom_op`: the latter's Python wrapper costs ~19 us of
# host time per call against ~3 us (measured on the CPU), and a 1.3B step makes hundreds of calls.
_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define("transpose_copy(Tensor x) -> Tensor")


def _transpose_copy(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and _triton_transpose is not None and x.numel() > 0:
        return _triton_transpose(x.contiguous())
    return x.t().clone(memory_format=torch.contiguous_format)


_LIB.impl("transpose_copy", _transpose_copy, "CompositeExplicitAutograd")


@torch.library.register_fake("minifloat::transpose_copy")
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0]))


def transpose_copy(x: torch.Tensor) -> torch.Tensor:
    """`x.t()` as a new contiguous tensor, for 2-D `x` of any dtype (an opaque kernel: see the
    module docstring). Carries no gradient (GEMM operands are quantized values)."""
    if x.dim() != 2:
        raise ValueError(f"transpose_copy takes a 2-D tensor, got shape {tuple(x.shape)}")
    return torch.ops.minifloat.transpose_copy.default(x)
