"""The backend interface QuantLinear computes through: `QOperand` and the `Backend` protocol.

A backend quantizes GEMM operands per an `OperandSpec` and runs the scaled GEMM `a @ bᵀ`. The
emulated backend (kernels/emulated.py) is the reference on any device; the Hopper backend
(kernels/hopper.py) quantizes with the same PyTorch code (kernels/operand.py, compiled) and runs
the GEMMs on FP8 tensor cores, so quantized values and scales are bit-identical, and so are
E2M1 x E2M1 GEMMs, whose fp32 accumulation is exact. kernels/select.py picks one by device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from minifloat.exact import written_once
from minifloat.quantize import Granularity, expand_scale

if TYPE_CHECKING:
    from minifloat.recipes import DGEConfig, OperandSpec

__all__ = ["Backend", "QOperand", "block_scaled", "fp32_scaled"]


@dataclass(frozen=True)
class QOperand:
    """A quantized GEMM operand, 2-D [rows, contraction], with `dequantize() ≈ the operand`.

    `data`: grid values in a float8 dtype (E2M1 inside E4M3), or float32 for formats without a
    fast path (kernels/operand.py). `scale`: float32
    dequantization multiplier: [1,1] for "tensor", [rows,1] for "row", [ceil(rows/br),
    ceil(cols/bc)] for blocks (br, bc). `fmt`: the element format's name.
    Micro-block operands (kernels/microscale.py) name their `scale_format` ("e4m3": NVFP4's
    E4M3 block scales, stored as float8_e4m3fn, times the fp32 `tensor_scale` [1,1]; "e8m0":
    MX's power-of-two block scales); their GEMM keeps the tensor scale out of the products.
    `transposed`: `data` is a transposed view of a contiguous tensor (the layout the quantizer
    wrote). Known statically, so a backend can make it contiguous (the Hopper backend: eagerly in
    a kernel of its own, kernels/transpose.py; compiled, from the kernel that casts it) without
    asking for strides, which dynamo cannot always answer on tensors saved for backward.
    `multiplier`: an "inv" operand's group multipliers m (its values are round(x * m), its
    scale 1 / m; `formats.inv_scales`), the shape of `scale`, for tensor- and row-scaled
    operands; None otherwise. DGE evaluates f' at x * m, the value the quantizer rounded.

    Every field is given at construction (no defaults; `fp32_scaled` builds the common case):
    for a field left at its default in a compiled graph, dynamo (torch 2.11) guards the default
    through a Python lambda, ~25 µs of host time a compiled layer's call (docs/hopper_sessions.md,
    session 48).
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    granularity: Granularity
    tensor_scale: torch.Tensor | None
    scale_format: str
    transposed: bool
    multiplier: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def values(self) -> torch.Tensor:
        """Grid values as float32 (exact for every storage dtype)."""
        return self.data.float()

    def expanded_scale(self) -> torch.Tensor:
        """The scale of every element, data's shape (block scale x tensor scale, if any)."""
        full = expand_scale(self.scale.float(), self.data.shape, self.granularity)
        return full if self.tensor_scale is None else full * self.tensor_scale

    def dequantize(self) -> torch.Tensor:
        """values * scale in float32.

        A transposed block-scaled operand is dequantized in its storage layout and returned as
        that product's transposed view: the same values in the same strides as eager's product
        of the view. Computed on the view, its loop ran [cols, rows], and under torch.compile
        inductor's CPU code generator fused it with the untransposed operand's dequantization
        of the same tensor ([rows, cols], scales indexed by col // 128: fp8-blockwise's dy, for
        dgrad and wgrad), whose loop split then failed an assertion when rows != cols
        (`try_loop_split`, torch 2.13; found in session 48).
        """
        if self.transposed and isinstance(self.granularity, tuple):
            stored = replace(
                self, data=self.data.t(), scale=self.scale.t(),
                granularity=self.granularity[::-1], transposed=False,
            )  # fmt: skip
            return stored.dequantize().t()
        if isinstance(self.granularity, tuple):
            return block_scaled(
                self.values(), self.scale.float(), self.granularity, self.tensor_scale
            )
        return self.values() * self.expanded_scale()


