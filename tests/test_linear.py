"""QuantLinear: every recipe against a float64 reference of the same math, SQNR floors, and the
nn.Linear drop-in contract (state_dict, batch dims, bias, autocast, saved activations)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from linear_reference import U, reference, scaled_operand
from minifloat import occ, occ_gemm, recipes
from minifloat.dge import dge_derivative
from minifloat.kernels import Backend, EmulatedBackend, backend_for, get_backend
from minifloat.linear import QuantLinear, QuantLinearFunction
from minifloat.quantize import quantize, tensor_quantiles
from minifloat.sqnr import sqnr_db
from tolerances import HOPPER_VS_EMULATED_MIN_DB, RECIPE_SQNR_FLOORS

# The registered quantized recipes, plus OCC variants: the fp32 reference compensation, a tensor
# scaled input (the remainder folds into a scaled, not unit-scaled, wgrad operand) and tiles
# (no fold: wgrad adds the remainder through its own E4M3 GEMM); the micro-block recipes
# without random draws (the float64 reference, tests/linear_reference.py, cannot draw; the
# drawing ones have their own in tests/test_microblock_linear.py); power-of-two and fp32 scales.
FP32_COMPENSATION = "fp4:occ.compensation_format=fp32"
OCC_TENSOR = "fp4-occ:scaling.input=tensor"
OCC_TILES = "fp8-blockwise:occ=on"
OCC_TWO_GEMMS = "fp4:occ.one_gemm=off"  # fprop's two products as separate GEMMs
OCC_VARIANTS = [FP32_COMPENSATION, OCC_TENSOR, OCC_TILES, OCC_TWO_GEMMS]
MICROBLOCK_RNE = ["nvfp4:rht=off:sr=off", "mxfp4:sr=off"]
# Power-of-two scales: tensor, row, and row with OCC and DGE
POW2 = [
    "fp8-tensorwise:scale_format=pow2",
    "fp8-rowwise:scale_format=pow2",
    "fp4:scale_format=pow2",
]
# fp32 scales (values x / (amax / max)), where the named recipes use "inv" (x * (max / amax)):
# tensor, row, blocks, E2M1 rows with and without OCC
FP32_SCALES = [
    "fp8-tensorwise:scale_format=fp32",
    "fp8-rowwise:scale_format=fp32",
    "fp8-blockwise:scale_format=fp32",
    "fp4-dge:scale_format=fp32",
    "fp4:scale_format=fp32",
]
QUANT_RECIPES = [n for n in recipes.names() if recipes.get(n).quantized] + OCC_VARIANTS
QUANT_RECIPES += MICROBLOCK_RNE + POW2 + FP32_SCALES


def run_layer(name: str, x, w, b, dy, **kw):
    layer = QuantLinear(
        w.shape[1], w.shape[0], bias=b is not None, recipe=name, device=x.device, **kw
    )
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy.to(y.dtype))
    grads = {"y": y, "dx": x.grad, "dw": layer.weight.grad}
    if b is not None:
        grads["db"] = layer.bias.grad
    return grads


SHAPES = [(256, 256, 128), (50, 384, 256)]  # (M, K, N); M=50 exercises ragged 1x128 tiles


def _data(m, k, n, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    dy = torch.randn(m, n, generator=gen)
    return x, w, b, dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", [n for n in QUANT_RECIPES if not recipes.get(n).randomized])
def test_matches_float64_reference(name, shape, dtype):
    x, w, b, dy = _data(*shape)
    x, dy = x.to(dtype), dy.to(dtype)
    got = run_layer(name, x, w, b, dy, backend="emulated")
    ref = reference(recipes.get(name), x, w, b, dy)
    assert got["y"].dtype == dtype and got["dx"].dtype == dtype
    assert got["dw"].dtype == torch.float32 and got["db"].dtype == torch.float32
    for key, (value, bound) in ref.items():
        out = got[key].double()
        rel = 4 * U if got[key].dtype == torch.float32 else 2.0**-8  # final cast's rounding
        # The cast rounds the fp32 result, |value| + bound at most: a bound for any summation
        # order (bf16 outputs use ~0.99 of it, all of it the cast; fp32 outputs < 0.1).
        tol = bound + rel * (value.abs() + bound) + 1e-30
        excess = ((out - value).abs() - tol).max().item()
        assert excess <= 0, f"{name} {key}: error exceeds the fp32 bound by {excess:.3g}"


# SHAPES hold at most 65536 entries, the named recipes' OCC sample: the test above reaches only
# the exact quantiles. A sample of 1024 makes the layer take the strided path.
SAMPLED_OCC = [
    "fp4:occ.sample_size=1024",
    "fp4-occ:occ.sample_size=1024",
    "fp4:occ.sample_size=1024:occ.compensation_format=fp32",
    "fp4:occ.sample_size=1024:occ.one_gemm=off",
    "fp4-occ:occ.sample_size=1024:occ.one_gemm=off",
]


def _redrawn_thresholds(x: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled thresholds re-derived from OCCConfig's contract, not from occ.thresholds: the
    quantiles of every s-th entry, s the least prime >= numel / sample_size not dividing K."""
    s = -(-x.numel() // cfg.sample_size)
    while any(s % d == 0 for d in range(2, s)) or x.shape[1] % s == 0:
        s += 1
    return tensor_quantiles(x.reshape(-1)[::s], cfg.alpha)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SAMPLED_OCC)
