"""OCC's clamp bounds: a tensor's [1-alpha, alpha] quantiles without a sort on CUDA.

`quantize.tensor_quantiles` defines the values (linear interpolation between two order
statistics of the finite entries, as `torch.quantile`). On CUDA it sorts, and a 1.3B fp4 step
spent 1.25-1.31 ms of ~72 at six layers (~5 ms at 24) on four thresholds a layer: CUB's sort
kernels, a count and an index kernel, memsets aside (session 67's profiles). Here the order
statistics come from a radix select in Triton instead (kernels/quantiles_triton.py), for inputs
of up to `SELECT_MAX_NUMEL` entries (OCC's threshold sample), and the interpolation is
`quantize.interpolate`, the sort path's own. The values equal the sort's up to the sign of a
zero quantile, as the CPU's kthvalue path already does (tests/test_quantize.py).

The kernels run under a Library op, eagerly and under torch.compile alike, where inductor calls
it as an opaque extern kernel in the sort's place. As a `triton_op` (inductor launching the
kernels from its own code, as kernels/transpose.py does) a six-layer 1.3B fp4 step ran 3-5 ms
slower: 42 thresholds a step instead of 24 (the q, k and v projections' identical thresholds,
and gate and up's, apparently no longer merged into one), and inductor's kernels around them
changed (session 67's profiles). Elsewhere, for empty tensors and above `SELECT_MAX_NUMEL`,
`quantize.tensor_quantiles` itself.
"""

from __future__ import annotations

import struct

import torch

from minifloat.quantize import interpolate, tensor_quantiles

__all__ = ["clip_bounds", "SELECT_MAX_NUMEL"]

# Above this many entries the sort: the largest size measured, where the select's kernels (run
# eagerly) were still faster (236 against 275 us; 17 against 51 at a 65,536-entry sample,
# through this op; benchmarks/results/quantile_select_s67_chunks_*, _s67_op_*).
SELECT_MAX_NUMEL = 1 << 22

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.quantiles_triton import order_statistics as _triton_order_statistics
except ImportError:  # pragma: no cover - depends on the installation
    _triton_order_statistics = None

_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define("order_statistics(Tensor flat, int q_lo_bits, int q_hi_bits) -> Tensor")


def _q_bits(q: float) -> int:
    """float64 q as the int64 of its bits: the kernel takes it whole (a Triton float argument
    would be rounded to float32, and the rank (n - 1) q then computed with another q)."""
    return struct.unpack("<q", struct.pack("<d", q))[0]


def _order_statistics(flat: torch.Tensor, q_lo_bits: int, q_hi_bits: int) -> torch.Tensor:
    return _triton_order_statistics(flat, q_lo_bits, q_hi_bits)  # pragma: no cover - GPU


_LIB.impl("order_statistics", _order_statistics, "CUDA")


@torch.library.register_fake("minifloat::order_statistics")
def _(flat: torch.Tensor, q_lo_bits: int, q_hi_bits: int) -> torch.Tensor:
    return flat.new_empty((2, 3), dtype=torch.float32)


def clip_bounds(flat: torch.Tensor, alpha: float) -> torch.Tensor:
    """[lo, hi], the [1-alpha, alpha] quantiles of 1-D `flat`'s finite entries (NaN if none), as
    one float32 tensor [2]: the values of `quantize.tensor_quantiles` (which reads float32, as
    the kernel does)."""
    if (
        _triton_order_statistics is None
        or not flat.is_cuda
        or not 0 < flat.numel() <= SELECT_MAX_NUMEL
    ):
        return torch.stack(tensor_quantiles(flat, alpha))
    args = (flat.detach().contiguous(), _q_bits(1.0 - alpha), _q_bits(alpha))
    stats = torch.ops.minifloat.order_statistics.default(*args)  # pragma: no cover - GPU
    return interpolate(stats[:, 0], stats[:, 1], stats[:, 2])
