"""Tests for the reference LLaMA-2 model: presets, shapes, causality, fp32 islands, RoPE."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from minifloat.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rope,
    get_config,
    rope_cos_sin,
)

# Published / hand-computed parameter counts (embedding + head included, untied).
EXPECTED_PARAMS = {
    "tiny": 2_901_120,
    "7B": 6_738_415_616,  # LLaMA-2 7B's well-known count
    "13B": 13_015_864_320,  # LLaMA-2 13B's well-known count
}

SMALL = LlamaConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=160, vocab_size=97, max_seq_len=32)


def _model(config: LlamaConfig = SMALL, seed: int = 0) -> Llama:
    model = Llama(config)
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_count_matches_meta_model(name):
    config = PRESETS[name]
    with torch.device("meta"):
        model = Llama(config)
    assert model.num_params() == config.num_params()
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    embedding = config.vocab_size * config.dim
    assert config.non_embedding_params() == config.num_params() - embedding
    if name in EXPECTED_PARAMS:
        assert config.num_params() == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes(name):
    config = PRESETS[name]
    with torch.device("meta"):
        model = Llama(config)
    block = model.layers[0]
    assert len(model.layers) == config.n_layers
    assert block.attention.wq.weight.shape == (config.dim, config.dim)
    assert block.attention.wk.weight.shape == (config.kv_heads * config.head_dim, config.dim)
    assert block.feed_forward.w1.weight.shape == (config.ffn_dim, config.dim)
    assert block.feed_forward.w2.weight.shape == (config.dim, config.ffn_dim)
    assert model.output.weight.shape == (config.vocab_size, config.dim)
    assert model.tok_embeddings.weight.shape == (config.vocab_size, config.dim)


def test_tiny_preset_is_cpu_sized():
    assert 1_000_000 <= PRESETS["tiny"].num_params() <= 3_000_000


# (dim, layers, heads, ffn): Meta's LLaMA-2 7B and 13B; 1.3B as in the FP4 paper and ANCHORS.md.
PAPER_SHAPES = {
    "1.3B": (2048, 24, 16, 5632),
    "7B": (4096, 32, 32, 11008),
    "13B": (5120, 40, 40, 13824),
}


@pytest.mark.parametrize("name", list(PAPER_SHAPES))
def test_paper_presets_use_llama2_shapes(name):
    config = PRESETS[name]
    assert (config.dim, config.n_layers, config.n_heads, config.ffn_dim) == PAPER_SHAPES[name]
    assert config.kv_heads == config.n_heads  # multi-head attention, no GQA at these sizes
    assert config.head_dim == 128 and config.vocab_size == 32000
    # LLaMA's FFN rule: 2/3 of 4*dim, rounded up to a multiple of 256.
    assert config.ffn_dim == 256 * math.ceil(8 * config.dim / 3 / 256)


# Each preset's name is its parameter count (embedding + untied head) at the vocabulary below,
# within NAME_TOLERANCE. 125M and up are named at LLaMA's 32,000 tokens; 20M at minifloat's
# default 8192. 50M is named at neither (34.1M at 8192, 58.5M at 32000) and is left out.
NAMED_AT_VOCAB = {"20M": 8192, "125M": 32000, "350M": 32000, "1.3B": 32000, "7B": 32000,
                  "13B": 32000}  # fmt: skip
NAME_TOLERANCE = 0.15


@pytest.mark.parametrize("name", list(NAMED_AT_VOCAB))
def test_preset_name_matches_parameter_count(name):
    with torch.device("meta"):  # allocates nothing, even for 13B
        model = Llama(get_config(name, vocab_size=NAMED_AT_VOCAB[name]))
    nominal = float(name[:-1]) * {"M": 1e6, "B": 1e9}[name[-1]]
    assert abs(model.num_params() / nominal - 1) <= NAME_TOLERANCE, model.num_params()


def test_get_config_overrides_and_errors():
    config = get_config("tiny", vocab_size=257, n_kv_heads=2)
    assert config.vocab_size == 257 and config.kv_heads == 2
    with pytest.raises(ValueError, match="tiny"):
        get_config("nope")
    with pytest.raises(ValueError, match="n_kv_heads"):
        get_config("tiny", n_kv_heads=3)


# override -> (exception type, message). Each used to fail later with a raw ZeroDivisionError,
# TypeError or IndexError, or to train NaNs; now construction says which field is wrong.
BAD_CONFIGS = {
    "n_heads=0": ({"n_heads": 0}, ValueError, "n_heads must be positive, got 0"),
    "n_kv_heads=0": ({"n_kv_heads": 0}, ValueError, "n_kv_heads must be positive, got 0"),
    "dim=1e3": ({"dim": 1e3}, TypeError, r"dim must be an int, got 1000.0 \(float\)"),
    "n_layers=2.0": ({"n_layers": 2.0}, TypeError, r"n_layers must be an int, got 2.0"),
    "ffn_dim='352'": ({"ffn_dim": "352"}, TypeError, r"ffn_dim must be an int, got '352'"),
    "vocab_size=True": ({"vocab_size": True}, TypeError, r"vocab_size must be an int, got True"),
    "max_seq_len=-1": ({"max_seq_len": -1}, ValueError, "max_seq_len must be positive, got -1"),
    "dim=130": ({"dim": 130}, ValueError, "dim=130 is not divisible by n_heads=4"),
    "odd head_dim": ({"dim": 12, "n_heads": 4}, ValueError, "head_dim=3 must be even for RoPE"),
    "n_kv_heads=3": ({"n_kv_heads": 3}, ValueError, "n_heads=4 not divisible by n_kv_heads=3"),
    "norm_eps=0": ({"norm_eps": 0}, ValueError, "norm_eps must be positive and finite, got 0"),
    "rope_theta=-1": ({"rope_theta": -1.0}, ValueError, "rope_theta must be positive and"),
    "rope_theta=nan": ({"rope_theta": math.nan}, ValueError, "rope_theta must be positive"),
    "norm_eps='1e-5'": ({"norm_eps": "1e-5"}, TypeError, "norm_eps must be a number, got '1e-5'"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_fields_raise_one_line_errors_naming_the_field(case):
    overrides, error, message = BAD_CONFIGS[case]
    with pytest.raises(error, match=message) as info:
        get_config("tiny", **overrides)
    assert "\n" not in str(info.value)


def test_good_configs_pass():
    config = get_config("tiny", rope_theta=5000, norm_eps=1e-6, n_kv_heads=None)
    assert config.rope_theta == 5000 and config.kv_heads == config.n_heads


def _cli_error(args: list[str], capsys: pytest.CaptureFixture) -> str:
    from minifloat.train.cli import main

    assert main(args) != 0
    err = capsys.readouterr().err  # progress lines (data work), then the error
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("minifloat: error: "), err
    assert sum(line.startswith("minifloat: error") for line in lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("n_heads=0", "n_heads must be positive, got 0"),
        # integral floats (dim=1e3, n_layers=2.0) are taken as integers, as --tokens 2e9 is
        ("dim=1.5", "dim must be an integer, got 1.5"),
        ("n_layers=2.5", "n_layers must be an integer, got 2.5"),
        ("rope_theta=-1", "rope_theta must be positive and finite, got -1"),
    ],
)
def test_bad_model_overrides_are_one_line_cli_errors(tmp_path, capsys, override, message):
    out = tmp_path / "run"
    args = ["train", "--model-override", override, "--out", str(out), "--device", "cpu"]
    assert message in _cli_error(args, capsys)
    assert not out.exists()  # refused before any data or run-directory work


def test_model_vocab_smaller_than_tokenizer_is_a_one_line_cli_error(tmp_path, capsys):
    # The byte tokenizer has 257 ids; a 200-row embedding used to fail with an IndexError.
    out = tmp_path / "run"
    args = ["train", "--model", "tiny", "--model-override", "vocab_size=200", "--data", "stdlib",
            "--tokenizer", "byte", "--data-max-bytes", "60000", "--cache-dir",
            str(tmp_path / "cache"), "--steps", "1", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "0", "--device", "cpu", "--out", str(out)]  # fmt: skip
    error = _cli_error(args, capsys)
    assert "vocab_size=200 is smaller than the tokenizer's vocabulary of 257 tokens" in error
    assert not out.exists()


def test_flops_per_token_formula():
    config = PRESETS["125M"]
    n = config.non_embedding_params()
    assert config.flops_per_token(2048) == 6 * n + 12 * 12 * 768 * 2048


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_shape_and_dtype(n_kv_heads, dtype):
    config = get_config("tiny", vocab_size=97, dim=64, n_kv_heads=n_kv_heads, max_seq_len=16)
    model = _model(config).to(dtype)
    tokens = torch.randint(0, 97, (3, 20))  # longer than max_seq_len: RoPE tables grow
    logits = model(tokens)
    assert logits.shape == (3, 20, 97)
    assert logits.dtype == dtype
    assert torch.isfinite(logits).all()


def test_causal_future_tokens_do_not_change_past_logits():
    model = _model()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 24))
    changed = tokens.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # Same shapes, so the same kernels and summation order: past logits (< 1) come out identical
    # (measured 0); 1e-6 is a few fp32 ulps, while a leak of the future moves them by > 1e-3.
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-6)
    assert (a[:, 15:] - b[:, 15:]).abs().max() > 1e-3


def test_init_weights_deterministic_and_scaled():
    a, b, c = _model(seed=5), _model(seed=5), _model(seed=6)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    std_out = a.layers[0].attention.wo.weight.std().item()
    std_in = a.layers[0].attention.wq.weight.std().item()
    # sample std of 4096 draws: standard error 1.1%, so rel=0.1 is ~9 standard errors
    assert std_in == pytest.approx(0.02, rel=0.1)
    assert std_out == pytest.approx(0.02 / math.sqrt(2 * SMALL.n_layers), rel=0.1)


def test_rope_buffers_not_in_state_dict():
    model = _model()
    model(torch.zeros(1, 4, dtype=torch.long))
    assert not any("rope" in key for key in model.state_dict())


def test_a_compiled_model_does_not_recompile_on_its_second_call():
    # init_weights builds the rope tables: built by the first forward instead, they changed the
    # buffers' rank between the first and second compiled calls, and step 2 recompiled.
    from torch._dynamo.utils import counters

    model = _model()  # init_weights included
    assert model.rope_cos.dim() == 2 and model.rope_cos.shape[0] == SMALL.max_seq_len
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        compiled(torch.zeros(1, 4, dtype=torch.long))
    assert counters["stats"]["unique_graphs"] == 1


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def test_compiled_gradients_reach_every_parameter(device, autocast):
    """The whole model compiled (inductor) against eager: every parameter's gradient is there
    and close. Under torch 2.11 (CPU and CUDA) RoPE's and SwiGLU's float32 Functions, whose
    forwards ended in a no-op `.to`, gave the compiled backward zeros (session 80)."""
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for compile_ in (False, True):
        torch._dynamo.reset()
        model = _model().to(device)
        run = torch.compile(model) if compile_ else model
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            logits = run(tokens.to(device))
        logits.float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    eager, compiled = grads
    # bf16 ops fused by inductor round differently from eager's (docs/hopper.md, "Exactness")
    tol = 0.02 if autocast else 1e-4  # CPU, torch 2.13: 5e-4 and 5e-7
    for name, want in eager.items():
        got = compiled[name]
        assert got is not None and got.abs().sum() > 0, name
        assert (got - want).norm() <= tol * want.norm(), name


class _LinearSubclass(nn.Linear):
    """Stands in for QuantLinear: a subclass with the same weight, doubling the output."""

    def forward(self, x):
        return super().forward(x) * 2


def test_works_with_linear_subclasses():
    model = _model()
    tokens = torch.randint(0, SMALL.vocab_size, (1, 8))
    reference = model(tokens)
    for block in model.layers:
        old = block.attention.wq
        new = _LinearSubclass(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        block.attention.wq = new
    model.init_weights(0)  # init must still find the swapped layers
    assert torch.equal(model.layers[0].attention.wq.weight, _model().layers[0].attention.wq.weight)
    assert not torch.allclose(model(tokens), reference)


def test_rmsnorm_reduces_in_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    norm = RMSNorm(1024)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 1024) * 30 + 3).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    x32 = x.float()
    reference = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)
    assert out.dtype == torch.float32  # fp32 weight times bf16 normalized input
    assert torch.equal(out, norm.weight * reference)
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert not torch.equal(naive, reference), "test cannot tell fp32 from bf16 reductions"


def test_rope_is_rotate_half_complex_rotation():
    head_dim, seq, theta = 8, 6, 10000.0
    x = torch.randn(1, 1, seq, head_dim, dtype=torch.float64).float()
    cos, sin = rope_cos_sin(seq, head_dim, theta)
    out = apply_rope(x, cos, sin)
    half = head_dim // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * freqs
    rotated = z * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    # fp32 cos/sin tables times N(0, 1) values: ~1e-7 absolute (measured 8e-8)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    head_dim = 16
    cos, sin = rope_cos_sin(32, head_dim, 10000.0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(m, n):
        qm = apply_rope(q.view(1, 1, 1, -1), cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k.view(1, 1, 1, -1), cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum().item()

    # 16-term fp32 dot products at other absolute positions: the fp32 angles differ by ~1e-6
    # relative (measured 8e-7 on scores ~4); a changed relative position moves them by ~0.3.
    assert score(7, 3) == pytest.approx(score(20, 16), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-4)


def test_rope_tables_are_fp32_after_bf16_cast():
    model = _model().to(torch.bfloat16)
    model(torch.zeros(1, 4, dtype=torch.long))
    assert model.rope_cos.dtype == torch.float32


@pytest.mark.parametrize("recipe", ["fp8-delayed", "nvfp4"])
def test_meta_build_then_init_weights_equals_an_eager_build(recipe):
    """Built on the meta device, converted, `to_empty` then `init_weights` (models.md's path):
    the converted layers' amax history and random state are initialized too, not left as the
    memory `to_empty` returned (which gave NaN logits under fp8-delayed)."""
    from minifloat.convert import convert

    config = get_config("tiny", n_layers=2, vocab_size=256)
    with torch.device("meta"):
        model = Llama(config)
    convert(model, recipe)
    model.to_empty(device="cpu")
    for buffer in model.buffers():  # what uninitialized memory could hold
        buffer.fill_(float("nan") if buffer.is_floating_point() else 12345)
    model.init_weights(0)
    eager = Llama(config)
    convert(eager, recipe)
    eager.init_weights(0)
    for (name, got), want in zip(model.named_buffers(), eager.buffers(), strict=True):
        if "rope" not in name:
            assert torch.equal(got, want), name
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(model(tokens), eager(tokens))


@pytest.mark.parametrize("bad", ["tiny", {"dim": 64}])
def test_llama_takes_a_config(bad):
    with pytest.raises(TypeError, match="Llama takes a LlamaConfig"):
        Llama(bad)


@pytest.mark.parametrize("seed", [-1, 1.5, True, 2**63])
def test_init_weights_refuses_seeds_it_cannot_use(seed):
    model = Llama(get_config("tiny", n_layers=1, vocab_size=64))
    with pytest.raises(ValueError, match="seed must be an int"):
        model.init_weights(seed)


@pytest.mark.parametrize("shape", [(1, 0), (0, 4)])
def test_forward_refuses_empty_token_batches(shape):
    model = Llama(get_config("tiny", n_layers=1, vocab_size=64))
    with pytest.raises(ValueError, match="at least one of each"):
        model(torch.zeros(shape, dtype=torch.long))