def test_sampled_occ_matches_float64_reference(name, shape, dtype):
    recipe = recipes.get(name)
    cfg = recipe.occ
    x, w, b, dy = _data(*shape, seed=2)
    x, dy = x.to(dtype), dy.to(dtype)
    assert cfg.threshold == "sampled" and x.numel() > 4 * cfg.sample_size
    # the thresholds the layer uses: occ.thresholds on its [M, K] input
    lo, hi = occ.thresholds(x, cfg)
    exact = tensor_quantiles(x, cfg.alpha)
    redrawn_lo, redrawn_hi = _redrawn_thresholds(x, cfg)
    assert torch.equal(lo, redrawn_lo) and torch.equal(hi, redrawn_hi), "not the strided sample"
    assert lo != exact[0] and hi != exact[1]  # a sample, not the exact quantiles
    # ~1000 sampled entries: each tail's clipped fraction within 1 % ± 0.6 % (~2 binomial sd)
    xf = x.float()
    for clipped in ((xf < lo).float().mean(), (xf > hi).float().mean()):
        assert abs(clipped.item() - (1 - cfg.alpha)) <= 0.006

    got = run_layer(name, x, w, b, dy, backend="emulated")
    ref = reference(recipe, x, w, b, dy, clip=(lo, hi))
    for key, (value, bound) in ref.items():
        out = got[key].double()
        rel = 4 * U if got[key].dtype == torch.float32 else 2.0**-8  # final cast's rounding
        excess = ((out - value).abs() - (bound + rel * (value.abs() + bound) + 1e-30)).max().item()
        assert excess <= 0, f"{name} {key}: error exceeds the fp32 bound by {excess:.3g}"


def test_fp4_fprop_is_exact_up_to_the_scale_product():
    """E2M1 x E2M1 sums are exact in fp32: y = (fp32(acc) * w_scale) * x_scale bit for bit, the
    order torch's row-wise FP8 GEMM applies the scales on Hopper."""
    x, w, _, _ = _data(64, 256, 128)
    y = QuantLinear(256, 128, bias=False, recipe="fp4-direct", backend="emulated")
    with torch.no_grad():
        y.weight.copy_(w)
    out = y(x)
    sf = y.recipe.fprop.lhs.scale_format
    xq, wq = (quantize(t, "e2m1", "row", scale_format=sf) for t in (x, w))
    acc = (xq.values.double() @ wq.values.double().t()).float()
    assert torch.equal(out, (acc * wq.scale.t()) * xq.scale)


def test_sqnr_floors_and_fp8_beats_fp4():
    x, w, b, dy = _data(256, 256, 128, seed=1)
    layer = nn.Linear(256, 128, dtype=torch.float64)  # the exact layer, in float64
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    xr = x.double().requires_grad_()
    y = layer(xr)
    y.backward(dy.double())
    exact = {"y": y.detach(), "dx": xr.grad, "dw": layer.weight.grad}
    y_sqnr = {}
    for name in QUANT_RECIPES:
        got = run_layer(name, x, w, b, dy, backend="emulated")
        dge = recipes.get(name).dge
        if dge is not None:  # f' at the scaled w the quantizer rounded, as in `reference`
            f = dge_derivative(scaled_operand(w, recipes.get(name).fprop.rhs), k=dge.k, cap=dge.cap)
            exact["dw"] = layer.weight.grad * f
        else:
            exact["dw"] = layer.weight.grad
        measured = [sqnr_db(exact[k], got[k]) for k in ("y", "dx", "dw")]
        y_sqnr[name] = measured[0]
        for key, m, floor in zip(
            ("y", "dx", "dw"), measured, RECIPE_SQNR_FLOORS[name], strict=True
        ):
            assert m >= floor, f"{name} {key}: SQNR {m:.2f} dB below floor {floor}"
    fp8 = [v for k, v in y_sqnr.items() if k.startswith("fp8")]
    fp4 = [v for k, v in y_sqnr.items() if k.startswith("fp4")]
    assert min(fp8) > max(fp4) + 5  # 2 more mantissa bits, ~12 dB (measured gap 9.7 dB)


