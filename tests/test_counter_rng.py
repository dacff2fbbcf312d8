"""minifloat/counter_rng.py: counter-based uniforms and signs (reproducible, well spread), and the
stochastic rounding they drive is unbiased: the mean error over many draws goes to 0."""

from __future__ import annotations

import pytest
import torch

from minifloat import counter_rng, formats

CPU = torch.device("cpu")


def _key(step: int, salt: int = 17, gemm: int = 1) -> torch.Tensor:
    """The wgrad noise key of a layer at `step`, as the layer derives it."""
    seed = counter_rng.layer_seeds(torch.tensor([salt, step]))[gemm]
    return counter_rng.derive(seed, "noise")


def test_uniforms_are_a_function_of_seed_and_index():
    a = counter_rng.uniform(_key(3), (64, 32), CPU)
    assert a.dtype == torch.float32 and a.shape == (64, 32)
    assert torch.equal(a, counter_rng.uniform(_key(3), (64, 32), CPU))
    assert torch.equal(a.flatten()[:100], counter_rng.uniform(_key(3), (100,), CPU))
    assert not torch.equal(a, counter_rng.uniform(_key(4), (64, 32), CPU))
    assert (a >= 0).all() and (a < 1).all()
    assert torch.equal(a * 2**24, (a * 2**24).floor())  # multiples of 2^-24


def test_uniforms_look_uniform_and_independent():
    n = 1 << 18
    u = counter_rng.uniform(_key(11), (n,), CPU).double()
    assert abs(u.mean().item() - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u.float(), bins=16, min=0, max=1)
    expected = n / 16
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 40  # 15 degrees of freedom: p ~ 5e-4
    v = counter_rng.uniform(_key(12), (n,), CPU).double()  # the next step's draws
    w = counter_rng.uniform(_key(11, salt=18), (n,), CPU).double()  # another layer's
    x = counter_rng.uniform(_key(11, gemm=0), (n,), CPU).double()  # the dgrad GEMM's
    for a, b in ((u, v), (u, w), (u, x), (u[:-1], u[1:])):  # and neighbouring elements
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 4 / n**0.5


def test_signs_and_seeds():
    s = counter_rng.random_signs(_key(5), 4096, CPU)
    assert set(s.unique().tolist()) == {-1.0, 1.0} and abs(s.mean().item()) < 0.1
    state = torch.tensor([123, 0])
    seeds = counter_rng.layer_seeds(state)
    assert seeds.shape == (2,) and seeds.dtype == torch.int64 and seeds[0] != seeds[1]
    counter_rng.advance(state)
    assert state.tolist() == [123, 1]
    assert not torch.equal(counter_rng.layer_seeds(state), seeds)
    assert not torch.equal(counter_rng.layer_seeds(torch.tensor([124, 0])), seeds)
    assert ((seeds >= 0) & (seeds < 2**32)).all()


def test_rank_is_mixed_into_the_seeds():
    state = torch.tensor([123, 4])
    single = counter_rng.layer_seeds(state)
    assert counter_rng.process_rank() == 0  # no process group here
    assert torch.equal(counter_rng.layer_seeds(state, 0), single)  # rank 0: a single process's
    by_rank = [counter_rng.layer_seeds(state, r) for r in range(64)]
    assert len({tuple(s.tolist()) for s in by_rank}) == 64  # every rank its own draws
    assert all(((s >= 0) & (s < 2**32)).all() for s in by_rank)


def _mean_error(x: torch.Tensor, draws: int) -> torch.Tensor:
    """Mean over `draws` seeds of E2M1 stochastic rounding of x, minus x."""
    e2m1 = formats.get("e2m1")
    total = torch.zeros_like(x, dtype=torch.float64)
    for step in range(draws):  # a layer's draws over `draws` training steps
        u = counter_rng.uniform(_key(step), tuple(x.shape), CPU)
        total += e2m1.round(x, "stochastic", noise=u).double()
    return total / draws - x.double()


def test_stochastic_rounding_is_unbiased():
    """Per element, the rounding error has mean 0 and standard deviation at most
    (grid step)/2; its mean over n draws shrinks like 1/sqrt(n)."""
    x = torch.linspace(-6, 6, 997)  # every E2M1 interval, off-grid
    step = torch.where(x.abs() < 2, 0.5, torch.where(x.abs() < 4, 1.0, 2.0)).double()
    err_16, err_1024 = _mean_error(x, 16), _mean_error(x, 1024)
    assert (err_1024.abs() <= 5 * (step / 2) / 1024**0.5).all()
    assert err_1024.abs().mean() < err_16.abs().mean() / 4  # ~8x: 1/sqrt(64)
    # no systematic bias across the grid: the mean over all elements and draws is within 5
    # standard deviations of 0 (per element, var = step² p (1 - p), p the fraction to round up)
    lo = (x.double() / step).floor() * step
    p = (x.double() - lo) / step
    sigma = ((step**2 * p * (1 - p)).sum() / 1024).sqrt() / x.numel()
    assert abs(err_1024.mean().item()) < 5 * sigma
    on_grid = formats.get("e2m1").grid.float()
    assert torch.equal(_mean_error(on_grid, 4), torch.zeros_like(on_grid, dtype=torch.float64))


@pytest.mark.parametrize("x", [1.25, -2.5, 4.5])
def test_stochastic_rounding_picks_neighbours_with_the_right_odds(x):
    e2m1 = formats.get("e2m1")
    u = counter_rng.uniform(_key(2), (20000,), CPU)
    r = e2m1.round(torch.full((20000,), x), "stochastic", noise=u)
    lo, hi = {1.25: (1.0, 1.5), -2.5: (-3.0, -2.0), 4.5: (4.0, 6.0)}[x]
    assert set(r.unique().tolist()) == {lo, hi}
    p_hi = (r == hi).double().mean().item()
    assert abs(p_hi - (x - lo) / (hi - lo)) < 0.02


def test_derive_refuses_an_unknown_stream():
    with pytest.raises(ValueError, match="unknown stream 'Noise'"):
        counter_rng.derive(torch.tensor(5), "Noise")


@pytest.mark.parametrize(
    "state",
    [torch.tensor([3, 2**20], dtype=torch.int32), torch.tensor([3.0, 4.0]), torch.tensor([3])],
    ids=["int32", "float", "one"],
)
def test_layer_seeds_refuse_a_state_not_int64_pair(state):
    # int32 overflowed in the products: other seeds than the int64 state's, silently
    with pytest.raises(ValueError, match="rng_state must be int64"):
        counter_rng.layer_seeds(state)


def test_draws_refuse_bad_sizes_and_keys():
    key = torch.tensor(12345)
    with pytest.raises(ValueError, match="shape must be a tuple of ints >= 0"):
        counter_rng.uniform(key, (2, -3), "cpu")
    with pytest.raises(ValueError, match="number of draws"):
        counter_rng.random_signs(key, -4, "cpu")
    with pytest.raises(ValueError, match="key must be a one-element"):  # [2] keys broadcast
        counter_rng.uniform(torch.tensor([5, 6]), (2,), "cpu")
