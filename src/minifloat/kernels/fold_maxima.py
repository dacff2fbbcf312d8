"""The wgrad fold's column maxima as one opaque kernel: max over rows of |x · s|.

Recipes whose fprop scales x by rows and whose wgrad reuses those values (fp4-direct, fp4-dge,
fp4) fold x's row scales s [M, 1] into dy before quantizing dyᵀ by rows of dyᵀ, i.e. by
columns of dy: `operand._quantize` takes the column maxima of dy · s, then casts. Compiled,
inductor's reduction kernel loads s with an index that depends on the program's columns as
well as its rows (the band `xindex // C`), one load of s an element of dy: those maxima ran at
55-70 % of copy bandwidth where the same reduction of dy · 2 ran at 66-85 %
(`column_maxima_probe_s95b_h200_2026-12-04.md`). The Triton kernel here loads s once a row
(kernels/fold_maxima_triton.py): 65-89 % of copy at the five quantizer shapes, 4-26 % faster.

Its input is dy itself, which inductor then writes out for it (a leaf's gradient or a GEMM's
output already is). Same bits as `operand._column_amax(x.float() * s)`: a maximum does not
depend on its order, and each product is the same float32 multiply (tests/test_fold_maxima.py).
Eager calls run a Library op (cheaper to call than a custom op: kernels/transpose.py), calls
under torch.compile a `triton_op` that inductor launches from its own code.
"""

from __future__ import annotations

import torch

__all__ = ["fold_column_amax", "supports"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.fold_maxima_triton import BAND, COLS
    from minifloat.kernels.fold_maxima_triton import fold_column_amax_2d as _triton_fold
except ImportError:  # pragma: no cover - depends on the installation
    _triton_fold, BAND, COLS = None, 256, 64

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define("fold_column_amax(Tensor x, Tensor s) -> Tensor")


def _fold_column_amax(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if _triton_fold is None or not x.is_cuda:  # the op is only called where `supports`
        raise RuntimeError("minifloat::fold_column_amax runs on CUDA with Triton")
    return _triton_fold(x.contiguous(), s.float().contiguous())


_LIB.impl("fold_column_amax", _fold_column_amax, "CompositeExplicitAutograd")


@torch.library.register_fake("minifloat::fold_column_amax")
def _(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x.new_empty((1, x.shape[1]), dtype=torch.float32)


if _triton_fold is not None:

    @torch.library.triton_op("minifloat::fold_column_amax_traced", mutates_args=())
    def _fold_column_amax_traced(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _triton_fold(x.contiguous(), s.float().contiguous(), traced=True)  # pragma: no cover


def supports(x: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether `fold_column_amax` takes x and s: a 2-D CUDA float x [R, C] with R a non-zero
    multiple of 256 and C of 64, s [R, 1], on a machine with Triton."""
    return (
        _triton_fold is not None
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in _DTYPES
        and x.shape[0] > 0
        and x.shape[0] % BAND == 0
        and x.shape[1] % COLS == 0
        and x.shape[1] > 0
        and tuple(s.shape) == (x.shape[0], 1)
    )


def fold_column_amax(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """max over rows of |x.float() * s.float()|, [1, C] float32 (NaN where a column holds one),
    for x and s that `supports` takes; no gradient."""
    if not supports(x, s):
        raise ValueError(
            f"fold_column_amax takes CUDA x [R, C] (R a multiple of {BAND}, C of {COLS}) and "
            f"s [R, 1], got {tuple(x.shape)} on {x.device} and {tuple(s.shape)}"
        )
    x, s = x.detach(), s.detach()
    if torch.compiler.is_compiling():
        return torch.ops.minifloat.fold_column_amax_traced.default(x, s)  # pragma: no cover
    return torch.ops.minifloat.fold_column_amax.default(x, s)
