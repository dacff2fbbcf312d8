"""The row maxima and the column maxima of one tensor, from one read of it.

fp8-rowwise's backward quantizes each linear's dy twice: by rows for dgrad (a scale a token)
and by columns for wgrad (a scale a channel), and each quantizer reads dy for its maxima.
Inductor cannot fuse two reductions along different axes of one tensor into one read; a 2-D
tile reduces both ways at once. `row_and_column_amax` gives what `operand.row_amax` and
`operand._column_amax` give, bit for bit (integer maxima of the magnitude bits, exact and
order-independent), and the caller hands them to the two quantizers (`quantize_operand`'s
`amax`).

On CUDA with Triton, for bf16 input, it runs one tiled Triton kernel that writes both maxima as
partials (kernels/dual_amax_triton.py), under torch.compile as a `triton_op` that inductor
launches from its own code (as kernels/transpose.py's), and finishes them with two small
reductions that inductor fuses into the scales' computation. Elsewhere, the two reductions
themselves. Alone on an H200 the kernel takes 0.034 against inductor's 0.048 ms at 16384 x 2048
and 0.064 against 0.170 at 16384 x 5632 (`benchmarks/results/dual_amax_probe_s64_tile_*`).
"""

from __future__ import annotations

import torch

from minifloat.kernels.operand import _column_amax, row_amax

__all__ = ["row_and_column_amax"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.dual_amax_triton import row_column_partials as _triton_partials
except ImportError:  # pragma: no cover - depends on the installation
    _triton_partials = None

if _triton_partials is not None:

    @torch.library.triton_op("minifloat::row_column_partials", mutates_args=())
    def _partials_traced(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _triton_partials(x, traced=True)  # pragma: no cover - GPU


def _finish(partials: torch.Tensor) -> torch.Tensor:
    """The maximum of int16 magnitude-bit partials, as float32 magnitudes [1, n]."""
    return partials.amax(dim=0, keepdim=True).view(torch.bfloat16).float()


def row_and_column_amax(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|v|.amax over columns [R, 1], |v|.amax over rows [1, C]) float32 of 2-D `v`, NaN where
    the reduced entries hold one: `(operand.row_amax(v), operand._column_amax(v))` bit for bit,
    in one read of v on CUDA (bf16)."""
    if v.dim() != 2:
        raise ValueError(f"row_and_column_amax takes a 2-D tensor, got shape {tuple(v.shape)}")
    if _triton_partials is None or not v.is_cuda or v.dtype != torch.bfloat16 or not v.numel():
        return row_amax(v), _column_amax(v)
    x = v.contiguous()  # pragma: no cover - GPU from here
    if torch.compiler.is_compiling():
        rowp, colp = torch.ops.minifloat.row_column_partials.default(x)
    else:
        rowp, colp = _triton_partials(x)
    return _finish(rowp).reshape(-1, 1), _finish(colp)
