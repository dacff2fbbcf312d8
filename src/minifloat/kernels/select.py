"""Backend selection by device: the Hopper fast path on FP8-capable GPUs, else the emulation.

Selection is by device only, never by global flags or environment variables.
"""

from __future__ import annotations

import torch

from minifloat.kernels.backend import Backend
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.kernels.hopper import HopperBackend

__all__ = ["BACKEND_NAMES", "get_backend", "backend_for"]

BACKEND_NAMES = ("auto", "emulated", "hopper")


@torch.compiler.assume_constant_result
def _fp8_gemm_available(device_type: str, device_index: int | None) -> bool:
    """Whether FP8 tensor-core GEMMs (`torch._scaled_mm`, sm_89+) run on this device.

    A constant to torch.compile: dynamo calls it once while tracing instead of tracing it (the
    capability query would break the graph, and the resumed frame would then be recompiled for
    every input dtype until dynamo's recompile limit sends it back to eager).
    """
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def get_backend(name: str, device: torch.device | str) -> Backend:
    """The backend called `name` ("auto", "emulated", "hopper") for tensors on `device`.

    "auto" picks hopper on CUDA devices with FP8 tensor cores (sm_89+), else emulated. Forcing
    "hopper" where it cannot run raises RuntimeError.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKEND_NAMES)}")
    if name == "emulated":
        return EmulatedBackend()
    if _fp8_gemm_available(device.type, device.index):
        return HopperBackend()
    if name == "hopper":
        raise RuntimeError(
            f"the hopper backend needs a CUDA device with compute capability >= 8.9; got device "
            f"{device}"
        )
    return EmulatedBackend()


def backend_for(device: torch.device | str) -> Backend:
    """The fastest exact backend for tensors on `device` (`get_backend("auto", device)`)."""
    return get_backend("auto", device)
