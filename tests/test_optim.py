"""minifloat.optim: AdamW with low-precision states, state formats, presets, memory math."""

from __future__ import annotations

import io

import pytest
import torch

from minifloat.optim import (
    OPTIM_STATE_PRESETS,
    STATE_FORMATS,
    AdamW,
    bytes_per_param,
    get_state_format,
    preset_param_dtype,
)
from minifloat.optim.codecs import stochastic_round_bf16, stochastic_round_e4m3
from minifloat.sqnr import sqnr_db
from tolerances import STATE_CODEC_SQNR_DB, STATE_TRAJECTORY_SQNR_DB


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 96), (96,), (8, 8), (130, 70)]  # 2-D big, 1-D, small, ragged blocks
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    # Magnitudes over many binades per tensor, as real gradients have.
    return [
        torch.randn(p.shape, generator=gen) * torch.exp(torch.randn(p.shape, generator=gen))
        for p in params
    ]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g.to(p.dtype)
        opt.step()


# ---- reference semantics -------------------------------------------------------------------


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_states_match_torch_adamw_bitwise(foreach, weight_decay):
    ours, theirs = _params(0), _params(0)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt = AdamW([{"params": ours[:2]}, {"params": ours[2:], "lr": 1e-3}], **kw)
    ref = torch.optim.AdamW(
        [{"params": theirs[:2]}, {"params": theirs[2:], "lr": 1e-3}], foreach=foreach, **kw
    )
    _run(opt, ours, range(10))
    _run(ref, theirs, range(10))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_small_and_1d_tensors_keep_fp32_state():
    params = _params(0)
    opt = AdamW(params, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8-sqrt")
    _run(opt, params, range(1))
    formats = [opt.state[p]["exp_avg_format"] for p in params]
    assert formats == ["fp8", "fp32", "fp32", "fp8"]
    assert opt.state[params[0]]["exp_avg_sq"].dtype == torch.float8_e4m3fn


# ---- state formats -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STATE_FORMATS))
def test_state_format_round_trip(name):
    fmt = get_state_format(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, generator=gen) * torch.exp(torch.randn(3, 1000, generator=gen))
    if fmt.sqrt_domain:
        x = x.square()
    payload, scale = fmt.encode(x, generator=torch.Generator().manual_seed(1))
    assert payload.dtype == fmt.storage_dtype
    out = fmt.decode(payload, scale, x.shape)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert sqnr_db(x, out) >= STATE_CODEC_SQNR_DB[name]
    bad = x.clone()
    bad[1, 5] = float("nan")
    assert torch.isnan(fmt.decode(*fmt.encode(bad), x.shape)).any()


def test_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1.0 + 1 / 3)  # between bf16 and e4m3 grid points
    gen = torch.Generator().manual_seed(0)
    # Means of n seeded draws, one step (2^-7, 0.125, 2^-9) apart: the tolerances are >= 9
    # standard errors (step / 2 / sqrt(n)); measured within 1.4.
    assert stochastic_round_bf16(x, generator=gen).float().mean().item() == pytest.approx(
        x[0].item(), rel=1e-4
    )
    e4m3 = stochastic_round_e4m3(-x, generator=gen).float()
    assert set(e4m3.unique().tolist()) == {-1.375, -1.25}
    assert e4m3.mean().item() == pytest.approx(-x[0].item(), rel=1e-3)
    tiny = torch.full((100_000,), 2.0**-10)  # below the smallest e4m3 subnormal 2^-9
    assert stochastic_round_e4m3(tiny, generator=gen).float().mean().item() == pytest.approx(
        2.0**-10, rel=0.03
    )


@pytest.mark.parametrize(
    ("fn", "noise"),
    [
        (stochastic_round_e4m3, torch.rand(8)),
        (stochastic_round_bf16, torch.zeros(8, dtype=torch.int32)),
    ],
)
def test_stochastic_rounding_refuses_both_generator_and_noise(fn, noise):
    with pytest.raises(ValueError, match="generator or noise, not both"):
        fn(torch.randn(8), generator=torch.Generator(), noise=noise)


