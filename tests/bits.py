"""Bit-level comparison of float tensors, shared by the exactness tests."""

from __future__ import annotations

import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same values as float32 bit for bit (sign of zero included); any NaN equals any NaN."""
    a, b = a.float().cpu(), b.float().cpu()
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))
