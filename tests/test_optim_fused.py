"""Fused low-precision AdamW (optim/fused.py): bit-identical to the unfused path (decode, foreach
update, encode) on CPU, and the compiled update bit-identical to the eager one."""

from __future__ import annotations

import io

import pytest
import torch
from torch._dynamo.utils import counters

from bits import bits_equal
from minifloat.exact import fma_rn
from minifloat.optim import OPTIM_STATE_PRESETS, AdamW, get_state_format
from minifloat.optim.fused import (
    _COMPILED,
    adamw_scalars,
    adamw_update,
    draw_step_noise,
    select_update,
    triton_supports,
)

# (exp_avg format, exp_avg_sq format, master_weights, parameter dtype)
CONFIGS = [
    ("fp8", "fp16", "fp32", torch.float32),  # the fp8-fp16 preset
    ("fp8", "fp16", "fp32", torch.bfloat16),  # ... with an fp32 master of bf16 weights
    ("fp8", "fp8-sqrt", "none", torch.bfloat16),  # lean: bf16 weights rounded stochastically
    ("fp8-sr", "fp8-sqrt-sr", "none", torch.bfloat16),  # every stochastic draw there is
    ("bf16", "fp32", "fp32", torch.float32),  # unscaled payload beside an in-place fp32 moment
    ("fp32", "fp8-sr", "fp32", torch.float32),
]


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (96,), (8, 8), (130, 70)]  # 2-D, 1-D and small (fp32 states), ragged
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _run(opt: AdamW, params: list[torch.Tensor], steps: range, device: str = "cpu") -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            g = torch.randn(p.shape, generator=gen) * torch.exp(
                4 * torch.randn(p.shape, generator=gen)
            )
            if step == 1:
                g[..., :40] = 0.0  # whole zero blocks (scale 1) and zeros beside live values
            if step == 2:
                g = g * 1e-20  # second moments underflow: the decode floor takes over
            p.grad = g.to(p.dtype).to(device)
        opt.step()


def _make(params: list[torch.Tensor], config: tuple, fused: bool, kernel: str = "auto") -> AdamW:
    m, v, master, _ = config
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]
    kwargs = dict(exp_avg_dtype=m, exp_avg_sq_dtype=v, master_weights=master, small_numel=100)
    return AdamW(groups, lr=1e-2, weight_decay=0.1, seed=3, fused=fused, fused_kernel=kernel,
                 **kwargs)  # fmt: skip


def _assert_same_state(a: AdamW, b: AdamW, pa: list, pb: list) -> None:
    for x, y in zip(pa, pb, strict=True):
        assert x.dtype == y.dtype and bits_equal(x, y)
        sa, sb = a.state[x], b.state[y]
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == sb[key].dtype and bits_equal(value, sb[key]), key
            else:
                assert value == sb[key], key
    ga, gb = a.generator_states(), b.generator_states()
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c[:3])))
def test_fused_step_is_bit_identical_to_unfused(config):
    runs = []
    for fused in (False, True):
        params = _params(config[3])
        opt = _make(params, config, fused)
        _run(opt, params, range(5))
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    _assert_same_state(a, b, pa, pb)
    assert a.state[pa[0]]["exp_avg_format"] == config[0]  # the low-precision bucket was used


def _round_trip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("preset", ["fp8-fp16", "lean"])
def test_checkpoints_move_between_fused_and_unfused(preset):
    """Same state_dict format: a checkpoint of either path resumes in the other bit-exactly."""
    kwargs = dict(OPTIM_STATE_PRESETS[preset])
    dtype = torch.bfloat16 if kwargs["master_weights"] == "none" else torch.float32
    full = _params(dtype)
    _run(AdamW(full, lr=1e-3, fused=False, **kwargs), full, range(4))
    for saved_by in (False, True):
        part = _params(dtype)
        opt = AdamW(part, lr=1e-3, fused=saved_by, **kwargs)
        _run(opt, part, range(2))
        resumed = [p.detach().clone().requires_grad_() for p in part]
        opt2 = AdamW(resumed, lr=1e-3, fused=not saved_by, **kwargs)
        opt2.load_state_dict(_round_trip(opt.state_dict()))
        _run(opt2, resumed, range(2, 4))
        assert all(bits_equal(a, b) for a, b in zip(full, resumed, strict=True)), saved_by