def test_unknown_format_lists_names():
    with pytest.raises(ValueError, match="fp8-sqrt"):
        AdamW(_params(0), exp_avg_dtype="int3")
    with pytest.raises(ValueError, match="exp_avg_sq"):
        AdamW(_params(0), exp_avg_dtype="fp8-sqrt")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr=float("nan")), ValueError, "lr must be finite and >= 0, got nan"),
        (dict(eps=float("inf")), ValueError, "eps must be finite"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay must be finite and >= 0"),
        (dict(lr=torch.tensor(1e-3)), TypeError, "lr must be a Python float"),
        (dict(betas=(0.9,)), ValueError, "betas must be two floats"),
        (dict(betas=(0.9, 1.0)), ValueError, "betas must be two floats"),
        (dict(block_size=0), ValueError, "block_size must be a positive int"),
        (dict(block_size=1.5), ValueError, "block_size must be a positive int"),
        # every moment is padded to whole blocks: 1e9 allocated 1e9-element states (OOM kill)
        (dict(block_size=10**9), ValueError, r"block_size must be a positive int <= 65536"),
        (dict(block_size=2**16 + 1), ValueError, r"<= 65536 .*got 65537"),
        (dict(small_numel="4096"), TypeError, "small_numel must be an int >= 0, got str"),
        (dict(small_numel=4096.0), TypeError, "small_numel must be an int"),
        (dict(small_numel=-1), ValueError, "small_numel must be an int >= 0, got -1"),
        (dict(seed="x"), TypeError, "seed must be an int, got str"),
        (dict(seed=1.5), TypeError, "seed must be an int, got float"),
        (dict(seed=True), TypeError, "seed must be an int, got bool"),
        (dict(seed=2**64), ValueError, r"seed must lie in \[-2\*\*63, 2\*\*64\)"),
        (dict(fused="yes"), TypeError, "fused must be True, False or None, got 'yes'"),
        (dict(fused=1), TypeError, "fused must be True, False or None"),
    ],
)
def test_bad_hyperparameters_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        AdamW(_params(0), **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(block_size=2**16), dict(seed=2**64 - 1), dict(seed=-1),
                                    dict(small_numel=0), dict(fused=False)])  # fmt: skip
def test_boundary_options_are_accepted(kwargs):
    params = _params(0)
    _run(AdamW(params, exp_avg_dtype="fp8", **kwargs), params, range(1))


def test_params_the_optimizer_cannot_keep_exactly_are_refused():
    f64 = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64 .*fp32 master would drop precision"):
        AdamW([f64])  # torch.optim.AdamW updates it in float64; ours would round to fp32
    f16 = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="supports float32, bfloat16 params, got torch.float16"):
        AdamW([f16], master_weights="none")


def test_a_step_with_a_bad_group_changes_no_state():
    params = _params(0)
    opt = AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["lr"] = float("nan")  # as a broken schedule would set it
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.step()
    assert not opt.state and all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": -1.0})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["lr"] = 1e-3
    opt.step()
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)


# ---- low-precision states stay close to fp32 states ------------------------------------------


@pytest.mark.parametrize("formats", sorted(STATE_TRAJECTORY_SQNR_DB), ids="/".join)
def test_low_precision_states_track_fp32(formats):
    ref_params, params = _params(0), _params(0)
    ref = AdamW(ref_params, lr=1e-2)
    opt = AdamW(params, lr=1e-2, exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1])
    _run(ref, ref_params, range(20))
    _run(opt, params, range(20))
    for p0, a, b in zip(_params(0), ref_params, params, strict=True):
        assert sqnr_db(a - p0, b - p0) >= STATE_TRAJECTORY_SQNR_DB[formats], formats


def test_fp32_master_for_bf16_params():
    params = _params(0, torch.bfloat16)
    opt = AdamW(params, lr=1e-3)
    _run(opt, params, range(3))
    for p in params:
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(p, master.to(torch.bfloat16))
    # The master accumulates updates too small to move a bf16 weight.
    ref = _params(0)
    _run(AdamW(ref, lr=1e-3), ref, range(3))
    assert torch.equal(opt.state[params[0]]["master"], ref[0]) is False
    # same updates, but from bf16-rounded initial weights (2^-9 relative: ~55 dB measured)
    assert sqnr_db(ref[0], opt.state[params[0]]["master"]) > 50


