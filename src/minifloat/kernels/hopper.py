"""The Hopper backend: the emulation's PyTorch quantizers, compiled, and FP8 tensor-core GEMMs.

`HopperBackend` implements the `Backend` protocol (kernels/backend.py) for CUDA tensors on GPUs
with FP8 tensor cores (sm_89+; built and measured for H100/H200). It is `EmulatedBackend` with
these differences, so results never depend on which one ran:

- Quantizers, DGE and OCC's folded operand are the same PyTorch functions (kernels/operand.py,
  kernels/microscale.py, dge.py, occ.py). Under the caller's torch.compile they are traced into
  its graph, where inductor fuses them with their neighbours; called eagerly, they run through a
  `torch.compile`d copy (fused kernels without the caller compiling anything). Both are
  bit-identical to the eager emulation (GPU tests).
- Weights whose fprop values dgrad reuses transposed (fp8-blockwise's 128 x 128 blocks,
  fp8-tensorwise's one scale; `quantize_with_transpose`): opaque Triton kernels that write both
  layouts from the weight (kernels/weight_blocks.py, kernels/weight_tensor.py), same bits; and
  fp8-rowwise's fprop and dgrad operands, each with its own row scales, from two
  (`quantize_weight_pair`, kernels/weight_rows.py).
- scaled_mm: `torch._scaled_mm` (kernels/scaled_mm.py), tensor-wise / row-wise / (1x128,
  128x128) / (1x128, 1x128) scales. An output dim that is not a multiple of 16 falls back to the
  emulated GEMM (fp32 matmul of the FP8 values) with a warning; a ragged contraction dim is
  zero-padded. Operands flagged as transposed views (`QOperand.transposed`: wgrad's dyᵀ made in
  backward; saved xᵀ and wᵀ when running eagerly) are made row-major: under torch.compile by a
  copy inductor writes from the kernel that computes them, eagerly by an opaque tiled transpose
  (kernels/transpose.py; `_row_major`; saved operands under torch.compile: `linear._unstash`).
- microscaled_mm (NVFP4 / MXFP4 operands): the bf16-exact `values x block scale` operands in a
  bf16 GEMM with fp32 output, tensor scales applied to that output (kernels/microscale.py): the
  FP4 numerics at bf16 speed, not faster. A Blackwell path would override this method.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from minifloat.exact import to_dtype, written_once
from minifloat.kernels import microscale, weight_blocks, weight_rows, weight_tensor
from minifloat.kernels import scaled_mm as smm
from minifloat.kernels.backend import QOperand, fp32_scaled
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.kernels.transpose import transpose_copy
from minifloat.recipes import OperandSpec

__all__ = ["HopperBackend", "FallbackWarning"]

_ROWISH = ("tensor", "row")
# torch.mm(a, b, out_dtype=torch.float32) on bf16 operands: one bf16 tensor-core GEMM with fp32
# output (torch >= 2.8, CUDA). Without it, an fp32 GEMM of the same (bf16-exact) values.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """The compiled twin of a plain PyTorch function, made once per function: eager callers get
    fused kernels through it; under the caller's torch.compile `fn` itself is traced instead."""
    return torch.compile(fn)


class FallbackWarning(UserWarning):
    """A GEMM ran in the emulation because the FP8 tensor-core path cannot take it."""


