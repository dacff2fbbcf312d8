"""FP8 tensor-core GEMM dispatch (kernels/scaled_mm.py) against float64 (GPU only)."""

import pytest
import torch

from bits import bits_equal
from minifloat.kernels import scaled_mm as smm
from minifloat.quantize import quantize
from tolerances import SCALED_MM_RTOL

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores"),
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m", [256, 77])
@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
def test_scaled_mm_rowish_against_float64(m, scales):
    k, n = 272, 160
    a = torch.randn(m, k, device="cuda").to(torch.float8_e5m2)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device="cuda") + 0.5 if scales != "tensor" else torch.rand(1, 1).cuda()
    sb = torch.rand(n, 1, device="cuda") + 0.5 if scales == "row" else torch.ones(1, 1).cuda()
    out = smm.scaled_mm_rowish(a, sa, b, sb, out_dtype=torch.float32)
    ref = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
    assert _rel_err(out, ref) < SCALED_MM_RTOL["rowish"]


def test_rowwise_epilogue_order_on_e2m1():
    """E2M1 x E2M1 sums are exact, so the row-wise GEMM equals (acc * b_scaleᵀ) * a_scale, the
    fp32 order of torch's row-wise kernel, bit for bit."""
    qa = quantize(torch.randn(200, 4096, device="cuda"), "e2m1", "row")
    qb = quantize(torch.randn(256, 4096, device="cuda"), "e2m1", "row")
    a, b = qa.values.to(torch.float8_e4m3fn), qb.values.to(torch.float8_e4m3fn)
    out = smm.scaled_mm_rowish(a, qa.scale, b, qb.scale, out_dtype=torch.float32)
    acc = qa.values.double() @ qb.values.double().t()  # exact, and exactly an fp32 value
    assert bits_equal(out, (acc.float() * qb.scale.t()) * qa.scale)


@pytest.mark.parametrize("rhs_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("m,k", [(256, 384), (77, 512), (128, 1152)])
def test_scaled_mm_blocks_against_float64(rhs_block, m, k):
    n = 256
    xa, xb = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    qa, qb = quantize(xa, "e4m3", (1, 128)), quantize(xb, "e4m3", rhs_block)
    a, b = qa.values.to(torch.float8_e4m3fn), qb.values.to(torch.float8_e4m3fn)
    out = smm.scaled_mm_blocks(a, qa.scale, b, qb.scale, rhs_block, out_dtype=torch.bfloat16)
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    assert _rel_err(out, ref) < 1e-2  # bf16 output rounding: 2^-9 relative per element
