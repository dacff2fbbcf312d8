"""Triton kernels (kernels/triton_quant.py, triton_elementwise.py, scaled_mm.py, ops.py).

GPU tests (`pytest -m gpu` on an H100/H200) demand bit-exact values and scales against the
reference `minifloat.quantize.quantize` on random and adversarial inputs. One CPU test runs the
quantizers under Triton's interpreter in a subprocess (it must be set before Triton is imported)
with float32 outputs, which checks indexing and masking on odd shapes; it is skipped where
Triton is not installed.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minifloat import formats
from minifloat.quantize import quantize

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8"),
]

FMTS = ["e2m1", "e4m3", "e5m2"]
# (shape, granularity): odd shapes exercise every mask.
CASES = [
    ((37, 300), "row"),
    ((19, 3000), "row"),  # long rows, few bands: the amax is split over column slices
    ((1, 17), "row"),
    ((130, 129), "tensor"),
    ((37, 300), (1, 128)),
    ((130, 260), (128, 128)),
    ((64, 48), (16, 16)),
]
# Error bounds of float GEMMs (relative Frobenius error against float64), one reason each.
GEMM_RTOL = {
    # FP8 products are exact, but Hopper's tensor cores add them with ~14 mantissa bits inside
    # each MMA before promoting to fp32 (measured ~1e-4 relative at K=272 on an H200).
    "rowish": 5e-4,
}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same float32 values bit for bit (sign of zero included); any NaN equals any NaN."""
    a, b = a.float().cpu(), b.float().cpu()
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def adversarial(shape, fmt: str, seed: int) -> torch.Tensor:
    """Random rows plus rows of exact ties, huge, tiny, zero, NaN and inf entries.

    Tie rows hold the format's max (so the row scale is a power of two times 1) and every
    midpoint between neighbouring grid points, so x / scale lands exactly on ties.
    """
    gen = torch.Generator().manual_seed(seed)
    r, c = shape
    x = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(3) * 8
    grid = formats.get(fmt).grid.float()
    mids = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([grid[-1:], mids, -mids, grid]).repeat(c // (2 * len(grid) + 1) + 1)[:c]
    specials = [
        ties * 2.0**-3,
        torch.full((c,), 3.0e38),  # huge, finite
        torch.randn(c, generator=gen) * 1e-30,  # tiny
        torch.zeros(c),
        torch.where(torch.arange(c) == c // 2, float("nan"), 1.0),
        torch.where(torch.arange(c) == 0, float("-inf"), -2.0),
    ]
    for i, row in enumerate(specials[:r]):
        x[(i * 7) % r] = row
    if r > 1:  # a row with one large entry and subnormal-range neighbours
        x[r - 1] = torch.randn(c, generator=gen) * 1e-4
        x[r - 1, 0] = 448.0
    return x


def reference(x, fmt, granularity):
    return quantize(x.float(), fmt, granularity)


def run_kernel(x, fmt, granularity, transposed=False):
    from minifloat.kernels import ops
    from minifloat.kernels.hopper import _kernel_mode

    mode, br, bc = _kernel_mode(granularity)
    v, vt, s = ops.quantize(x, fmt, mode, br, bc, False, None, None, None, None, None, transposed)
    return v, vt, s


# ---------------------------------------------------------------------------------------------
# CPU: interpreter indexing check
# ---------------------------------------------------------------------------------------------

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from minifloat.kernels import triton_quant as tq
    from minifloat.quantize import quantize
    torch.manual_seed(0)
    x = torch.randn(19, 150) * 3
    x[2, 3] = float("nan")
    x[4] = 0
    f32 = torch.float32
    def same(a, b):
        return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
    checks = []
    o = tq.quantize_rows(x, "e2m1", out_dtype=f32, write_transposed=True)
    r = quantize(x, "e2m1", "row")
    checks += [same(o.values, r.values), same(o.values_t.t(), r.values), same(o.scale, r.scale)]
    o = tq.quantize_rows(x.t(), "e4m3", group=16, out_dtype=f32)
    r = quantize(x.t().contiguous(), "e4m3", (1, 16))
    checks += [same(o.values, r.values), same(o.scale, r.scale)]
    z = torch.randn(1100, 20) * 2  # z.t(): 2 row bands of 5 column tiles -> 2 slices
    z[700, 3] = float("nan")
    z[:, 5] = 0
    o = tq.quantize_rows(z.t(), "e4m3", out_dtype=f32, write_transposed=True)
    r = quantize(z.t().contiguous(), "e4m3", "row")
    checks += [same(o.values, r.values), same(o.values_t.t(), r.values), same(o.scale, r.scale)]
    assert tq._row_slices(2, 5) == 2
    t = torch.full((3, 40), 1e-44)  # subnormal amax: amax / 448 underflows without the floor
    t[1] = 0
    o = tq.quantize_rows(t, "e4m3", out_dtype=f32)
    r = quantize(t, "e4m3", "row")
    checks += [same(o.values, r.values), same(o.scale, r.scale), not o.values.isnan().any()]
    o = tq.quantize_blocks(x, "e5m2", (16, 32), out_dtype=f32, write_transposed=True)
    r = quantize(x, "e5m2", (16, 32))
    checks += [same(o.values_t.t(), r.values), same(o.scale, r.scale)]
    y, cm = torch.randn(19, 150), torch.rand(150) + 0.5
    o = tq.quantize_tensor(y, "e4m3", col_mult=cm, out_dtype=f32, write_transposed=True)
    r = quantize(y * cm, "e4m3", "tensor")
    checks += [same(o.values, r.values), same(o.values_t.t(), r.values), same(o.scale, r.scale)]
    print("OK" if all(checks) else f"FAIL {checks}")
    """
)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernels_index_and_mask_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("OK"), out.stdout + out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# GPU: bit-exact quantizers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape,granularity", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_quantizer_bit_exact(fmt, shape, granularity, dtype, seed):
    x = adversarial(shape, fmt, seed).to(dtype)
    ref = reference(x, fmt, granularity)
    v, vt, s = run_kernel(x.cuda(), fmt, granularity, transposed=True)
    assert bits_equal(v, ref.values)
    assert bits_equal(vt.t(), ref.values)
    assert bits_equal(s, ref.scale.reshape(s.shape))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("granularity", ["row", "tensor", (1, 128), (128, 128)])
@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_quantizer_transposed_view_prescale_and_clip(fmt, granularity):
    """The backend's quantize == the emulation's for transpose / prescale / clip combinations."""
    from minifloat.kernels.emulated import EmulatedBackend
    from minifloat.kernels.hopper import HopperBackend
    from minifloat.recipes import OperandSpec

    spec = OperandSpec(fmt=fmt, granularity=granularity)
    hop, emu = HopperBackend(), EmulatedBackend()  # the emulation runs on CPU copies
    x = adversarial((257, 384), fmt, 3).cuda().bfloat16()
    row_s, col_s = torch.rand(257, 1).cuda() + 0.5, torch.rand(1, 384).cuda() + 0.5
    clip = (torch.tensor(-1.0).cuda(), torch.tensor(2.5).cuda())
    variants = [dict(transpose=True), dict(clip=clip), dict(clip=clip, transpose=True)]
    if not (isinstance(granularity, tuple) and granularity[0] > 1):
        variants += [dict(prescale=row_s, transpose=True), dict(prescale=col_s)]
        variants += [dict(prescale=col_s, transpose=True), dict(prescale=row_s)]
    for kw in variants:
        kw_cpu = {k: (tuple(t.cpu() for t in v) if isinstance(v, tuple) else v)
                  for k, v in kw.items()}  # fmt: skip
        kw_cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw_cpu.items()}
        got, want = hop.quantize(x, spec, **kw), emu.quantize(x.cpu(), spec, **kw_cpu)
        assert got.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2), kw
        assert bits_equal(got.values(), want.values()), kw
        assert bits_equal(got.scale, want.scale), kw


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_quantizer_given_scale_saturates(fmt):
    from minifloat.kernels import triton_quant

    x = adversarial((64, 96), fmt, 5).cuda()
    scale = torch.tensor([[0.003]], device="cuda")  # most values far beyond max: saturation
    out = triton_quant.quantize_tensor(x, fmt, scale=scale)
    want = formats.get(fmt).round(x.float() / scale)
    assert bits_equal(out.values, want)
    assert out.amax.item() == float("inf")  # the NaN/inf rows make the amax non-finite


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_stochastic_rounding_unbiased_and_seeded():
    from minifloat.kernels import triton_quant

    x = torch.full((512, 1024), 0.3, device="cuda")
    x[:, 0] = 6.0  # row scale 1: 0.3 sits between grid points 0 and 0.5
    kw = dict(rounding="stochastic", out_dtype=torch.float32)
    a = triton_quant.quantize_rows(x, "e2m1", seed=7, **kw)
    b = triton_quant.quantize_rows(x, "e2m1", seed=7, **kw)
    c = triton_quant.quantize_rows(x, "e2m1", seed=8, **kw)
    assert torch.equal(a.values, b.values) and not torch.equal(a.values, c.values)
    vals = a.values[:, 1:]
    assert set(vals.unique().tolist()) == {0.0, 0.5}
    # Mean of 523k Bernoulli(0.6) draws times 0.5: standard error ~3.4e-4; allow 5 sigma.
    assert abs(vals.mean().item() - 0.3) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_dge_kernel_matches_reference():
    from minifloat.dge import dge_derivative
    from minifloat.kernels import ops

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 320, generator=gen)
    s = w.abs().amax(1, keepdim=True) / 6.0
    grid = formats.get("e2m1").grid.float()
    w[0, : 2 * len(grid) - 1] = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]) * s[0]  # edges
    w[1, 5] = float("nan")
    dw = torch.randn(128, 320, generator=gen)
    got = ops.dge_scale(dw.cuda(), w.cuda(), s.cuda(), 5.0, 3.0).cpu()
    want = (dw.cuda() * dge_derivative(w.cuda() / s.cuda(), "e2m1", 5.0, 3.0)).cpu()
    # the same fp32 formula for f' on the same device: a differently fused multiply at most
    assert torch.allclose(got, want, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_outlier_columns_match_reference():
    from minifloat.kernels.emulated import EmulatedBackend
    from minifloat.kernels.hopper import HopperBackend

    x = torch.randn(300, 1000, device="cuda").bfloat16()
    x[:, 17] *= 40
    x[5, 900] = float("inf")
    x[7, 901] = float("nan")
    lo, hi = torch.tensor(-6.0, device="cuda"), torch.tensor(6.0, device="cuda")
    cols, delta = HopperBackend().occ_outliers(x, lo, hi)
    cols_ref, delta_ref = EmulatedBackend().occ_outliers(x, lo, hi)
    assert torch.equal(cols, cols_ref), (cols, cols_ref)
    assert bits_equal(delta, delta_ref)


# ---------------------------------------------------------------------------------------------
# GPU: GEMM dispatch
# ---------------------------------------------------------------------------------------------


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m", [256, 77])
@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_scaled_mm_rowish_against_float64(m, scales):
    from minifloat.kernels import scaled_mm as smm

    k, n = 272, 160
    a = torch.randn(m, k, device="cuda").to(torch.float8_e5m2)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device="cuda") + 0.5 if scales != "tensor" else torch.rand(1, 1).cuda()
    sb = torch.rand(n, 1, device="cuda") + 0.5 if scales == "row" else torch.ones(1, 1).cuda()
    out = smm.scaled_mm_rowish(a, sa, b, sb, out_dtype=torch.float32)
    ref = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
    assert _rel_err(out, ref) < GEMM_RTOL["rowish"]


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_rowwise_epilogue_order_on_e2m1():
    """E2M1 x E2M1 sums are exact, so the row-wise GEMM equals (acc * b_scaleᵀ) * a_scale, the
    fp32 order of torch's row-wise kernel, bit for bit."""
    from minifloat.kernels import scaled_mm as smm

    qa = quantize(torch.randn(200, 4096, device="cuda"), "e2m1", "row")
    qb = quantize(torch.randn(256, 4096, device="cuda"), "e2m1", "row")
    a, b = qa.values.to(torch.float8_e4m3fn), qb.values.to(torch.float8_e4m3fn)
    out = smm.scaled_mm_rowish(a, qa.scale, b, qb.scale, out_dtype=torch.float32)
    acc = qa.values.double() @ qb.values.double().t()  # exact, and exactly an fp32 value
    assert bits_equal(out, (acc.float() * qb.scale.t()) * qa.scale)


@pytest.mark.parametrize("rhs_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("m,k", [(256, 384), (77, 512), (128, 1152)])
@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA_FP8 and HAVE_TRITON), reason="needs a CUDA GPU with FP8")
def test_scaled_mm_blocks_against_float64(rhs_block, m, k):
    from minifloat.kernels import scaled_mm as smm

    n = 256
    xa, xb = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    qa, qb = quantize(xa, "e4m3", (1, 128)), quantize(xb, "e4m3", rhs_block)
    a, b = qa.values.to(torch.float8_e4m3fn), qb.values.to(torch.float8_e4m3fn)
    out = smm.scaled_mm_blocks(a, qa.scale, b, qb.scale, rhs_block, out_dtype=torch.bfloat16)
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    assert _rel_err(out, ref) < 1e-2  # bf16 output rounding: 2^-9 relative per element
