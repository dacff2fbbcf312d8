"""Float32 arithmetic pinned to the same bits in eager and compiled code.

torch.compile may lower a float32 division to an approximate one (Triton's `div.full.f32`, up to
2 ulp) or rewrite it as a multiplication by a reciprocal; eager PyTorch divides correctly
rounded. Quantizers round quotients onto coarse grids, where a last-bit difference next to a
rounding boundary becomes a different grid value, so their divisions go through `div_rn`.
"""

from __future__ import annotations

import torch

__all__ = ["div_rn"]


def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b correctly rounded to float32, in any compiled form (a, b float32, broadcastable).

    Computed as `a * (1 / b)` in float64 and rounded once to float32. The float64 value lies
    within 2^-52 (relative) of a / b however the compiler forms it; the exact quotient of two
    24-bit numbers is either a float32 rounding boundary (impossible for normal results: a 25-bit
    midpoint times a 24-bit divisor needs more than 24 bits) or at least 2^-49 (relative) away
    from every one, so both round to the same float32. Subnormal quotients may differ in their
    last bit; callers that round them onto a quantization grid get zero either way.
    """
    return (a.double() * b.double().reciprocal()).float()