def test_fused_propagates_nonfinite_gradients():
    params = _params(torch.float32)
    opt = AdamW(params, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp16", small_numel=100)
    for p in params:
        p.grad = torch.zeros_like(p)
    params[0].grad[3, 5] = float("nan")
    opt.step()
    assert torch.isnan(params[0]).any() and torch.isfinite(params[3]).all()


def _midpoint_products(n: int, gen: torch.Generator) -> torch.Tensor:
    """Values g whose product with 0.375 (= 1 - beta1 for beta1 = 0.625) is exactly halfway
    between two float32 values: 3 * (odd 24-bit significand above 2^24 / 3) has 25 bits."""
    odd = torch.randint(2**24 // 6 + 1, 2**23, (n,), generator=gen) * 2 + 1
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    return (sign * odd * 2.0**-23).float()


def test_fma_rn_is_the_fma_of_eager_lerp_and_addcmul():
    gen = torch.Generator().manual_seed(0)
    n = 20_003  # not a multiple of the vector width: the kernels' scalar tails too
    a = torch.randn(n, generator=gen) * torch.exp(8 * torch.randn(n, generator=gen))
    b = torch.randn(n, generator=gen) * torch.exp(8 * torch.randn(n, generator=gen))
    for w in (0.1, 0.375, 0.7):
        w32 = torch.tensor(w)
        near = fma_rn(w32, b - a, a) if w < 0.5 else fma_rn(w32 - 1, b - a, b)
        assert bits_equal(torch.lerp(a, b, w), near), w
    c = torch.tensor(0.05)
    assert bits_equal(torch.addcmul(a.abs(), b, b, value=0.05), fma_rn(c * b, b, a.abs()))
    # Products on a float32 midpoint plus a tiny addend: float64 a*b + c rounds to the midpoint
    # and then to even (wrong in about half the cases); fma_rn must still round like an FMA.
    d = _midpoint_products(n, gen)
    tiny = torch.randn(n, generator=gen) * 1e-30
    naive = (0.375 * d.double() + tiny.double()).float()
    assert not bits_equal(torch.lerp(tiny, tiny + d, 0.375), naive)  # the data is adversarial
    assert bits_equal(torch.lerp(tiny, tiny + d, 0.375), fma_rn(torch.tensor(0.375), d, tiny))
    specials = torch.tensor([float("inf"), float("nan"), 3e38, -0.0, 1e-45])
    assert bits_equal(torch.lerp(specials, specials.flip(0), 0.1),
                      fma_rn(torch.tensor(0.1), specials.flip(0) - specials, specials))  # fmt: skip


def test_fused_step_on_non_contiguous_parameters():
    """A transposed (column-major) parameter: the fused path matches the unfused one bit for
    bit there too (its state tensors follow the parameter's strides)."""
    config = CONFIGS[0]
    runs = []
    for fused in (True, False):
        params = _params(config[3])
        params[0] = params[0].detach().t().requires_grad_()  # (96, 64), column-major
        assert not params[0].is_contiguous()
        opt = _make(params, config, fused)
        _run(opt, params, range(3))
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    _assert_same_state(a, b, pa, pb)


def test_select_update_off_cuda_and_which_formats_the_triton_kernel_takes():
    fmt = get_state_format
    x = torch.zeros(4)
    assert select_update(x, x, None, (fmt("fp8"), fmt("fp16"))) is adamw_update
    with pytest.raises(ValueError, match="fused_kernel must be one of"):
        select_update(x, x, None, (fmt("fp8"), fmt("fp16")), kernel="cuda")
    with pytest.raises(ValueError, match="fused_kernel must be one of"):
        AdamW([x.requires_grad_()], fused_kernel="triton")
    assert not triton_supports((fmt("fp8"), fmt("fp16")), x, x, None)  # not on CUDA
    if torch.cuda.is_available():
        y = x.cuda()
        assert triton_supports((fmt("fp8"), fmt("fp16")), y, y, None)
        assert triton_supports((fmt("fp8"), fmt("fp8-sqrt")), y.bfloat16(), y, None)
        assert not triton_supports((fmt("fp8-sr"), fmt("fp16")), y, y, None)  # stochastic
        assert not triton_supports((fmt("bf16"), fmt("fp16")), y, y, None)  # unscaled
        assert not triton_supports((fmt("fp8"), fmt("fp16")), y.half(), y, None)  # no master
        assert not triton_supports((fmt("fp8"), fmt("fp16")), y, y, None, block_size=96)
        wide = torch.zeros(4, 6, device="cuda")
        assert not triton_supports((fmt("fp8"), fmt("fp16")), wide.t(), wide.t(), None)


def _update_inputs(step: float, lr: float, *, device: str = "cpu",
                   formats=("fp32", "fp8-sqrt-sr"), master: bool = True,
                   param_dtype: torch.dtype = torch.bfloat16):  # fmt: skip
    """One parameter's update inputs (bf16 with an fp32 master or rounded stochastically, or
    fp32, its own weight), with moments and gradients that put lerp's products on float32
    midpoints (beta1 = 0.625), so fma_rn's correction runs."""
    gen = torch.Generator().manual_seed(int(step))
    shape = (48, 100)  # 4800 elements: 37.5 blocks of 128, a ragged last block
    fmts = tuple(get_state_format(f) for f in formats)
    grad = _midpoint_products(shape[0] * shape[1], gen).view(shape)
    grad[:, ::3] = torch.randn(shape[0], 34, generator=gen) * 1e-3
    m = torch.randn(shape, generator=gen) * 1e-30 * torch.exp(4 * torch.randn(shape, generator=gen))
    m[0, :5] = 0.0
    v = torch.rand(shape, generator=gen) * torch.exp(8 * torch.randn(shape, generator=gen))
    exp_avg = (m, None) if fmts[0].name == "fp32" else fmts[0].encode(m, generator=gen)
    exp_avg_sq = fmts[1].encode(v, generator=gen)
    weight = torch.randn(shape, generator=gen)
    noise = draw_step_noise(weight.numel(), shape, torch.device("cpu"), gen, formats=fmts,
                            weight_noise=not master, block_size=128)  # fmt: skip
    weight_noise = not master and param_dtype == torch.bfloat16
    noise = noise if weight_noise else noise._replace(weight=None)
    tensors = (weight.to(param_dtype), grad, weight if master else None, exp_avg, exp_avg_sq,
               noise)  # fmt: skip
    param, grad, master_t, exp_avg, exp_avg_sq, noise = torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tensors
    )
    scalars = adamw_scalars(lr=lr, betas=(0.625, 0.95), eps=1e-8, weight_decay=0.1, step=step,
                            device=torch.device(device))  # fmt: skip
    return (param, grad, master_t, exp_avg, exp_avg_sq, scalars, noise), fmts


def _compare_compiled(device: str, formats: tuple[str, str], master: bool) -> None:
    for step, lr in ((3.0, 1e-2), (4.0, 5e-3)):
        results = []
        for fn in (adamw_update, _COMPILED[adamw_update]):
            args, fmts = _update_inputs(step, lr, device=device, formats=formats, master=master)
            m, v = fn(*args, formats=fmts, block_size=128)
            results.append((args[0], args[2], *m, *v))
        for a, b in zip(*results, strict=True):
            assert (a is None and b is None) or (a.dtype == b.dtype and bits_equal(a, b)), step
        start = _update_inputs(step, lr, formats=formats, master=master)[0][0]
        assert not bits_equal(results[0][0], start)  # the step moved the weights


@pytest.mark.slow
def test_compiled_update_is_bit_identical_to_eager_without_recompiles():
    """The compiled twin CUDA uses, run on CPU: inductor's C++ must not change a bit. One
    configuration that shows every bit (fp32 master and exp_avg) and runs stochastic e4m3 and
    sqrt-domain encoding; ~30 s to compile on 2 cores with a cold inductor cache. lr and the
    step change between calls without a recompile."""
    (_, grad, _, (m, _), *_), _ = _update_inputs(3.0, 1e-2)
    naive = (0.375 * (grad - m).double() + m.double()).float()
    assert not bits_equal(torch.lerp(m, grad, 0.375), naive)  # the data needs fma_rn's fix
    torch._dynamo.reset()
    counters.clear()
    _compare_compiled("cpu", ("fp32", "fp8-sqrt-sr"), master=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("formats", "master"),
    [(("fp32", "fp8-sqrt-sr"), True), (("fp8", "fp16"), True), (("fp8-sr", "fp8-sqrt"), False)],
)
def test_cuda_compiled_update_is_bit_identical_to_eager(formats, master):
    _compare_compiled("cuda", formats, master)


# (formats, master, parameter dtype): every weight mode and format the Triton kernel takes.
TRITON_CASES = [
    (("fp8", "fp16"), False, torch.float32),  # the fp8-fp16 preset on fp32 weights
    (("fp8", "fp16"), True, torch.bfloat16),  # ... as an fp32 master of bf16 weights
    (("fp8", "fp8-sqrt"), False, torch.bfloat16),  # lean: bf16 weights rounded stochastically
    (("fp16", "fp8"), True, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("formats", "master", "dtype"), TRITON_CASES,
                         ids=lambda c: str(c).replace("torch.", ""))  # fmt: skip
def test_cuda_triton_update_is_bit_identical_to_eager(formats, master, dtype):
    """The hand-written kernel against the eager reference on CUDA: midpoint FMAs, underflowing
    second moments, a ragged last block, a whole zero block and a NaN gradient."""
    from minifloat.optim.fused_triton import adamw_update_triton

    for step, lr in ((3.0, 1e-2), (4.0, 5e-3)):
        results = []
        for fn in (adamw_update, adamw_update_triton):
            args, fmts = _update_inputs(step, lr, device="cuda", formats=formats, master=master,
                                        param_dtype=dtype)  # fmt: skip
            param, grad, master_t, (m_q, _), (v_q, _), *_ = args
            assert triton_supports(fmts, param, grad, master_t)
            grad.view(-1)[:128] = 0.0  # with zero payloads: an all-zero block (scale 1)
            for q in (m_q, v_q):
                q[0].view(torch.uint8).zero_()
            if step == 4.0:
                grad[20, 30] = float("nan")
            m, v = fn(*args, formats=fmts, block_size=128)
            results.append((param, master_t, *m, *v))
        for a, b in zip(*results, strict=True):
            assert (a is None and b is None) or (a.dtype == b.dtype and bits_equal(a, b)), step
        assert results[0][2][0].float().abs().amax() == 0 and results[0][3][0] == 1.0  # zero block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: "-".join(map(str, c[:3])))
def test_cuda_triton_and_compiled_steps_are_bit_identical(config):
    """Whole optimizer steps, Triton kernel (auto) against the compiled function (inductor):
    the same parameters, states and generator states after 5 steps."""
    from minifloat.optim.fused_triton import adamw_update_triton

    runs = []
    for kernel in ("auto", "inductor"):
        params = [p.detach().cuda().requires_grad_() for p in _params(config[3])]
        opt = _make(params, config, True, kernel)
        _run(opt, params, range(5), device="cuda")
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    _assert_same_state(a, b, pa, pb)
    state = a.state[pa[0]]
    formats = (get_state_format(config[0]), get_state_format(config[1]))
    chosen = select_update(pa[0], pa[0].grad, state.get("master"), formats)
    assert chosen is adamw_update_triton


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fused_step_does_not_synchronize():
    """The step launches without waiting for the GPU (no pageable copies, no .item()): under
    torch's sync debug mode a synchronizing call raises."""
    params = [p.detach().cuda().requires_grad_() for p in _params(torch.float32)]
    opt = _make(params, CONFIGS[0], True)
    _run(opt, params, range(1), device="cuda")  # states made, kernels compiled
    for p in params:
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", CONFIGS[:4], ids=lambda c: "-".join(map(str, c[:3])))
def test_cuda_fused_step_tracks_unfused(config):
    """The unfused CUDA path runs foreach kernels whose FMA placement differs from the CPU
    kernels the fused function mirrors, so on CUDA the two agree closely, not bitwise: each
    weight's change over 5 steps within 60 dB (ulp-level differences are ~140 dB)."""
    from minifloat.sqnr import sqnr_db

    moved = []
    for fused in (True, False):
        params = [p.detach().cuda().requires_grad_() for p in _params(config[3])]
        opt = _make(params, config, fused)
        for step in range(5):
            gen = torch.Generator().manual_seed(1000 + step)
            for p in params:
                g = torch.randn(p.shape, generator=gen) * torch.exp(
                    torch.randn(p.shape, generator=gen)
                )
                p.grad = g.to(p.dtype).cuda()
            opt.step()
        moved.append(
            [(p.float().cpu() - s.float()) for p, s in zip(params, _params(config[3]), strict=True)]
        )
    for a, b in zip(*moved, strict=True):
        assert sqnr_db(b, a) >= 60


def test_step_time_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/optim_states.py --step-time: fused and unfused timed, JSON written."""
    import json

    from scripts import load_benchmark

    module = load_benchmark("optim_states")
    threads = torch.get_num_threads()
    module.main(["--step-time", "--device", "cpu", "--model", "tiny", "--layers", "1",
                 "--dim", "64", "--presets", "fp32,fp8-fp16", "--fused", "--unfused",
                 "--fused-inductor",
                 "--warmup", "1", "--repeats", "2", "--out", str(tmp_path),
                 "--inductor", "realize_reads_threshold=8", "--tag", "reads8"])  # fmt: skip
    # it times on one thread and gives the process its thread count back: later tests in this
    # process (the trainer's in-process reference runs) must not inherit it
    assert torch.get_num_threads() == threads
    (js,) = tmp_path.glob("optim_step_reads8_*.json")
    records = json.loads(js.read_text())
    assert [(r["preset"], r["path"]) for r in records] == [
        ("fp32", "foreach"), ("fp8-fp16", "fused"), ("fp8-fp16", "fused-inductor"),
        ("fp8-fp16", "unfused"),
    ]  # fmt: skip
    assert all(r["step_ms"] > 0 and r["params"] > 0 for r in records)
    assert "| fp8-fp16 | fused |" in js.with_suffix(".md").read_text()
    assert all(r["inductor"] == ["realize_reads_threshold=8"] for r in records)
    assert module.inductor_options(["realize_reads_threshold=8", "triton.cudagraphs=False"]) == {
        "realize_reads_threshold": 8, "triton.cudagraphs": False
    }  # fmt: skip
    with pytest.raises(SystemExit, match="no inductor config named"):
        module.inductor_options(["no_such_knob=1"])
