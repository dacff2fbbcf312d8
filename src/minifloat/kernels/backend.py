"""The backend interface QuantLinear computes through, and backend selection by device.

A backend quantizes GEMM operands per an `OperandSpec` and runs the scaled GEMM `a @ bᵀ`. The
emulated backend (kernels/emulated.py) is the reference; the Hopper backend (kernels/hopper.py)
runs the same numerics on FP8 tensor cores and must give bit-identical quantized values and
scales (and bit-identical E2M1 x E2M1 GEMMs, whose fp32 accumulation is exact). The precise
contract is written down in .agents/INTERFACES.md, "Backend interface".

Selection is by device only: never by global flags or environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from minifloat.quantize import Granularity, expand_scale

if TYPE_CHECKING:
    from minifloat.recipes import DGEConfig, OCCConfig, OperandSpec

__all__ = ["Backend", "QOperand", "backend_for", "get_backend", "BACKEND_NAMES"]

BACKEND_NAMES = ("auto", "emulated", "hopper")


@dataclass(frozen=True)
class QOperand:
    """A quantized GEMM operand, 2-D [rows, contraction], with `dequantize() ≈ the operand`.

    `data`: grid values, float32 (emulated) or a torch float8 dtype (hopper). `scale`: float32
    dequantization multiplier: [1,1] for "tensor", [rows,1] for "row", [ceil(rows/br),
    ceil(cols/bc)] for blocks (br, bc). `fmt`: the element format's name.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    granularity: Granularity

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def values(self) -> torch.Tensor:
        """Grid values as float32 (exact for every storage dtype)."""
        return self.data.float()

    def expanded_scale(self) -> torch.Tensor:
        """The scale of every element, data's shape."""
        return expand_scale(self.scale, self.data.shape, self.granularity)

    def dequantize(self) -> torch.Tensor:
        """values * scale in float32."""
        return self.values() * self.expanded_scale()


@runtime_checkable
class Backend(Protocol):
    """What QuantLinear needs from a compute backend (all tensors 2-D)."""

    name: str

    def quantize(
        self,
        x: torch.Tensor,
        spec: OperandSpec,
        *,
        prescale: torch.Tensor | None = None,
        transpose: bool = False,
        clip: tuple[torch.Tensor, torch.Tensor] | None = None,
        scale: torch.Tensor | None = None,
        transposed_copy: bool = False,
    ) -> QOperand:
        """clip -> * prescale -> transpose -> absmax-quantize (or divide by a given tensor scale).

        `transposed_copy=True` is a hint that `transpose(result)` will follow (a fused backend
        may write both layouts in one pass); it never changes the result.
        """
        ...

    def transpose(self, q: QOperand, *, unit_scale: bool = False) -> QOperand:
        """The transposed operand (contiguous); row scales only with unit_scale=True."""
        ...

    def scaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """a @ bᵀ with scales applied ((acc * b_scaleᵀ) * a_scale), + bias, cast to out_dtype."""
        ...

    def apply_dge(
        self, dw: torch.Tensor, w_hp: torch.Tensor, w_q: QOperand, cfg: DGEConfig
    ) -> torch.Tensor:
        """dw * f'(w_hp / w_scale), float32."""
        ...

    def occ_thresholds(self, x: torch.Tensor, cfg: OCCConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Clamp bounds (lo, hi), 0-dim float32."""
        ...

    def occ_outliers(
        self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cols int64 [n], delta float32 [M, n]) of the entries outside [lo, hi]."""
        ...

    def hp_matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """High-precision a @ bᵀ as float32 (OCC compensation terms)."""
        ...


@torch.compiler.assume_constant_result
def _hopper_available(device_type: str, device_index: int | None) -> bool:
    """Whether the Hopper backend can run on this device.

    A constant to torch.compile: dynamo calls it once while tracing instead of tracing it (the
    capability query and the import would each break the graph, and the resumed frame would then
    be recompiled for every input dtype until dynamo's recompile limit sends it back to eager).
    """
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return False
    try:
        import minifloat.kernels.hopper  # noqa: F401
    except ImportError:
        return False
    return True


def get_backend(name: str, device: torch.device | str) -> Backend:
    """The backend called `name` ("auto", "emulated", "hopper") for tensors on `device`.

    "auto" picks hopper on CUDA devices with FP8 tensor cores (sm_89+) when its module imports,
    else emulated. Forcing "hopper" where it cannot run raises RuntimeError.
    """
    from minifloat.kernels.emulated import EmulatedBackend

    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKEND_NAMES)}")
    if name == "emulated":
        return EmulatedBackend()
    if _hopper_available(device.type, device.index):
        from minifloat.kernels.hopper import HopperBackend

        return HopperBackend()
    if name == "hopper":
        raise RuntimeError(
            f"the hopper backend needs a CUDA device with compute capability >= 8.9 and "
            f"minifloat.kernels.hopper; got device {device}"
        )
    return EmulatedBackend()


def backend_for(device: torch.device | str) -> Backend:
    """The fastest exact backend for tensors on `device` (`get_backend("auto", device)`)."""
    return get_backend("auto", device)
