"""The Differentiable Gradient Estimator: f, f', and the DGE-corrected wgrad."""

from __future__ import annotations

import pytest
import torch

from minifloat import formats, recipes
from minifloat.dge import derivative, dge_derivative, dge_function, dge_scale, grid_position
from minifloat.linear import QuantLinear
from minifloat.quantize import quantize
from minifloat.recipes import DGEConfig
from tolerances import DGE_COMPILED_ULPS, DGE_FLOAT32_ULPS

GRID = formats.get("e2m1").grid.tolist()  # 0, .5, 1, 1.5, 2, 3, 4, 6


def _interior_points(k_per_interval: int = 40) -> torch.Tensor:
    """Points strictly inside each E2M1 interval, away from the capped midpoint region."""
    pts = []
    for a, b in zip(GRID[:-1], GRID[1:], strict=True):
        u = torch.linspace(0.02, 0.98, k_per_interval, dtype=torch.float64)
        u = u[(u - 0.5).abs() > 0.1]
        pts.append(a + (b - a) * u)
    x = torch.cat(pts)
    return torch.cat([x, -x])


@pytest.mark.parametrize("k", [3.0, 5.0, 10.0])
def test_derivative_matches_numerical_derivative(k):
    x = _interior_points()
    h = 1e-6
    numeric = (dge_function(x + h, k=k) - dge_function(x - h, k=k)) / (2 * h)
    analytic = dge_derivative(x, k=k, cap=1e9)
    # float64 central difference: truncation ~h^2 |f'''| and cancellation ~1e-16 |f| / h, both
    # < 1e-9 (measured 6e-10); elementwise, so no summation order enters
    torch.testing.assert_close(analytic, numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [3.0, 5.0])
def test_function_interpolates_grid_and_is_odd(k):
    grid = torch.tensor(GRID, dtype=torch.float64)
    # elementwise float64 at assert_close's defaults (1e-7): f is exact on the grid (measured 0)
    torch.testing.assert_close(dge_function(grid, k=k), grid)
    torch.testing.assert_close(dge_function(-grid, k=k), -grid)
    x = _interior_points()
    torch.testing.assert_close(dge_function(-x, k=k), -dge_function(x, k=k))
    # f is monotone: a smooth stand-in for the staircase
    xs = torch.linspace(-6, 6, 2001, dtype=torch.float64)
    assert bool((dge_function(xs, k=k).diff() >= 0).all())


@pytest.mark.parametrize("k", [3.0, 5.0, 10.0])
def test_one_over_k_on_grid_points(k):
    grid = torch.tensor(GRID + [-g for g in GRID[1:]], dtype=torch.float32)
    d = dge_derivative(grid, k=k)
    torch.testing.assert_close(d, torch.full_like(d, 1.0 / k))  # fp32 1/k, elementwise: exact


def test_grid_position_is_minus_one_on_grid_points_and_zero_at_midpoints():
    grid = torch.tensor(GRID[:-1] + [-g for g in GRID[1:-1]], dtype=torch.float32)
    assert torch.equal(grid_position(grid), torch.full_like(grid, -1.0))
    assert torch.equal(grid_position(torch.tensor([6.0, -6.0])), torch.ones(2))  # the top: [4, 6]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(GRID[:-1], GRID[1:], strict=True)])
    assert torch.equal(grid_position(mids), torch.zeros_like(mids))
    # the same relative place in intervals of different widths gives the same |t|
    x = torch.tensor([0.125, 0.375, 2.25, 3.75])  # |t| = 0.5 in [0, .5], [2, 3] and [3, 4]
    assert torch.equal(grid_position(x).abs(), torch.full((4,), 0.5))


def test_never_exceeds_cap_and_hits_it_at_midpoints():
    x = torch.linspace(-6.5, 6.5, 100_001)
    for cap in (3.0, 1.5):
        d = dge_derivative(x, cap=cap)
        assert float(d.max()) <= cap
        assert float(d.min()) >= 0.2 - 1e-6  # 1/k, the minimum (at grid points): 0.2 - 3e-9 in fp32
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    assert bool((dge_derivative(mids) == 3.0).all())