def block_scaled(
    values: torch.Tensor,
    scale: torch.Tensor,
    granularity: tuple[int, int],
    tensor_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`values * (expand_scale(scale) [* tensor_scale])` of 2-D block-scaled float32 values.

    Compiled for the CPU, values whose last dim ends in a partial block (a wgrad operand of a
    token count that is not a multiple of the block) are multiplied padded to whole blocks and
    cut back in a copy of their own: the same values. Inductor's C++ loop split (torch 2.13)
    splits a loop that indexes scales by col // bc into (cols // bc, bc) and never computes the
    last cols % bc columns, so the GEMM read uninitialized memory (pytorch/pytorch#195582;
    found in session 48). Triton kernels (CUDA) have no such split and keep the plain product.
    """

    def product(v: torch.Tensor) -> torch.Tensor:
        full = expand_scale(scale, v.shape, granularity)
        return v * (full if tensor_scale is None else full * tensor_scale)

    cols, bc = values.shape[-1], granularity[1]
    if cols % bc and values.device.type == "cpu" and torch.compiler.is_compiling():
        whole = written_once(product(F.pad(values, (0, -cols % bc))))
        return whole[..., :cols].contiguous()
    return product(values)


def fp32_scaled(
    data: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    granularity: Granularity,
    transposed: bool,
    multiplier: torch.Tensor | None = None,
) -> QOperand:
    """A `QOperand` with float32 group scales and no tensor scale, every field given."""
    return QOperand(data, scale, fmt, granularity, None, "fp32", transposed, multiplier)


@runtime_checkable
class Backend(Protocol):
    """What QuantLinear needs from a compute backend (all tensors 2-D)."""

    name: str

    def kernel(self, fn: Callable, like: torch.Tensor) -> Callable:
        """`fn`, a plain PyTorch function (kernels/operand.py, dge.py, occ.py), as this backend
        runs it for tensors on `like`'s device (as is, or a compiled twin with the same results)."""
        ...

    def quantize(
        self,
        x: torch.Tensor,
        spec: OperandSpec,
        *,
        prescale: torch.Tensor | None = None,
        transpose: bool = False,
        clip: tuple[torch.Tensor, torch.Tensor] | None = None,
        remainder: bool = False,
        scale: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
    ) -> QOperand:
        """clip -> * prescale -> transpose -> absmax-quantize (or divide by a given scale).
        `remainder`: quantize OCC's x - clamp(x) (kernels/clip.py) instead of clamp(x).
        `seed` (0-dim int64): the random draws of stochastic rounding and Hadamard transforms."""
        ...

    def transpose(self, q: QOperand, *, unit_scale: bool = False) -> QOperand:
        """The transposed operand (its data may be a transposed view); row scales only with
        unit_scale=True."""
        ...

    def quantize_with_transpose(
        self, w: torch.Tensor, spec: OperandSpec
    ) -> tuple[QOperand, QOperand]:
        """(`quantize(w, spec)`, its `transpose`): a weight's fprop operand and the same values
        transposed for dgrad, which a backend may make together (kernels/weight_blocks.py,
        kernels/weight_tensor.py)."""
        ...

    def quantize_weight_pair(
        self, w: torch.Tensor, fprop: OperandSpec, dgrad: OperandSpec
    ) -> tuple[QOperand, QOperand] | None:
        """(`quantize(w, fprop)`, `quantize(w, dgrad, transpose=True)`) made together, where
        dgrad quantizes the weight anew (fp8-rowwise: a scale per row of wᵀ), or None where this
        backend has no joint kernel for the pair: dgrad's is then quantized in backward
        (kernels/weight_rows.py)."""
        ...

    def scaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        fast_accum: bool = False,
    ) -> torch.Tensor:
        """a @ bᵀ with scales applied ((acc * b_scaleᵀ) * a_scale), + bias, cast to out_dtype.

        `fast_accum` lets FP8 tensor cores skip the periodic fp32 promotion of partial sums
        (a speed hint; the emulation sums in fp32 regardless)."""
        ...

    def microscaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """a @ bᵀ of micro-block (NVFP4 / MXFP4) operands, which `scaled_mm` hands over:
        (values x block scales) multiplied exactly, tensor scales applied to the fp32 output
        (kernels/microscale.py). The seam for a native FP4 tensor-core GEMM (Blackwell)."""
        ...

    def apply_dge(
        self, dw: torch.Tensor, w_hp: torch.Tensor, w_q: QOperand, cfg: DGEConfig
    ) -> torch.Tensor:
        """dw * f'(w_hp scaled as its quantizer scaled it: w_hp * m for "inv" operands,
        w_hp / w_scale otherwise), float32."""
        ...
