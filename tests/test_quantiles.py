"""kernels/quantiles.py: OCC's clamp bounds by radix select equal the sort's quantiles (bit for
bit up to the sign of a zero quantile) on heavy tails, ties, bf16 values, non-finite entries,
tiny inputs, eagerly and compiled; off CUDA (and above `SELECT_MAX_NUMEL`) the entry
point is `quantize.tensor_quantiles` itself. The kernel runs on a GPU, or on the CPU in Triton's
interpreter where installed (TRITON_INTERPRET=1)."""

from __future__ import annotations

import struct

import pytest
import torch

from interpreter import interpreted
from minifloat.kernels.quantiles import SELECT_MAX_NUMEL, _q_bits, clip_bounds
from minifloat.quantize import _quantiles, interpolate, tensor_quantiles

ALPHAS = [0.99, 0.9, 0.999, 0.75]
KINDS = [
    "heavy",
    "ties",
    "zeros",
    "bf16",
    "fp16",
    "subnormal",
    "nonfinite",
    "negative_nan",
    "all_nan",
    "only_inf",
    "huge",
    "negative",
]


def _data(kind: str, n: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(n + len(kind))
    heavy = torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp(min=0.02)
    if kind == "ties":
        heavy = heavy.round()
    elif kind == "zeros":  # both zeros, most of the mass: the quantiles land on them
        heavy = torch.where(heavy.abs() < 2.0, 0.0, heavy)
        heavy[::3] = -heavy[::3]
    elif kind == "bf16":
        heavy = heavy.bfloat16()
    elif kind == "fp16":
        heavy = heavy.half()
    elif kind == "subnormal":  # float32 subnormals among small normals
        heavy = heavy * 1e-40
    elif kind == "nonfinite":
        heavy[::7] = float("inf")
        heavy[3::11] = float("-inf")
        heavy[5::13] = float("nan")
    elif kind == "negative_nan":  # NaNs with the sign bit set
        heavy[2::9] = float("nan")
        sign = torch.tensor(-(2**31), dtype=torch.int32)
        bits = heavy.view(torch.int32)
        heavy = torch.where(heavy.isnan(), bits | sign, bits).view(torch.float32)
    elif kind == "all_nan":
        heavy[:] = float("nan")
    elif kind == "only_inf":  # no finite entry, and no NaN either
        heavy = torch.where(heavy > 0, float("inf"), float("-inf"))
    elif kind == "huge":  # v_hi - v_lo overflows
        heavy = heavy.sign() * 3.0e38
    elif kind == "negative":
        heavy = -heavy.abs()
    return heavy.to(device)


def _want(flat: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.stack(_quantiles(flat.float().cpu(), (1 - alpha, alpha), select="sort"))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, except that a zero may have either sign and a NaN any payload."""
    got, want = got.cpu(), want.cpu()
    loose = (got.isnan() & want.isnan()) | ((got == 0) & (want == 0))
    return bool(((got.view(torch.int32) == want.view(torch.int32)) | loose).all())


def test_same_sees_a_sign():
    assert _same(torch.tensor([0.0, float("nan")]), torch.tensor([-0.0, -float("nan")]))
    assert not _same(torch.tensor([1.5]), torch.tensor([-1.5]))
    assert not _same(torch.tensor([1.5]), torch.tensor([float("nan")]))


def _kernel_available() -> None:
    """On a GPU the tests below must exercise the select, not the sort they are compared with."""
    from minifloat.kernels import quantiles

    assert quantiles._triton_order_statistics is not None, "Triton is missing on the GPU"


@pytest.mark.parametrize("q", [0.01, 0.99, 1 - 0.999, 0.5, 0.1])
def test_q_bits_carry_the_float64_whole(q):
    bits = _q_bits(q)
    assert torch.tensor(bits, dtype=torch.int64).view(torch.float64).item() == q
    assert bits == struct.unpack("<q", struct.pack("<d", q))[0] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_off_cuda_the_bounds_are_tensor_quantiles(kind):
    flat = _data(kind, 1000)
    got = clip_bounds(flat, 0.99)
    want = torch.stack(tensor_quantiles(flat, 0.99))
    assert got.shape == (2,) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_interpolate_keeps_v_lo_where_frac_is_zero():
    v_lo, v_hi = torch.tensor([-3e38, 1.0]), torch.tensor([3e38, 2.0])
    got = interpolate(v_lo, v_hi, torch.tensor([0.0, 0.25]))
    assert torch.equal(got, torch.tensor([-3e38, 1.25]))  # (v_hi - v_lo) * 0 would be NaN


def _triton_order_statistics():
    try:
        from minifloat.kernels.quantiles_triton import order_statistics
    except ImportError:
        pytest.skip("needs Triton")
    return order_statistics


@interpreted
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", [None, (4, 256, 4)], ids=str)
def test_kernel_in_the_interpreter(kind, config):
    order_statistics = _triton_order_statistics()
    for n in (1, 2, 700):
        flat = _data(kind, n)
        for alpha in ALPHAS:
            s = order_statistics(flat, _q_bits(1 - alpha), _q_bits(alpha), config=config)
            assert _same(interpolate(s[:, 0], s[:, 1], s[:, 2]), _want(flat, alpha))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "n", [1, 2, 1001, 4097, 30011, 65536, 65537, SELECT_MAX_NUMEL, SELECT_MAX_NUMEL + 1]
)
def test_bounds_equal_the_sort_on_the_gpu(kind, n):
    """n = 1001 with alpha = 0.999 and 30011 with 0.9: a contracted (n - 1) q - lo would make a
    zero frac tiny and non-zero there (the kernels run without FMA contraction)."""
    _kernel_available()
    flat = _data(kind, n, "cuda")
    for alpha in ALPHAS:
        assert _same(clip_bounds(flat, alpha), _want(flat, alpha)), alpha


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_the_sort_path_on_the_gpu_equals_the_cpu(kind):
    """CUDA's sort orders NaNs by their bits (a NaN with the sign bit set came first, session
    68); the sort path makes every NaN +inf before it sorts, so CUDA's order statistics are
    the CPU's. Eagerly and compiled (the path torch.compile and the large inputs take)."""
    flat = _data(kind, 30011, "cuda")
    qs = (1 - 0.99, 0.99)  # _want's own q's, bit for bit
    sort = torch.compile(lambda f: torch.stack(_quantiles(f, qs, select="sort")))
    for got in (torch.stack(_quantiles(flat, qs, select="sort")), sort(flat)):
        assert _same(got, _want(flat, 0.99))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", [(4, 2048, 4), (8, 1024, 4), (8, 8192, 16)], ids=str)
def test_kernel_configurations_agree_on_the_gpu(config):
    _kernel_available()
    order_statistics = _triton_order_statistics()
    for kind in KINDS:
        flat = _data(kind, 30011, "cuda")
        s = order_statistics(flat, _q_bits(0.01), _q_bits(0.99), config=config)
        assert _same(interpolate(s[:, 0], s[:, 1], s[:, 2]), _want(flat, 0.99)), kind


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", [None, (4, 2048, 4)], ids=str)
def test_bf16_entries_take_half_the_passes_on_the_gpu(config):
    """bf16 entries are selected on 16-bit keys (16 / BITS passes, then the finish), and the
    values still equal the sort's on every kind, negative values (whose keys' low bits are
    ones) and both zeros included."""
    from minifloat.kernels import quantiles_triton

    _kernel_available()
    order_statistics = _triton_order_statistics()
    cfg = config or (quantiles_triton.BITS, quantiles_triton.CHUNK, quantiles_triton.WARPS)
    for kind in KINDS:
        flat = _data(kind, 30011, "cuda").bfloat16()
        for alpha in ALPHAS:
            s = order_statistics(flat, _q_bits(1 - alpha), _q_bits(alpha), config=config)
            got = interpolate(s[:, 0], s[:, 1], s[:, 2])
            assert _same(got, _want(flat, alpha)), (kind, alpha)
    launched = [
        kernels
        for key, kernels in quantiles_triton._LAUNCHERS.items()
        if key[1] == torch.bfloat16 and key[5:] == cfg
    ]
    assert launched and {len(kernels) for kernels in launched} == {16 // cfg[0] + 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_bounds_equal_eager_and_call_the_op(kind):
    """Under torch.compile the select is the same opaque op (no sort), its thresholds equal the
    eager ones bit for bit: the interpolation's product is rounded before the add, so inductor's
    code has no multiply-add to fuse (`quantize.interpolate`)."""
    from torch._inductor.utils import run_and_get_code

    _kernel_available()
    flat = _data(kind, 65536, "cuda").bfloat16()
    torch._dynamo.reset()
    fn = torch.compile(lambda f: clip_bounds(f[::3].contiguous(), 0.99), fullgraph=True)
    out, code = run_and_get_code(fn, flat)
    eager = clip_bounds(flat[::3].contiguous(), 0.99)
    assert torch.equal(out.view(torch.int32), eager.view(torch.int32))
    assert _same(out, _want(flat[::3], 0.99))
    code = "\n".join(code)
    assert "minifloat.order_statistics.default" in code and "sort" not in code


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_op_passes_opcheck():
    flat = _data("heavy", 5000, "cuda")
    torch.library.opcheck(
        torch.ops.minifloat.order_statistics.default, (flat, _q_bits(0.01), _q_bits(0.99))
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_launches_equal_the_jit_ones_on_the_gpu():
    """After a configuration's first call its compiled kernels are launched directly
    (`quantiles_triton._LAUNCHERS`), with the arguments the JIT would bind: on every kind, on
    unaligned views and at 1, 16 and 17 entries (nothing in the kernels is specialised on
    either, so one compiled set serves them all), the values equal the JIT launches' bit for
    bit, and the sort's."""
    from minifloat.kernels import quantiles_triton

    _kernel_available()
    order_statistics = _triton_order_statistics()
    qs = (_q_bits(0.01), _q_bits(0.99))
    for kind in KINDS:
        data = _data(kind, 30011, "cuda")
        order_statistics(data, *qs)
        assert any(k[:2] == (data.device, data.dtype) for k in quantiles_triton._LAUNCHERS)
        for flat in (data, data[1:], data[3:], data[:1], data[:16], data[5:22]):
            cached = order_statistics(flat, *qs)
            jit = order_statistics(flat, *qs, cached=False)
            assert torch.equal(cached.view(torch.int32), jit.view(torch.int32)), kind
            got = interpolate(cached[:, 0], cached[:, 1], cached[:, 2])
            assert _same(got, _want(flat, 0.99)), kind
