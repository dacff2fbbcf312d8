"""partition_hints: the partitioner-friendly forms give the plain ones' values, bit for bit."""

from __future__ import annotations

import pytest
import torch

from minifloat.partition_hints import finite, own_float32

_SPECIALS = [0.0, -0.0, 1.0, -2.5, 3.4e38, -3.4e38, 1e-45, -1e-45, float("inf"), float("-inf"),
             float("nan")]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_equals_isfinite(dtype):
    x = torch.cat([torch.tensor(_SPECIALS), torch.randn(1000) * 1e4]).to(dtype)
    assert torch.equal(finite(x), torch.isfinite(x))


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_own_float32_keeps_every_bit(dtype, compiled, device):
    """x.float()'s bits: signed zeros, infinities, subnormals, NaNs of either sign and payload."""
    torch._dynamo.reset()
    payloads = torch.tensor([0x7FC00001, -0x003FFFFF, -0x00400000, 0x7F800001], dtype=torch.int32)
    x = torch.cat([torch.tensor(_SPECIALS), payloads.view(torch.float32), torch.randn(64)])
    x = x.to(device=device, dtype=dtype)
    fn = torch.compile(own_float32, fullgraph=True) if compiled else own_float32
    out = fn(x)
    # NaN payloads included (tests/bits.py's bits_equal takes any NaN for any other)
    assert torch.equal(out.float().view(torch.int32), x.float().view(torch.int32))
    if compiled:  # a node of its own: a new float32 tensor
        assert out.dtype == torch.float32 and out.data_ptr() != x.data_ptr()