def test_beyond_max_and_nan():
    d = dge_derivative(torch.tensor([6.0, 6.0000005, 7.0, -9.0, float("nan")]))
    assert d[:4].tolist() == pytest.approx([0.2] * 4)  # 1/k in fp32: 0.2 - 3e-9
    assert torch.isnan(d[4])
    assert dge_derivative(torch.ones(3, dtype=torch.float64)).dtype == torch.float64
    assert dge_derivative(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.float32


def test_other_format_grid():
    # E4M3's grid is much finer; f' is still 1/k exactly on its grid points.
    grid = formats.get("e4m3").grid.float()[1:50]
    assert bool((dge_derivative(grid, fmt="e4m3") == 0.2).all())


@pytest.mark.parametrize("variant", ["", ":scale_format=fp32"])
def test_dge_corrected_wgrad_equals_plain_times_derivative(variant):
    torch.manual_seed(0)
    x = torch.randn(48, 64)
    w = torch.randn(32, 64) * 0.05
    dy = torch.randn(48, 32)
    grads = {}
    for name in ("fp4-direct", "fp4-dge"):
        layer = QuantLinear(64, 32, bias=False, recipe=name + variant, backend="emulated")
        layer.weight.data.copy_(w)
        layer(x).backward(dy)
        grads[name] = layer.weight.grad
    # f' at the scaled weight that the fprop weight quantizer rounded (row groups): w * m with
    # "inv" scales (the default), w / its scale with fp32 ones
    spec = recipes.get("fp4-dge" + variant).fprop.rhs
    if spec.scale_format == "inv":
        m, _ = formats.inv_scales(w.abs().amax(dim=1, keepdim=True), formats.get("e2m1").max)
        w_scaled = w * m
    else:
        w_scaled = w / quantize(w, spec.fmt, spec.granularity, scale_format="fp32").scale
    expected = grads["fp4-direct"] * dge_derivative(w_scaled)
    assert torch.equal(grads["fp4-dge"], expected)
    assert not torch.equal(grads["fp4-dge"], grads["fp4-direct"])


def _intervals_by_search(mag: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """a and δ of the grid interval [a, a + δ) holding mag (max: the last one), by a search."""
    grid = fmt.grid.to(dtype=mag.dtype)
    idx = (torch.searchsorted(grid, mag.contiguous(), right=True) - 1).clamp(0, grid.numel() - 2)
    return grid[idx], grid[idx + 1] - grid[idx]


def _probe_points(fmt, dtype) -> torch.Tensor:
    """Every grid point, its float neighbours, the midpoints, subnormals, max, beyond max."""
    grid = fmt.grid.to(dtype)
    mids = (grid[:-1] + grid[1:]) / 2
    pts = torch.cat(
        [
            grid,
            mids,
            torch.rand(2000, dtype=dtype, generator=torch.Generator().manual_seed(0)) * fmt.max,
        ]
    )
    pts = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1)])
    tiny = torch.tensor([torch.finfo(dtype).tiny / 8, torch.finfo(dtype).tiny, 1e-30], dtype=dtype)
    beyond = torch.tensor([fmt.max * 1.5, float("inf")], dtype=dtype)
    return torch.cat([pts, tiny, beyond]).abs().clamp(max=fmt.max)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["e2m1", "e1m2", "e3m0", "e4m3", "e5m2", "int4", "int8"])
def test_arithmetic_intervals_equal_a_search_of_the_grid(name, dtype):
    from minifloat.dge import _intervals

    fmt = formats.get(name)
    mag = _probe_points(fmt, dtype)
    a, delta, _ = _intervals(mag, fmt)
    a_ref, delta_ref = _intervals_by_search(mag, fmt)
    assert torch.equal(a, a_ref)
    assert torch.equal(delta, delta_ref)


@pytest.mark.parametrize("fmt", ["e2m1", "e1m2"])  # the fast quantizer; quantize() (reference)
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_inv_weight_operands_carry_the_multipliers_dge_scales_by(fmt, granularity):
    from minifloat.kernels import EmulatedBackend
    from minifloat.recipes import OperandSpec

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    spec = OperandSpec(fmt=fmt, granularity=granularity, scale_format="inv")
    w_q = EmulatedBackend().quantize(w, spec)
    amax = w.abs().amax(1, keepdim=True) if granularity == "row" else w.abs().amax().reshape(1, 1)
    m, scale = formats.inv_scales(amax, formats.get(fmt).max)
    assert torch.equal(w_q.multiplier, m) and torch.equal(w_q.scale, scale)
    assert torch.equal(w_q.values(), formats.get(fmt).round(w * m))


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of got's float32 spacing (want float64)."""
    spacing = torch.nextafter(got, torch.tensor(float("inf"))) - got
    return (got.double() - want).abs() / spacing.double()


def test_float32_derivative_agrees_with_float64s():
    x = torch.cat([_interior_points(), torch.rand(50_000, dtype=torch.float64) * 14 - 7])
    for k in (3.0, 5.0, 10.0):
        got = dge_derivative(x.float(), k=k)
        want = dge_derivative(x.float().double(), k=k)
        assert float(_ulps(got, want).max()) <= DGE_FLOAT32_ULPS["cpu"]


def adversarial_points() -> torch.Tensor:
    """Grid points, midpoints, their float32 neighbours, specials (NaN, tiny, huge, beyond max)
    and uniform values, both signs (also tests/test_dge_probe_bench.py's)."""
    grid = formats.get("e2m1").grid.float()
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids, torch.tensor([6.5, 1e30, 1e-30, 1e-45, float("nan")])])
    near = torch.cat([torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1)])
    rand = torch.rand(30_000, generator=torch.Generator().manual_seed(0)) * 14 - 7
    x = torch.cat([pts, near, rand])
    return torch.cat([x, -x])


