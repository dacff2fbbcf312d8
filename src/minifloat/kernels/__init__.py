"""Compute backends for quantized GEMMs: the exact emulation and (on sm_89+ GPUs) FP8 tensor cores.

`backend_for(device)` picks one by device; `get_backend(name, device)` forces one. The interface
is `Backend` (kernels/backend.py); `EmulatedBackend` (kernels/emulated.py) is the reference; both
quantize with kernels/operand.py.
"""

from minifloat.kernels.backend import Backend, QOperand
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.kernels.select import BACKEND_NAMES, backend_for, get_backend

__all__ = ["BACKEND_NAMES", "Backend", "QOperand", "EmulatedBackend", "backend_for", "get_backend"]
