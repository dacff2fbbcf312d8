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


def same_e4m3(got: torch.Tensor, want: torch.Tensor) -> bool:
    """E4M3 tensors with the same bytes, a NaN equal to a NaN of either sign: compiled on the
    CPU a NaN's byte may take another sign than eager's (tests/test_occ.py's quotient test)."""
    got, want = got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)
    nan = (want & 0x7F) == 0x7F
    return torch.equal((got & 0x7F) == 0x7F, nan) and torch.equal(got[~nan], want[~nan])
