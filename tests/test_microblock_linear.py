"""QuantLinear under nvfp4 / mxfp4: every GEMM against a float64 reference of the same math
(stochastic rounding and Hadamard transforms included, with the layer's own draws), stochastic
rounding unbiased through the layer, draws reproducible across a state_dict round trip, the
random state advanced once per trained backward, different draws on data-parallel ranks, and
`convert`'s last blocks in bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bits import bits_equal
from gloo_ranks import spawn
from linear_reference import U, gemm_with_bound
from minifloat import convert, counter_rng, hadamard, recipes
from minifloat.diagnostics import measure_layer_sqnr
from minifloat.linear import QuantLinear
from minifloat.models.llama import Llama, get_config
from minifloat.quantize import quantize
from minifloat.recipes import QuantRecipe
from test_linear import _data, run_layer
from tolerances import NVFP4_GRAD_OUTPUT_DB

CPU = torch.device("cpu")
RECIPES = ["nvfp4", "mxfp4", "mxfp4:rht=on", "nvfp4:block=32:rht.size=32"]
SHAPES = [(64, 128, 96), (50, 192, 64)]  # (M, K, N); M = 50: ragged token blocks and padding


def _deq(t: torch.Tensor, spec, noise=None) -> torch.Tensor:
    """quantize(t) dequantized, float64 (the block x tensor scale as quantize() rounds it)."""
    rounding = "stochastic" if noise is not None else "nearest"
    q = quantize(t, spec.fmt, spec.granularity, scale_format=spec.scale_format,
                 rounding=rounding, noise=noise)  # fmt: skip
    return q.values.double() * q.expand_scale().double()


def _noise(spec, seed, shape):
    if spec.rounding != "stochastic":
        return None
    return counter_rng.uniform(counter_rng.derive(seed, "noise"), shape, CPU)


def reference(recipe: QuantRecipe, x, w, b, dy, seeds):
    """{name: (float64 value, fp32 error bound)}; `seeds` = layer_seeds of the step."""
    x, w, dy = x.float(), w.float(), dy.float()
    wq = _deq(w, recipe.fprop.rhs)
    y, y_err = gemm_with_bound(_deq(x, recipe.fprop.lhs), wq)
    out = {"y": (y + b.double(), y_err)}
    g = _deq(dy, recipe.dgrad.lhs, _noise(recipe.dgrad.lhs, seeds[0], dy.shape))
    w_t = wq.t() if recipe.dgrad.rhs.reuse else _deq(w.t().contiguous(), recipe.dgrad.rhs)
    out["dx"] = gemm_with_bound(g, w_t)
    lhs, rhs = recipe.wgrad.lhs, recipe.wgrad.rhs
    dy_t, x_t = dy.t().contiguous(), x.t().contiguous()
    if lhs.hadamard:  # both operands rotated along M with the step's signs
        key = counter_rng.derive(seeds[1], "signs")
        signs = counter_rng.random_signs(key, lhs.hadamard, CPU)
        dy_t, x_t = hadamard.rotate(dy_t, signs, dim=1), hadamard.rotate(x_t, signs, dim=1)
    h = _deq(dy_t, lhs, _noise(lhs, seeds[1], dy_t.shape))
    out["dw"] = gemm_with_bound(h, _deq(x_t, rhs))
    out["db"] = (dy.double().sum(0), dy.shape[0] * U * dy.double().abs().sum(0))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", RECIPES)
def test_matches_float64_reference(name, shape, dtype):
    x, w, b, dy = _data(*shape)
    x, dy = x.to(dtype), dy.to(dtype)
    seeds = counter_rng.layer_seeds(torch.tensor([0, 0]))  # a fresh layer: salt 0, step 0
    got = run_layer(name, x, w, b, dy, backend="emulated")
    for key, (value, bound) in reference(recipes.get(name), x, w, b, dy, seeds).items():
        out = got[key].double()
        rel = 4 * U if got[key].dtype == torch.float32 else 2.0**-8  # final cast's rounding
        tol = bound + rel * (value.abs() + bound) + 1e-30
        excess = ((out - value).abs() - tol).max().item()
        assert excess <= 0, f"{name} {key}: error exceeds the fp32 bound by {excess:.3g}"


def _layer(name: str, w: torch.Tensor, salt: int = 0) -> QuantLinear:
    layer = QuantLinear(w.shape[1], w.shape[0], bias=False, recipe=name, backend="emulated")
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.seed_rng(salt)
    return layer


def _step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_()
    layer.weight.grad = None
    layer(x).backward(dy)
    return x.grad, None if layer.weight.grad is None else layer.weight.grad.clone()


def test_hadamard_longer_than_the_step_needs_fails_at_the_first_training_call():
    """rht.size depends on no layer dim, so the variant builds and converts; the first call
    that rotates (a forward that prepares wgrad) with fewer tokens than it needs raises."""
    x, w, _, dy = _data(100, 64, 32, seed=6)
    layer = _layer("nvfp4:rht.size=256", w)
    layer.weight.requires_grad_(False)
    layer(x)  # no weight gradient: no wgrad operands, nothing rotated
    layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"rht.size=256: this wgrad rotates 100 tokens.*<= 128$"):
        _step(layer, x, dy)
    dx, dw = _step(_layer("nvfp4:rht.size=128", w), x, dy)  # 128 covers the 100 tokens
    assert bool(dx.isfinite().all() and dw.isfinite().all())


def test_stochastic_rounding_is_unbiased_through_the_layer():
    """mxfp4's dx = Q_sr(dy)·Q(wᵀ)ᵀ: E[Q_sr(dy)] = dy (E8M0 scales never saturate), so the mean
    of dx over steps tends to dy·Q(wᵀ)ᵀ, the error shrinking like 1/sqrt(steps); with
    round-to-nearest the error stays."""
    x, w, _, dy = _data(16, 64, 64, seed=3)
    layer = _layer("mxfp4", w)
    layer.weight.requires_grad_(False)  # dgrad only
    want = gemm_with_bound(dy.double(), _deq(w.t().contiguous(), layer.recipe.dgrad.rhs))[0]
    total, errors = torch.zeros_like(want), {}
    for step in range(1, 65):
        total += _step(layer, x, dy)[0].double()
        if step in (4, 64):
            errors[step] = ((total / step - want).norm() / want.norm()).item()
    assert layer.rng_state[1] == 64  # one draw per trained step
    rne = _step(_layer("mxfp4:sr=off", w), x, dy)[0].double()
    rne_error = ((rne - want).norm() / want.norm()).item()
    assert errors[64] < errors[4] / 2.5  # ~4x for 16x the draws
    assert errors[64] < rne_error / 2


def test_draws_are_reproducible_across_a_state_dict_round_trip():
    x, w, _, dy = _data(64, 128, 96, seed=4)
    run = _layer("nvfp4", w, salt=123)
    _step(run, x, dy)
    saved = copy.deepcopy(run.state_dict())
    assert saved["rng_state"].tolist() == [123, 1]
    later = [_step(run, x, dy) for _ in range(2)]
    resumed = _layer("nvfp4", w, salt=999)
    resumed.load_state_dict(saved)  # strict: the random state travels with checkpoints
    again = [_step(resumed, x, dy) for _ in range(2)]
    for (dx_a, dw_a), (dx_b, dw_b) in zip(later, again, strict=True):
        assert torch.equal(dx_a, dx_b) and torch.equal(dw_a, dw_b)
    assert not torch.equal(later[0][1], later[1][1])  # each step draws anew
    other = _layer("nvfp4", w, salt=124)  # another layer (salt), same step: other draws
    other.load_state_dict({**saved, "rng_state": torch.tensor([124, 1])})
    assert not torch.equal(_step(other, x, dy)[1], later[0][1])
    plain = nn.Linear(128, 96, bias=False)
    resumed.load_state_dict(plain.state_dict())  # an nn.Linear's keys: the state stays
    assert resumed.rng_state.tolist() == [123, 3]


def test_random_state_counts_trained_backwards_only():
    x, w, _, dy = _data(32, 64, 64, seed=5)
    layer = _layer("nvfp4", w, salt=7)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    layer.train()
    assert layer.rng_state.tolist() == [7, 0]  # evaluation draws nothing
    _step(layer, x, dy)
    assert layer.rng_state.tolist() == [7, 1]
    from torch.utils.checkpoint import checkpoint

    xg = x.clone().requires_grad_()
    checkpoint(layer, xg, use_reentrant=False).backward(dy)  # forward recomputed: one step
    assert layer.rng_state.tolist() == [7, 2]
    layer.reset_buffers()
    assert layer.rng_state.tolist() == [7, 0]


def test_set_recipe_keeps_starts_or_drops_the_random_state():
    x, w, _, dy = _data(32, 64, 64, seed=7)
    layer = _layer("nvfp4", w, salt=9)
    _step(layer, x, dy)
    state = layer.rng_state
    layer.set_recipe("mxfp4")  # draws too: the same state goes on counting
    assert layer.rng_state is state and state.tolist() == [9, 1]
    layer.set_recipe("fp4")  # draws nothing: no state, and none in the state_dict
    assert layer.rng_state is None and list(layer.state_dict()) == ["weight"]
    layer.set_recipe("nvfp4")  # the layer's salt again, from step 0
    assert layer.rng_state.tolist() == [9, 0] and "rng_state" in layer.state_dict()
    _step(layer, x, dy)
    assert layer.rng_state.tolist() == [9, 1]


def _rank_worker(rank: int, x, w, dy, single) -> None:
    """Same layer, data and step on both ranks: rank 0 draws what one process draws, rank 1
    other numbers (its rank is mixed into the seeds), the same compiled as eager."""
    layer = _layer("nvfp4", w, salt=5)
    compiled_layer = copy.deepcopy(layer)
    dx, dw = _step(layer, x, dy)
    if rank == 0:
        assert torch.equal(dx, single[0]) and torch.equal(dw, single[1])
    else:
        assert not torch.equal(dx, single[0]) and not torch.equal(dw, single[1])
        got = _step(torch.compile(compiled_layer, fullgraph=True), x, dy)
        assert bits_equal(got[0], dx) and bits_equal(got[1], dw)
    assert layer.rng_state.tolist() == [5, 1]  # the buffer is the same on every rank


def test_data_parallel_ranks_draw_different_numbers():
    x, w, _, dy = _data(32, 64, 64, seed=6)
    single = _step(_layer("nvfp4", w, salt=5), x, dy)
    spawn(_rank_worker, x, w, dy, single)


def test_convert_keeps_the_last_blocks_and_salts_layers():
    model = Llama(get_config("tiny"))
    plain_state = copy.deepcopy(model.state_dict())
    n = model.config.n_layers
    _, report = convert(model, "nvfp4", return_report=True)
    assert all(name.startswith(("layers.0.", "layers.1.")) for name in report.converted)
    assert len(report.converted) == 7 * (n - 2)
    kept = [name for name, why in report.skipped if "last 2 blocks" in why]
    assert len(kept) == 7 * 2 and all(
        k.startswith((f"layers.{n - 2}.", f"layers.{n - 1}.")) for k in kept
    )
    assert type(model.output) is nn.Linear and type(model.layers[n - 1].attention.wq) is nn.Linear
    salts = [m.rng_state[0].item() for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(set(salts)) == len(salts)  # each layer its own draws, from its name
    keys = [k for k in model.state_dict() if k.endswith("rng_state")]
    assert len(keys) == len(report.converted)
    model.load_state_dict(plain_state)  # a plain model's state_dict still loads
    everything = convert(Llama(get_config("tiny")), "nvfp4:keep_last=0", return_report=True)[1]
    assert len(everything.converted) == 7 * n


def test_layer_sqnr_leaves_the_random_state_alone():
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 32))
    convert(model, "nvfp4")
    tokens = torch.randn(48, 64)
    states = [m.rng_state.clone() for m in model.modules() if isinstance(m, QuantLinear)]
    result = measure_layer_sqnr(
        model, tokens, torch.randn(48, 32), recipe=recipes.get("nvfp4"),
        loss_fn=lambda out, t: (out.float() - t).pow(2).mean(),
    )  # fmt: skip
    after = [m.rng_state for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(torch.equal(a, b) for a, b in zip(states, after, strict=True))
    lo, hi = NVFP4_GRAD_OUTPUT_DB
    for layer in result.values():
        assert lo < layer["grad_output_t"] < hi and lo < layer["grad_output"] < hi