def test_drop_in_for_nn_linear():
    lin = nn.Linear(64, 32)
    q = QuantLinear(64, 32, recipe="fp4")
    assert list(q.state_dict()) == list(lin.state_dict())
    q.load_state_dict(lin.state_dict())
    lin.load_state_dict(q.state_dict())
    assert isinstance(q, nn.Linear) and "recipe=fp4" in repr(q)
    x = torch.randn(2, 3, 5, 64)
    assert q(x).shape == (2, 3, 5, 32)
    no_bias = QuantLinear(64, 32, bias=False, recipe="fp8-rowwise")
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]
    with pytest.raises(ValueError, match="does not quantize"):
        QuantLinear(64, 32, recipe="bf16")
    with pytest.raises(ValueError, match="backend"):
        QuantLinear(64, 32, recipe="fp4", backend="tpu")


def test_from_linear_shares_parameters():
    lin = nn.Linear(64, 32)
    q = QuantLinear.from_linear(lin, "fp4")
    assert q.weight is lin.weight and q.bias is lin.bias
    lin2 = nn.Linear(64, 32, bias=False)
    assert QuantLinear.from_linear(lin2, "fp4").bias is None


@pytest.mark.parametrize("name", ["fp4", "fp4:occ.one_gemm=off", "fp8-tensorwise"])
def test_autocast_bf16(name):
    x, w, b, dy = _data(32, 128, 64)
    plain = run_layer(name, x, w, b, dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = run_layer(name, x, w, b, dy)
    assert auto["y"].dtype == torch.bfloat16 and auto["dx"].dtype == torch.float32
    # the weight is quantized from the fp32 master, not from an autocast copy
    cfg = recipes.get(name).occ
    if cfg is None or occ_gemm.joins_products(recipes.get(name)):  # one GEMM, one rounding
        assert torch.equal(auto["y"], plain["y"].to(torch.bfloat16))
    else:  # fprop's two partial products are each rounded to bf16, then their sum
        comp = occ_gemm.fprop_correction(
            EmulatedBackend(), "e4m3", x, occ.thresholds(x, cfg), w, fast_accum=False
        )
        y = plain["y"].detach()
        tol = 2.0**-8 * ((y - comp - b).abs() + comp.abs() + y.abs())
        assert ((auto["y"].float() - y).abs() <= tol).all()
        assert not torch.equal(auto["y"], y.to(torch.bfloat16))  # the partials were rounded
    # dx of an fp32 input is written in bf16 (as through nn.Linear under autocast), then cast
    assert torch.equal(auto["dx"], auto["dx"].to(torch.bfloat16).float())
    assert not torch.equal(plain["dx"], plain["dx"].to(torch.bfloat16).float())


# Bytes autograd saves per layer against a bf16 nn.Linear under autocast (x and the bf16 weight
# copy), parameters excluded: 4-bit inputs are saved packed (0.25x of bf16's x), 8-bit ones as
# FP8 bytes (0.5x), plus the quantized weight's transposed copy and per-row scales.
SAVED_BYTES_VS_BF16 = {"e2m1": 0.35, "e4m3": 0.55}
# With OCC's E4M3 compensation the saved input is z = x_q + Δx·m_x in one byte an entry (0.5x
# of bf16's x): measured 0.47x with the packed weight copy. The fp32 reference saves Δx in fp32.
SAVED_BYTES_OCC_VS_BF16 = 0.55


def _saved_bytes(layer: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    return sum(t.untyped_storage().nbytes() for t in saved.values()), list(saved.values())


@pytest.mark.parametrize("name", [n for n in QUANT_RECIPES if recipes.get(n).occ is None])
def test_saved_activations_stay_quantized(name):
    m, k, n = 512, 128, 128  # tokens >> features, as in training
    x = torch.randn(m, k, requires_grad=True)
    bf16_bytes, _ = _saved_bytes(nn.Linear(k, n, bias=False), x)
    layer = QuantLinear(k, n, bias=False, recipe=name, backend="emulated")
    got, saved = _saved_bytes(layer, x)
    assert all(t.data_ptr() != x.data_ptr() for t in saved)  # never the hp input
    assert not any(t.is_floating_point() and t.element_size() > 1 and t.numel() >= m * k
                   for t in saved)  # fmt: skip
    x_fmt = recipes.get(name).fprop.lhs.fmt
    assert got <= SAVED_BYTES_VS_BF16[x_fmt] * bf16_bytes, (got, bf16_bytes)


@pytest.mark.parametrize("name", ["fp4", "fp4-occ", OCC_TENSOR])
def test_occ_saves_one_byte_per_input_entry(name):
    m, k, n = 512, 128, 128
    x = torch.randn(m, k, requires_grad=True)
    x.data[:, 3] *= 30  # an outlier channel
    bf16_bytes, _ = _saved_bytes(nn.Linear(k, n, bias=False), x)
    got, saved = _saved_bytes(QuantLinear(k, n, bias=False, recipe=name, backend="emulated"), x)
    assert not any(t.is_floating_point() and t.element_size() > 1 and t.numel() >= m * k
                   for t in saved)  # fmt: skip
    assert got <= SAVED_BYTES_OCC_VS_BF16 * bf16_bytes, (got, bf16_bytes)


def test_non_finite_input_propagates():
    x, w, b, dy = _data(8, 64, 32)
    x[3, 5] = float("nan")
    for name in ("fp4-direct", "fp8-rowwise"):
        got = run_layer(name, x, w, b, dy)
        assert torch.isnan(got["y"][3]).all() and torch.isfinite(got["y"][:3]).all()


NAMED_RECIPES = [n for n in recipes.names() if recipes.get(n).quantized]


@pytest.mark.parametrize("name", NAMED_RECIPES)
def test_inputs_without_rows_give_nn_linears_empty_result(name):
    layer = QuantLinear(128, 128, recipe=name)
    for shape in ((0, 128), (2, 0, 128)):
        x = torch.randn(shape, requires_grad=True)
        y = layer(x)
        y.sum().backward()
        assert y.shape == (*shape[:-1], 128) and x.grad.shape == shape
        assert layer.weight.grad is not None and not layer.weight.grad.any()
        layer.weight.grad = None


@pytest.mark.parametrize(
    "x, error, match",
    [
        (torch.randint(0, 3, (2, 64)), TypeError, "floating-point input, got torch.int64"),
        (torch.ones(2, 64, dtype=torch.bool), TypeError, "floating-point input, got torch.bool"),
        (torch.ones(2, 64, dtype=torch.complex64), TypeError, "got torch.complex64"),
        (torch.tensor(1.0), ValueError, "at least 1 dim"),
        (torch.ones(2, 63), ValueError, "expected last dim 64"),
    ],
)
def test_inputs_the_layer_cannot_take_raise_one_line_errors(x, error, match):
    # integer input was truncated by the quantizers into a wrong integer result
    with pytest.raises(error, match=match):
        QuantLinear(64, 32, recipe="fp8-rowwise")(x)


def test_backend_selection():
    assert isinstance(backend_for("cpu"), EmulatedBackend)
    assert isinstance(EmulatedBackend(), Backend)
    assert isinstance(get_backend("auto", torch.device("cpu")), EmulatedBackend)
    with pytest.raises(RuntimeError, match="hopper"):
        get_backend("hopper", "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("fast", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", QUANT_RECIPES)
def test_hopper_backend_matches_emulation(name):
    """The fast path computes the emulation's math: E2M1 x E2M1 fprop bit for bit, the other
    GEMMs to fp32-accumulation differences (>= 60 dB)."""
    if get_backend("auto", "cuda").name != "hopper":
        pytest.skip("no sm_89+ GPU or minifloat.kernels.hopper")
    x, w, b, dy = (t.cuda() for t in _data(256, 256, 128))
    emu = run_layer(name, x, w, b, dy, backend="emulated")
    fast = run_layer(name, x, w, b, dy, backend="hopper")
    r = recipes.get(name)
    exact_fprop = {r.fprop.lhs.scale_format, r.fprop.rhs.scale_format} <= {"fp32", "inv"}
    if r.fprop.lhs.fmt == r.fprop.rhs.fmt == "e2m1" and r.occ is None and exact_fprop:
        assert torch.equal(fast["y"], emu["y"])  # micro-block fprop: bf16 GEMM, other fp32 order
    for key in emu:
        assert sqnr_db(emu[key], fast[key]) >= HOPPER_VS_EMULATED_MIN_DB, key


class _AccumRecording(EmulatedBackend):
    """The emulation, recording each GEMM's output shape and fast-accumulation hint."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, int], bool]] = []

    def scaled_mm(self, a, b, *, out_dtype, bias=None, fast_accum=False):
        self.calls.append(((a.shape[0], b.shape[0]), fast_accum))
        return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)


# (fprop, dgrad, wgrad) fast accumulation by default: on in backward only where 125M training
# measured no loss from it (docs/hopper_sessions.md, sessions 37, 39, 40, 103 and 104).
_DEFAULT_FAST_ACCUM = {
    "fp8-tensorwise": (True, True, False),
    "fp8-rowwise": (True, True, False),
    "fp4-direct": (True, True, True),
    "fp4-dge": (True, True, True),
    "fp4": (True, True, False),
    "fp4-occ": (True, True, False),
    "fp4-w4a8": (True, True, False),
    "fp4-w8a4": (True, True, True),
}
_FAST_ACCUM_VARIANTS = {
    "": None,
    ":occ.one_gemm=off": None,
    ":fast_accum=off": (False, None, None),
    ":bwd_fast_accum=on": (None, True, True),
    ":bwd_fast_accum=off": (None, False, False),
    ":dgrad_fast_accum=off": (None, False, None),
    ":wgrad_fast_accum=on": (None, None, True),
}


@pytest.mark.parametrize(
    ("variant", "base"),
    [
        (v, b)
        for v in sorted(_FAST_ACCUM_VARIANTS)
        for b in sorted(_DEFAULT_FAST_ACCUM)
        if "occ" not in v or recipes.get(b).occ is not None  # (else the variant adds OCC)
    ],
)
def test_fast_accumulation_reaches_the_gemms_it_names(base, variant):
    """fprop's GEMM takes `fast_accum`, dgrad's `dgrad_fast_accum` and wgrad's
    `wgrad_fast_accum` (`bwd_fast_accum` sets both); the recipe's defaults are the table's.
    The emulation sums in fp32 whatever the hint."""
    recipe = recipes.get(base + variant)
    backend = _AccumRecording()
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    y = QuantLinearFunction.apply(x, w, None, recipe, backend, torch.float32, None, None)
    y.backward(torch.randn_like(y))
    change = _FAST_ACCUM_VARIANTS[variant] or (None, None, None)
    fprop, dgrad, wgrad = (
        d if c is None else c for d, c in zip(_DEFAULT_FAST_ACCUM[base], change, strict=True)
    )
    # OCC compensates fprop with the clipped residual under fprop's hint: inside its one GEMM
    # (`occ.one_gemm`, the default), else in a second GEMM
    two = recipe.occ is not None and not occ_gemm.joins_products(recipe)
    fprops = [((32, 48), fprop)] * (2 if two else 1)
    assert backend.calls == [*fprops, ((32, 64), dgrad), ((48, 64), wgrad)]


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The number of aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", QUANT_RECIPES)
def test_no_grad_prepares_no_backward_operands(name):
    # Weights require grad in evaluation too; under no_grad the layer must not quantize or
    # transpose what only backward reads (wgrad's x, dgrad's w_q transposed, OCC's remainder)
    torch.manual_seed(0)
    layer, x = QuantLinear(64, 32, recipe=name), torch.randn(16, 64)
    with _CountOps() as trained:
        y = layer(x)
    with torch.no_grad(), _CountOps() as evaluated:
        y_eval = layer(x)
    assert torch.equal(y_eval, y.detach())
    assert evaluated.count < trained.count


def test_from_linear_takes_an_nn_linear():
    with pytest.raises(TypeError, match="from_linear expects an nn.Linear, got Conv1d"):
        QuantLinear.from_linear(nn.Conv1d(3, 3, 1), "fp4")


@pytest.mark.parametrize("salt", [-5, 2**31, 1.5, True])
def test_seed_rng_refuses_salts_outside_its_range(salt):
    layer = QuantLinear(32, 32, recipe="nvfp4")
    with pytest.raises(ValueError, match=r"int salt in \[0, 2\^31\)"):
        layer.seed_rng(salt)


@pytest.mark.parametrize("name", ["fp4", "fp8-delayed", "nvfp4"])
def test_meta_forward_gives_the_plain_layers_shape(name):
    layer = QuantLinear(64, 32, recipe=name, device="meta")
    y = layer(torch.randn(8, 3, 64, device="meta"))
    assert y.device.type == "meta" and y.shape == (8, 3, 32)
