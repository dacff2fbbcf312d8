"""kernels/weight_tensor_triton.py (a candidate for fp8-tensorwise's weights, not yet used by a
backend): values, their transpose and the tensor's scale equal kernels/operand.py's bit for bit
on the GPU, over weights with all-zero, subnormal, huge, inf and NaN blocks."""

import pytest
import torch

from bits import bits_equal, same_e4m3
from minifloat.kernels.operand import quantize_operand
from test_weight_blocks import _weight

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("inv", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 256), (2048, 5632)])
@pytest.mark.parametrize("specials", [False, True])
def test_triton_kernels_equal_operand_quantizer(shape, dtype, inv, specials):
    from minifloat.kernels.weight_tensor_triton import weight_tensor_2d

    if specials:
        w = _weight(*shape, dtype, "cuda", seed=shape[0])
    else:
        gen = torch.Generator().manual_seed(1)
        w = (torch.randn(*shape, generator=gen) * 0.02).to(dtype).cuda()
    fmt = "inv" if inv else "fp32"
    values, scale = quantize_operand(w.cpu(), "e4m3", "tensor", scale_format=fmt)
    # freed blocks of the outputs' sizes filled with 0x55 first (test_weight_blocks.py says why)
    junk = [torch.full((n,), 0x55, dtype=torch.uint8, device="cuda") for n in (w.numel(),) * 2]
    del junk
    q, q_t, s, _ = weight_tensor_2d(w.contiguous(), 448.0, inv)
    assert same_e4m3(q.cpu(), values)
    assert same_e4m3(q_t.cpu(), values.t().contiguous())
    assert bits_equal(s.cpu(), scale)
