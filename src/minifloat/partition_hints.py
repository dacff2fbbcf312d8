"""Forms that keep AOTAutograd's partitioner recomputing OCC's wgrad operand instead of saving it.

Under torch.compile the min-cut partitioner decides what forward hands to backward. A tensor it
may not recompute in backward is saved, and so is whatever cheap tensor lies between it and
backward. fp4 (OCC) saved its E4M3 wgrad operand z (one byte an entry, ~4.3 GiB at 1.3B: peak
memory 0.90x of bf16's against fp4-dge's 0.81x) because the partitioner's heuristics banned
recomputing the tensors z is made from (docs/hopper_sessions.md, sessions 19, 31 to 34):

1. "ban if reduction": an op whose output is under a quarter of its inputs' bytes is not
   recomputed. `torch.isfinite(x)` decomposes to `x == x` and more; that `eq` lists x twice
   (8 bytes in, 1 out), so the finite mask of the clamp and the remainder counted as a
   reduction. `finite` computes the same mask as `|x| < inf`.
2. "used above/below fusible": a use of a tensor that comes after the first unfusible op fed by
   that tensor (here the sort of the thresholds' sample) is not recomputed. The quantizers, the
   remainder and z therefore read `own_float32(x)`, a copy made before the sort, and z is made
   before fprop's GEMMs, the copy's first unfusible use (QuantLinearFunction.forward). Its
   reductions count too: `amin` is not among the partitioner's fusible ops and a `cat` is no
   producer of a fusion, so OCC's row extrema are taken with `amax` only, uncatenated, and
   before z's product or quotient (kernels/clip.py; session 34; occ.fold_remainder says why).
3. The same rule for constants: a literal in `torch.where` becomes a graph constant that every
   layer's `where` shares, used far apart. OCC's remainder takes its zero from the layer's own
   threshold instead (occ.remainder).
4. "long fusible chains": a node more than 100 graph nodes past the start of the fusible chain
   it ends is not recomputed. The down projection's bf16 input, converted to float32 inside
   its quantizer after the sort, was such a node (its chain starts at the gate GEMM's output,
   before the up projection's quantizers); `own_float32` converts it before the sort. Under bf16
   autocast fprop's two partial products are bf16 GEMM outputs: their upcasts to float32 stand
   beside their sum (QuantLinearFunction.forward), since an upcast of the first one made right
   after its GEMM started a chain too long for the down projection's z (session 33).

Eagerly nothing here changes a value or a pass: `own_float32` is the identity outside
torch.compile, and `finite` equals `torch.isfinite` bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["finite", "own_float32"]


def finite(x: torch.Tensor) -> torch.Tensor:
    """`torch.isfinite(x)` for a floating x, as `|x| < inf` (False at NaN and ±inf), which the
    partitioner does not count as a reduction (module docstring, 1)."""
    return x.abs() < float("inf")


def own_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 (same value, NaN payloads and signed zeros included), as a graph node of its
    own under torch.compile; x unchanged eagerly, where its consumers (the thresholds' sample
    excepted) convert it to float32 first (module docstring, 2).

    For a float32 x, `x.float()` makes no node, so the copy is `copysign(|x|, x)`: |x| clears
    the sign bit and copysign sets x's back. A bfloat16 x is converted: a copy kept in
    bfloat16 would lose a NaN's sign where inductor computes it in float32 and rounds back.
    """
    if not torch.compiler.is_compiling():
        return x
    if x.dtype != torch.float32:
        return x.float()
    return torch.copysign(x.abs(), x)