def test_compiled_derivative_stays_within_two_ulp_of_eager_as_k_changes():
    """One compiled function, configs with different k and cap in turn. Dynamo traces a float
    that changed between compilations as a symbol, and torch 2.13's inductor then kept the first
    symbolic exponent of `pow` (millions of ulp off); the constants come from `DGEConfig.key`
    instead. Float32 pow itself differs by an ulp or two between ATen and inductor's C++."""
    torch._dynamo.reset()  # `derivative`'s compiled entries count against one recompile limit
    x = adversarial_points()
    compiled = torch.compile(derivative, fullgraph=True)
    for k in (1.0, 5.0, 10.0, 3.0, 7.0):
        cfg = DGEConfig(k=k, cap=3.0 if k != 10.0 else 7.5)
        got, want = compiled(x, "e2m1", cfg), derivative(x, "e2m1", cfg)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert float(_ulps(got[~nan], want[~nan].double()).max()) <= DGE_COMPILED_ULPS, k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_derivative_stays_within_its_bound_of_float64_compiled_and_eager():
    """On CUDA the power is exp2·log2 (`dge._power`): compiled (what the Hopper backend runs,
    eager calls included) and eager ATen (the emulated backend on CUDA) within
    DGE_FLOAT32_ULPS["cuda"] of float64's f' on the CPU; float32 grid points at exactly 1/k,
    midpoints at the cap, NaN kept."""
    torch._dynamo.reset()
    x = adversarial_points()
    compiled = torch.compile(derivative, fullgraph=True)
    for k in (5.0, 10.0, 3.0):
        cfg = DGEConfig(k=k, cap=3.0 if k != 10.0 else 7.5)
        want = derivative(x.double(), "e2m1", cfg)
        nan = torch.isnan(want)
        for got in (compiled(x.cuda(), "e2m1", cfg).cpu(), derivative(x.cuda(), "e2m1", cfg).cpu()):
            assert torch.equal(torch.isnan(got), nan)
            assert float(_ulps(got[~nan], want[~nan]).max()) <= DGE_FLOAT32_ULPS["cuda"], k
        grid = formats.get("e2m1").grid.float().cuda()
        assert torch.equal(compiled(grid, "e2m1", cfg), torch.full_like(grid, 1.0 / k))
        mids = (grid[1:] + grid[:-1]) / 2
        assert torch.equal(compiled(mids, "e2m1", cfg), torch.full_like(mids, cfg.cap))


def test_config_key_names_k_and_cap():
    assert DGEConfig(k=5).key == DGEConfig(k=5.0).key
    assert len({DGEConfig().key, DGEConfig(k=3.0).key, DGEConfig(cap=2.0).key}) == 3


def test_config_key_survives_pickling_and_is_rebuilt_for_old_pickles():
    import copy
    import pickle

    cfg = DGEConfig(k=3.0, cap=2.5)
    for twin in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert twin == cfg and twin.key == cfg.key
    old = DGEConfig.__new__(DGEConfig)  # what a pickle without `key` restores
    old.__setstate__({"k": 3.0, "cap": 2.5})
    assert old == cfg and old.key == cfg.key


def test_k_below_one_is_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        dge_derivative(torch.ones(2), k=0.5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(k=float("inf")), ValueError, "dge.k must be a finite number"),  # was all zeros
        (dict(cap=float("inf")), ValueError, "dge.cap must be a finite number"),
        (dict(k="5"), TypeError, "dge.k must be a finite number, got str"),
    ],
)
def test_non_finite_or_non_numeric_k_and_cap_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        dge_derivative(torch.ones(2), **kwargs)


def test_infinite_inputs_count_as_sitting_on_max():
    """Documented: ±inf, like any value beyond ±max, gives 1/k (finite)."""
    d = dge_derivative(torch.tensor([float("inf"), -float("inf"), 6.0]), k=4.0)
    assert d.tolist() == [0.25, 0.25, 0.25]


@pytest.mark.parametrize(
    ("dw", "scale", "mult"),
    [
        (torch.randn(4, 4), torch.full((4,), 0.5), None),  # [N] scales taken as columns
        (torch.randn(4, 4), torch.full((4, 1), 0.5), torch.full((4,), 2.0)),
        (torch.randn(1, 4), torch.full((4, 1), 0.5), None),  # dw broadcast to w's shape
    ],
    ids=["1-D-scale", "1-D-mult", "dw-shape"],
)
def test_dge_scale_refuses_shapes_that_broadcast_wrongly(dw, scale, mult):
    with pytest.raises(ValueError, match="must have w's"):
        dge_scale(dw, torch.randn(4, 4), scale, cfg=DGEConfig(), w_mult=mult)


@pytest.mark.parametrize("k", [0.0, -1.0, float("nan")])
def test_dge_function_refuses_k_below_1(k):
    # k = -1 or NaN gave NaN values, k = 0 a ZeroDivisionError
    with pytest.raises((ValueError, TypeError)):
        dge_function(torch.tensor([0.3, 1.25]), k=k)


def test_derivative_refuses_a_non_config():
    with pytest.raises(TypeError, match="cfg must be a DGEConfig"):
        derivative(torch.tensor([0.3]), "e2m1", None)