class HopperBackend(EmulatedBackend):
    """FP8 tensor-core backend; bit-exact with `EmulatedBackend` (see the module docstring)."""

    name = "hopper"

    def kernel(self, fn: Callable, like: torch.Tensor) -> Callable:
        """The compiled twin of `fn` for eager CUDA calls; `fn` itself while tracing. Tracing
        includes fake tensors outside `is_compiling()`: dynamo runs a traceable subclass's
        `__torch_dispatch__` (fsdp_weight.GatheredWeight's) on them to propagate shapes, and a
        compiled twin there would launch its kernels on tensors without data."""
        if like.is_cuda and not torch.compiler.is_compiling() and not is_fake(like):
            return _compiled(fn)
        return fn

    def quantize_with_transpose(
        self, w: torch.Tensor, spec: OperandSpec
    ) -> tuple[QOperand, QOperand]:
        """A weight's E4M3 operand and its transpose written by opaque kernels: fp8-blockwise's
        128x128 blocks in one (kernels/weight_blocks.py: five inductor kernels a weight before),
        fp8-tensorwise's one scale in two (kernels/weight_tensor.py); else as emulated."""
        args = (w, spec.fmt, spec.granularity, spec.scale_format, spec.rounding)
        inv = spec.scale_format == "inv"
        if weight_blocks.supports(*args):
            values, values_t, scale, scale_t = weight_blocks.weight_blocks(w, inv=inv)
            block = spec.granularity
            return (
                fp32_scaled(values, scale, spec.fmt, block, False),
                fp32_scaled(values_t, scale_t, spec.fmt, block[::-1], False),
            )
        if weight_tensor.supports(*args):
            values, values_t, scale, m = weight_tensor.weight_tensor(w, inv=inv)
            return (
                fp32_scaled(values, scale, spec.fmt, "tensor", False, m if inv else None),
                fp32_scaled(values_t, scale, spec.fmt, "tensor", False),
            )
        return super().quantize_with_transpose(w, spec)

    def quantize_weight_pair(
        self, w: torch.Tensor, fprop: OperandSpec, dgrad: OperandSpec
    ) -> tuple[QOperand, QOperand] | None:
        """fp8-rowwise's fprop (w) and dgrad (wᵀ) operands, each with its own row scales, from
        two opaque kernels (kernels/weight_rows.py); None for other specs (as emulated)."""
        if not weight_rows.supports(w, fprop, dgrad):
            return None
        inv = fprop.scale_format == "inv"
        values, values_t, scale, m, scale_t, m_t = weight_rows.weight_rows(w, inv=inv)
        return (
            fp32_scaled(values, scale, fprop.fmt, "row", False, m if inv else None),
            fp32_scaled(values_t, scale_t, dgrad.fmt, "row", False, m_t if inv else None),
        )

    def scaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        fast_accum: bool = False,
    ) -> torch.Tensor:
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"contraction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
        kind = _gemm_kind(a, b)
        if kind is None or not smm.supported(a.data, b.data):
            if a.data.is_cuda and kind is not None:
                warnings.warn(
                    f"minifloat: GEMM with output dims {a.shape[0]}x{b.shape[0]} (not multiples "
                    "of 16) runs in the emulation, not on FP8 tensor cores",
                    FallbackWarning,
                    stacklevel=2,
                )
            return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        gemm_dtype = torch.float32 if bias is not None else out_dtype
        a_data, b_data = _row_major(a), _row_major(b)
        if kind == "rowish":
            out = smm.scaled_mm_rowish(
                a_data, a.scale, b_data, b.scale, out_dtype=gemm_dtype, use_fast_accum=fast_accum
            )
        else:
            out = smm.scaled_mm_blocks(
                a_data, a.scale, b_data, b.scale, b.granularity, out_dtype=gemm_dtype
            )
        if bias is not None:
            out = to_dtype(out + bias.float(), out_dtype)
        return out

    def microscaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The micro-block GEMM as a bf16 GEMM with fp32 output (exact operands; fp32 sums)."""
        if not a.data.is_cuda:
            return super().microscaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        return microscale.dequantized_mm(a, b, out_dtype=out_dtype, bias=bias, gemm=_bf16_gemm)


def _bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ bᵀ, fp32 [R, C], of float32 operands whose values are exact in bf16."""
    if _MM_OUT_DTYPE:
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).t(), out_dtype=torch.float32)
    return a @ b.t()


def _row_major(q: QOperand) -> torch.Tensor:
    """q's values row-major, as the FP8 GEMM reads them.

    Under torch.compile every operand passes through `_one_buffer`. For a transposed view
    (wgrad's dyᵀ, made in backward) that is a contiguous copy of the view, which inductor writes
    from the kernel that computes the values, as a second store in 2-D tiles (the quantizer's
    cast, after its maxima pass). The opaque tiled transpose (kernels/transpose.py), a kernel of
    its own that reads those bytes back, made each of the five recipes timed 1.2-4.9 ms a 1.3B
    step slower (docs/hopper_sessions.md, session 60). Eagerly a transposed view is copied by
    that opaque transpose.
    """
    if torch.compiler.is_compiling():
        return _one_buffer(q.data)
    return transpose_copy(q.data.t()) if q.transposed else q.data


def _one_buffer(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] as a buffer of its own, written once however many GEMMs read it (under compile).

    Inductor gives every `_scaled_mm` (and opaque op) whose input is a fused expression not yet
    written to memory its own copy of it, stored by the producing kernel: q/k/v each stored the
    FP8 input again, and in backward each wrote its own transposed copy of the recomputed input,
    byte stores a column apart inside the norm backward's row reduction (1.3B profile, session
    20). `exact.written_once` (`as_strided`, the identity) makes inductor write it once. A
    transposed view comes out as its contiguous copy (`_row_major`: wgrad's dyᵀ, which the cast's
    kernel then writes transposed).
    """
    return written_once(t)


def _gemm_kind(a: QOperand, b: QOperand) -> str | None:
    """GEMM kind: "rowish" (tensor/row scales), "blocks" (1x128 lhs), or None (emulate)."""
    if a.data.dtype not in smm.FP8_DTYPES or b.data.dtype not in smm.FP8_DTYPES:
        return None
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        return None  # no E5M2 x E5M2 tensor-core GEMM
    if a.granularity in _ROWISH and b.granularity in _ROWISH:
        return "rowish"
    if a.granularity == (1, 128) and b.granularity in ((128, 128), (1, 128)):
        return "blocks"
    return None
