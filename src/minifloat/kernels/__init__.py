"""Compute backends for quantized GEMMs: the exact emulation and (on sm_89+ GPUs) Hopper kernels.

`backend_for(device)` picks one by device; `get_backend(name, device)` forces one. The interface
is `Backend` (kernels/backend.py); `EmulatedBackend` (kernels/emulated.py) is the reference.
"""

from minifloat.kernels.backend import BACKEND_NAMES, Backend, QOperand, backend_for, get_backend
from minifloat.kernels.emulated import EmulatedBackend

__all__ = ["BACKEND_NAMES", "Backend", "QOperand", "EmulatedBackend", "backend_for", "get_backend"]