def test_masterless_stochastic_rounding_is_deterministic_and_unbiased():
    def train(seed: int) -> list[torch.Tensor]:
        params = _params(0, torch.bfloat16)
        _run(AdamW(params, lr=1e-4, master_weights="none", seed=seed), params, range(5))
        return params

    a, b, c = train(0), train(0), train(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # Steps of 1e-4 are below half a bf16 ulp for most weights: round-to-nearest would stall,
    # stochastic rounding follows the fp32 trajectory on average (regression slope ~1).
    ref = _params(0, torch.bfloat16)
    ref = [p.float().detach().requires_grad_() for p in ref]
    start = [p.detach().clone() for p in ref]
    _run(AdamW(ref, lr=1e-4), ref, range(5))
    moved = (a[0].float() - start[0]).flatten()
    target = (ref[0] - start[0]).flatten().detach()
    slope = (moved @ target / (target @ target)).item()
    assert 0.8 < slope < 1.2, slope


def test_nonfinite_gradient_propagates():
    params = _params(0)
    opt = AdamW(params, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8-sqrt")
    for p in params:
        p.grad = torch.zeros_like(p)
    params[0].grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(params[0]).any()


# ---- checkpoints -----------------------------------------------------------------------------


def _save_load(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("preset", sorted(OPTIM_STATE_PRESETS))
def test_state_dict_round_trip_resumes_exactly(preset):
    kwargs = dict(OPTIM_STATE_PRESETS[preset])
    dtype = torch.bfloat16 if kwargs["master_weights"] == "none" else torch.float32
    full = _params(0, dtype)
    _run(AdamW(full, lr=1e-3, **kwargs), full, range(6))
    part = _params(0, dtype)
    opt = AdamW(part, lr=1e-3, **kwargs)
    _run(opt, part, range(3))
    sd = _save_load(opt.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in part]
    opt2 = AdamW(resumed, lr=1e-3, **kwargs)
    opt2.load_state_dict(sd)
    _run(opt2, resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(full, resumed, strict=True))


@pytest.mark.parametrize(
    ("src", "dst"), [("fp32", "fp8-fp16"), ("fp8-fp16", "fp32"), ("bf16", "lean")]
)
def test_state_dict_loads_across_state_dtypes(src, dst):
    params = _params(0)
    opt = AdamW(params, lr=1e-3, **{**OPTIM_STATE_PRESETS[src], "master_weights": "fp32"})
    _run(opt, params, range(3))
    kwargs = {**OPTIM_STATE_PRESETS[dst], "master_weights": "fp32"}
    opt2 = AdamW([p.detach().clone() for p in params], lr=1e-3, **kwargs)
    opt2.load_state_dict(_save_load(opt.state_dict()))
    p_src, p_dst = params[0], opt2.param_groups[0]["params"][0]
    s_src, s_dst = opt.state[p_src], opt2.state[p_dst]
    assert s_dst["exp_avg_format"] == kwargs["exp_avg_dtype"]
    assert float(s_dst["step"]) == 3.0
    for key in ("exp_avg", "exp_avg_sq"):
        a = opt._load_moment(s_src, key, p_src.shape)
        b = opt2._load_moment(s_dst, key, p_dst.shape)
        assert sqnr_db(a, b) >= 24.0, key  # one encode in the coarser of the two formats
    _run(opt2, opt2.param_groups[0]["params"], range(3, 4))  # and it steps


def test_loads_torch_adamw_state_dict():
    theirs, ours = _params(0), _params(0)
    ref = torch.optim.AdamW(theirs, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    _run(ref, theirs, range(3))
    ours = [p.detach().clone().requires_grad_() for p in theirs]
    opt = AdamW(ours, lr=1e-3)
    opt.load_state_dict(_save_load(ref.state_dict()))
    _run(ref, theirs, range(3, 5))
    _run(opt, ours, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))


def _trained(preset: str = "fp8-fp16", shapes=((64, 64),)) -> tuple[AdamW, list[torch.Tensor]]:
    params = [torch.randn(s).requires_grad_() for s in shapes]
    opt = AdamW(params, lr=1e-3, small_numel=0, **{**OPTIM_STATE_PRESETS[preset],
                                                   "master_weights": "fp32"})  # fmt: skip
    _run(opt, params, range(2))
    return opt, params


@pytest.mark.parametrize("preset", ["fp8-fp16", "fp32"])
@pytest.mark.parametrize("shape", [(32, 32), (64, 32), (32, 128)])
def test_a_state_for_another_shape_is_refused(preset, shape):
    """A block-scaled moment of a larger tensor decoded its first elements silently; one of the
    same size and another shape loaded too."""
    sd = _save_load(_trained(preset)[0].state_dict())
    opt = AdamW([torch.randn(shape).requires_grad_()], small_numel=0)
    with pytest.raises(ValueError, match=r"is for shape \[64, 64\], this param has shape"):
        opt.load_state_dict(sd)
    del sd["minifloat"]["shapes"]  # a state dict saved before shapes were recorded
    if shape[0] * shape[1] != 64 * 64:
        with pytest.raises(ValueError, match=r"saved exp_avg of param 0 holds 4096 elements"):
            opt.load_state_dict(sd)
    assert not opt.state


@pytest.mark.parametrize(
    ("saved", "match"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "is not an AdamW state"),
        (lambda p: torch.optim.AdamW(p, maximize=True), "saved with maximize=True"),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), "saved with amsgrad=True"),
    ],
)
def test_a_state_dict_that_does_not_fit_changes_nothing(saved, match):
    """The groups were updated and the state cleared before the first failure: the moments
    were lost and the lr came from the bad dict."""
    opt, params = _trained(shapes=((64, 64), (32, 32)))
    before = _save_load(opt.state_dict())
    other = [p.detach().clone().requires_grad_() for p in params]
    theirs = saved(other)
    for p in other:
        p.grad = torch.ones_like(p)
    theirs.step()
    sd = _save_load(theirs.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match=match) as info:
        opt.load_state_dict(sd)
    assert "\n" not in str(info.value)
    after = opt.state_dict()
    assert opt.param_groups[0]["lr"] == 1e-3
    for pid, state in before["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "step"):
            if key in state:
                assert torch.equal(state[key], after["state"][pid][key]), key


def test_a_scaled_moment_without_its_scale_is_named():
    sd = _save_load(_trained()[0].state_dict())
    del sd["state"][0]["exp_avg_scale"]  # was an AttributeError deep in the decode
    opt = AdamW([torch.randn(64, 64).requires_grad_()], small_numel=0)
    with pytest.raises(ValueError, match="saved exp_avg of param 0 is block-scaled but has no"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("sd", [{}, [], {"state": {}}], ids=["empty", "list", "no groups"])
def test_load_state_dict_refuses_what_is_not_a_state_dict(sd):
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        AdamW(_params(0)).load_state_dict(sd)


def test_eps_zero_and_a_parameter_twice_are_refused():
    """eps = 0 turned the update of every gradient entry of exactly 0 into 0/0 = NaN; a
    parameter twice in one group was stepped twice (torch only warns)."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="eps must be finite and > 0, got 0.0"):
        AdamW([p], eps=0.0)
    with pytest.raises(ValueError, match="parameter 1 of a param group appears in it twice"):
        AdamW([p, p])


# ---- memory accounting -------------------------------------------------------------------------

EXPECTED_BYTES = {
    "fp32": 16.0,  # fp32 weights, grads, m, v
    "bf16": 12.0,  # fp32 weights and grads, bf16 m, v
    "fp8-fp16": 4 + 4 + (1 + 4 / 128) + (2 + 4 / 128),
    "lean": 2 + 2 + 2 * (1 + 4 / 128),  # bf16 weights and grads, 8-bit m and v
}


@pytest.mark.parametrize("preset", sorted(OPTIM_STATE_PRESETS))
def test_bytes_per_param_matches_allocated_state(preset):
    kwargs = dict(OPTIM_STATE_PRESETS[preset])
    table = bytes_per_param(preset)
    assert table["total"] == pytest.approx(EXPECTED_BYTES[preset])  # float64 sums of fractions
    dtype = torch.bfloat16 if kwargs["master_weights"] == "none" else torch.float32
    p = torch.zeros(256, 1024, dtype=dtype, requires_grad=True)
    p.grad = torch.ones_like(p)
    opt = AdamW([p], **kwargs)
    opt.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for k, t in opt.state[p].items()
        if isinstance(t, torch.Tensor) and k != "step"
    )
    expected = table["exp_avg"] + table["exp_avg_sq"] + table["master"]
    assert state_bytes / p.numel() == pytest.approx(expected)
    assert table["weights"] == p.element_size()


def test_bytes_per_param_bf16_params_with_master():
    table = bytes_per_param("fp8-fp16", param_dtype="bf16")
    assert table["master"] == 4.0 and table["weights"] == 2.0


def test_bytes_per_param_takes_block_size_from_the_config_or_the_argument():
    lean = bytes_per_param("lean")
    assert bytes_per_param({**OPTIM_STATE_PRESETS["lean"], "block_size": 128}) == lean
    wide = bytes_per_param({**OPTIM_STATE_PRESETS["lean"], "block_size": 32}, block_size=2**16)
    assert wide["exp_avg"] == 1 + 4 / 2**16
    # a dict holding any AdamW keyword is a configuration (the CLI's presets are such dicts)
    assert bytes_per_param({**OPTIM_STATE_PRESETS["lean"], "lr": 1e-3, "seed": 3}) == lean


@pytest.mark.parametrize(
    "config, kwargs, error, match",
    [
        ("lean", dict(block_size=-1), ValueError, "block_size must be a positive int"),
        ("lean", dict(block_size=0), ValueError, "block_size must be a positive int"),  # not 128
        ("lean", dict(block_size=10**9), ValueError, "block_size must be a positive int <= 65536"),
        ({"block_size": 0}, {}, ValueError, "block_size must be a positive int"),
        ({"exp_avg_dtyp": "fp8"}, {}, ValueError, "unknown .* key 'exp_avg_dtyp'; valid keys: "),
        ({"master_weights": "None"}, {}, ValueError, r"master_weights must be one of"),
        ({"exp_avg_dtype": "fp9"}, {}, ValueError, "unknown optimizer state format 'fp9'"),
        ("fp32", dict(param_dtype="fp64"), ValueError, "param_dtype must be one of fp32, bf16"),
        ("fp32", dict(param_dtype=torch.bfloat16), ValueError, "param_dtype must be one of"),
        ("fp33", {}, ValueError, "unknown optimizer-state preset 'fp33'"),
        (["lean"], {}, TypeError, "a preset name or a dict of AdamW keyword arguments, got list"),
    ],
)
def test_bytes_per_param_refuses_bad_input_in_one_line(config, kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        bytes_per_param(config, **kwargs)
    assert "\n" not in str(info.value)


def test_preset_param_dtype_refuses_a_bad_master_mode():
    with pytest.raises(ValueError, match="master_weights must be one of"):
        preset_param_dtype({"master_weights": "None"})  # was "fp32" silently


def test_configuration_keys_are_adamws_keywords():
    import inspect

    from minifloat.optim import adamw, presets

    parameters = inspect.signature(AdamW.__init__).parameters
    defaults = {k: p.default for k, p in parameters.items() if k not in ("self", "params")}
    assert set(presets._CONFIG_KEYS) == set(defaults)
    # every AdamW keyword, at AdamW's own default, is a configuration bytes_per_param prices
    assert presets.bytes_per_param(defaults) == presets.bytes_per_param({})
    with pytest.raises(ValueError, match="unknown optimizer-state configuration key 'blocksize'"):
        presets.bytes_per_param({"blocksize": 64})
    for mode in adamw.MASTER_MODES:
        presets.bytes_per_param({"master_weights": mode})
    with pytest.raises(ValueError, match="master_weights must be one of"):
        presets.bytes_per_param({"master_weights": "bf16"})


@pytest.mark.parametrize("name", ["fp16", "fp8", "fp8-sqrt"])
def test_underflowed_second_moment_decodes_to_block_floor(name):
    fmt = get_state_format(name)
    v = torch.zeros(256)
    v[0], v[1] = 1.0, 1e-30  # v[1] underflows in its block; v[128:] is a genuinely zero block
    payload, scale = fmt.encode(v)
    plain = fmt.decode(payload, scale, v.shape)
    floored = fmt.decode(payload, scale, v.shape, floor_underflow=True)
    assert plain[1] == 0 and 0 < floored[1] < 1e-3
    assert torch.equal(floored[0], plain[0])
    # An all-zero block (scale 1 by convention) holds exact zeros and stays zero.
    assert torch.equal(floored[128:], torch.zeros(128))


@pytest.mark.parametrize("block_size", [0, -4, True, 2**30])
def test_state_format_refuses_bad_block_sizes(block_size):
    # True was a block of 1; 2**30 padded every moment to a block of a billion elements
    fmt = get_state_format("fp8-sr")
    for call in (
        lambda: fmt.encode(torch.randn(10), block_size=block_size),
        lambda: fmt.draw_noise(10, torch.device("cpu"), torch.Generator(), block_size=block_size),
        lambda: fmt.bytes_per_element(block_size),
    ):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            call()


@pytest.mark.parametrize(
    ("rounder", "noise"),
    [
        (stochastic_round_e4m3, torch.rand(1)),
        (stochastic_round_e4m3, torch.rand(2, 4)),
        (stochastic_round_bf16, torch.zeros(1, dtype=torch.int32)),
        (stochastic_round_bf16, torch.rand(4)),
    ],
)
def test_stochastic_rounding_refuses_noise_not_of_x_shape(rounder, noise):
    # broadcast, one draw rounded every entry alike (or grew the output's shape)
    with pytest.raises(ValueError, match="noise must be"):
        rounder(torch.full((4,), 1.03), noise=noise)


@pytest.mark.parametrize("numel", [3, 8])
def test_decode_refuses_a_shape_the_payload_does_not_hold(numel):
    # 10 values in 3 blocks of 4: a shape of 3 or 8 dropped the rest silently
    fmt = get_state_format("fp8")
    payload, scale = fmt.encode(torch.randn(10), block_size=4)
    with pytest.raises(ValueError, match="does not fit a payload of 3 blocks of 4"):
        fmt.decode(payload, scale, torch.Size([numel]))
    with pytest.raises(ValueError, match="scaled payload is"):
        fmt.decode(payload, None, torch.Size([10]))
