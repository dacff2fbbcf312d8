"""The transposed copy of a 2-D tensor as one opaque kernel, for FP8 GEMM operands.

Hopper's FP8 GEMMs read both operands K-major, so wgrad needs dyᵀ and xᵀ, and dgrad wᵀ, written
out. The quantizers return those operands as transposed *views* (kernels/operand.py), and the
GEMM makes them contiguous. `transpose_copy` is a custom op, so the compiler cannot fuse into
it: the producer writes its values row-major (coalesced) and this kernel transposes them in
tiles. The Hopper backend uses it for eager GEMMs. Under torch.compile it lets inductor write
the transposed copy from the kernel that computes the values instead (`hopper._row_major`):
when that kernel was a SwiGLU or RMSNorm backward storing single bytes a column apart, the
fused copy cost 2-3x its bytes (2026-11-23); since each quantizer's cast is a pointwise pass
after its maxima, inductor tiles it in 2-D and the fused copy is the faster (session 60).

On CUDA with Triton (the GPU machine) it runs a tiled Triton kernel (kernels/transpose_triton.py),
when called under torch.compile as a `triton_op` that inductor launches from its own code (the
Hopper backend's compiled path no longer calls it: kept for compiled callers such as the tests
and benchmarks/transpose_bench.py; since session 60's change no shape timed, the 7B layer's
included, has been clearly slower with the fused copy: docs/hopper_sessions.md, session 61);
elsewhere ATen's copy. Only bytes move: the result equals `x.t().contiguous()` bit for bit.
"""

from __future__ import annotations

import torch

from minifloat.kernels.operand import unpack_e2m1

__all__ = ["transpose_copy", "unpack_e2m1_t"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.transpose_triton import transpose_2d as _triton_transpose
    from minifloat.kernels.transpose_triton import unpack_e2m1_t_2d as _triton_unpack_t
except ImportError:  # pragma: no cover - depends on the installation
    _triton_transpose = _triton_unpack_t = None


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


# Under torch.compile on CUDA the same kernel is a `triton_op`: inductor traces into it and
# launches the Triton kernel from its generated code, as it launches its own, instead of calling
# the op above through Python and Triton's JIT launcher (~200 us of a compiled 7B-shaped layer's
# profiled host time in session 48, `host_profile_s48_*`). A user-defined Triton kernel is never
# fused with its neighbours, so it stays the opaque pass the module docstring asks for. Eager
# calls keep the Library op, whose wrapper is cheaper than a custom op's (above).
if _triton_transpose is not None:

    @torch.library.triton_op("minifloat::transpose_copy_traced", mutates_args=())
    def _transpose_copy_traced(x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - GPU
        return _triton_transpose(x.contiguous(), traced=True)


def transpose_copy(x: torch.Tensor) -> torch.Tensor:
    """`x.t()` as a new contiguous tensor, for 2-D `x` of any dtype (an opaque kernel: see the
    module docstring). Carries no gradient (GEMM operands are quantized values)."""
    if x.dim() != 2:
        raise ValueError(f"transpose_copy takes a 2-D tensor, got shape {tuple(x.shape)}")
    if _triton_transpose is not None and x.is_cuda and x.numel() and torch.compiler.is_compiling():
        return torch.ops.minifloat.transpose_copy_traced.default(x)  # pragma: no cover - GPU
    return torch.ops.minifloat.transpose_copy.default(x)


# Saved E2M1 operands (packed two a byte) meet their backward GEMM transposed: one pass from the
# packed codes to the GEMM's layout (a Triton kernel on CUDA). Packed are those saved eagerly and
# the micro-block ones under compile; compiled row-scaled operands are recomputed in backward
# instead and never packed (linear._stash; docs/hopper_sessions.md, sessions 7 and 8).
_LIB.define("unpack_e2m1_t(Tensor packed, int cols) -> Tensor")


def _unpack_e2m1_t(packed: torch.Tensor, cols: int) -> torch.Tensor:
    if packed.is_cuda and _triton_unpack_t is not None and packed.numel() > 0:
        return _triton_unpack_t(packed.contiguous(), cols)
    return unpack_e2m1(packed, cols).t().clone(memory_format=torch.contiguous_format)


_LIB.impl("unpack_e2m1_t", _unpack_e2m1_t, "CompositeExplicitAutograd")


@torch.library.register_fake("minifloat::unpack_e2m1_t")
def _(packed: torch.Tensor, cols: int) -> torch.Tensor:
    return packed.new_empty((cols, packed.shape[0]), dtype=torch.float8_e4m3fn)


def unpack_e2m1_t(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """`unpack_e2m1(packed, cols).t()` as a new contiguous float8_e4m3fn tensor [cols, rows], in
    one opaque kernel: E2M1 codes packed two a byte [rows, ceil(cols/2)] (`pack_e2m1`) to the
    transposed FP8 operand a backward GEMM reads."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(
            f"unpack_e2m1_t takes 2-D uint8 codes, got {packed.dtype} {tuple(packed.shape)}"
        )
    if not 2 * packed.shape[1] - 1 <= cols <= 2 * packed.shape[1]:
        raise ValueError(f"{packed.shape[1]} packed columns cannot hold {cols} values")
    return torch.ops.minifloat.unpack_e2m1_t.default(packed, cols)
