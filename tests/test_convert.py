"""convert(): which layers are swapped, reports, state_dicts, and a short training run."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from minifloat.convert import (
    REPORT_ATTR,
    AlreadyConvertedError,
    ConversionReport,
    check_recipe,
    convert,
    is_output_head,
    set_recipe,
)
from minifloat.linear import QuantLinear
from minifloat.models.llama import Llama, LlamaConfig
from minifloat.sqnr import sqnr_db
from tolerances import TINY_OCC_LAYERS_IMPROVED, TINY_OCC_MEAN_GAIN_DB

TINY = LlamaConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=64, max_seq_len=32)
TRAIN = LlamaConfig(dim=128, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=64, max_seq_len=32)
BLOCK_LINEARS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def tiny_llama(config: LlamaConfig = TINY, seed: int = 0) -> Llama:
    model = Llama(config)
    model.init_weights(seed)
    return model


def test_swaps_the_right_layers_of_llama():
    model = tiny_llama()
    params_before = {n: p for n, p in model.named_parameters()}
    returned, report = convert(model, "fp4", return_report=True)
    assert returned is model and model.minifloat_report is report
    expected = [f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert sorted(report.converted) == sorted(expected)
    assert dict(report.skipped) == {
        "tok_embeddings": "embedding (kept in high precision)",
        "output": "output head (kept in high precision)",
    }
    for name in expected:
        assert isinstance(model.get_submodule(name), QuantLinear)
    assert type(model.output) is nn.Linear
    # parameters are the same objects: an optimizer built before convert() stays valid
    assert all(p is params_before[n] for n, p in model.named_parameters())
    text = str(report)
    assert "fp4" in text and "14 linear layers converted" in text and "output head" in text


@pytest.mark.parametrize("recipe", ["fp4", "fp8-delayed"])
def test_converted_state_dict_loads_into_original(recipe):
    model = tiny_llama()
    converted = copy.deepcopy(model)
    assert convert(converted, recipe) is converted
    state = converted.state_dict()
    # fp8-delayed's amax history is training state of the quantized layers (it resumes with the
    # run); a plain model has no place for it. Everything else keeps nn.Linear's keys.
    history = [k for k in state if k.endswith(".amax_history")]
    assert bool(history) == (recipe == "fp8-delayed")
    assert [k for k in state if k not in history] == list(model.state_dict())
    fresh = Llama(TINY)
    fresh.load_state_dict({k: v for k, v in state.items() if k not in history}, strict=True)
    for (n, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    converted.load_state_dict(model.state_dict(), strict=True)  # and the other way round


def test_bf16_preserves_outputs_and_fp8_stays_close():
    model = tiny_llama()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        bf16 = copy.deepcopy(model)
        with pytest.warns(UserWarning, match="does not quantize linear layers"):
            bf16, report = convert(bf16, "bf16", return_report=True)
        assert report.converted == []
        assert all("autocast only" in r for n, r in report.skipped if "layers" in n)
        assert torch.equal(bf16(tokens), ref)
        fp8 = copy.deepcopy(model)
        convert(fp8, "fp8-rowwise")
        err = (fp8(tokens) - ref).norm() / ref.norm()
    assert 0 < err.item() < 0.05  # E4M3 operands (2^-4 relative rounding): measured 1.9%


def test_unsuitable_dims_are_reported():
    model = nn.Sequential(nn.Linear(64, 60), nn.ReLU(), nn.Linear(60, 32), nn.Linear(32, 128))
    report = convert(model, "fp8-tensorwise").minifloat_report
    assert report.converted == ["3"]
    reasons = dict(report.skipped)
    assert reasons["0"].startswith("out_features=60 is not a multiple of 16")
    assert reasons["2"].startswith("in_features=60 is not a multiple of 16")
    # blockwise needs 128: the tiny llama's attention (64) is skipped with the reason
    with pytest.warns(UserWarning, match="multiples? of 128"):
        _, block = convert(tiny_llama(), "fp8-blockwise", return_report=True)
    assert block.converted == []
    assert all(" of 128 (needed by" in r for n, r in block.skipped if n.startswith("layers"))


def test_skip_patterns():
    model = tiny_llama()
    report = convert(model, "fp4", skip="layers.0.*").minifloat_report
    assert all(n.startswith("layers.1.") for n in report.converted)
    assert ("layers.0.attention.wq", "matched skip pattern 'layers.0.*'") in report.skipped
    report = convert(tiny_llama(), "fp4", skip=["*.wq", "*.w2"]).minifloat_report
    assert "layers.1.attention.wk" in report.converted
    assert dict(report.skipped)["layers.1.feed_forward.w2"] == "matched skip pattern '*.w2'"
    model = tiny_llama()
    report = convert(model, "fp4", keep_head=False).minifloat_report
    assert "output" in report.converted and isinstance(model.output, QuantLinear)


def test_module_filter_fn_true_means_convert():
    # torchao's contract: (module, fqn) -> bool, True = convert
    model = tiny_llama()
    seen = []

    def only_attention(module: nn.Module, fqn: str) -> bool:
        seen.append((type(module), fqn))
        return ".attention." in fqn

    report = convert(model, "fp4", module_filter_fn=only_attention).minifloat_report
    assert sorted(report.converted) == sorted(
        f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")
    )
    assert dict(report.skipped)["layers.0.feed_forward.w1"] == "module_filter_fn returned False"
    assert isinstance(model.layers[0].attention.wq, QuantLinear)
    assert type(model.layers[0].feed_forward.w1) is nn.Linear
    # called with the module first, only for layers the built-in rules would convert
    assert (nn.Linear, "layers.0.attention.wq") in seen and all(f != "output" for _, f in seen)


def test_skip_pattern_that_matches_no_layer_warns():
    """A typo ("layer.0.*" for "layers.0.*") would quantize the layers it meant to keep."""
    with pytest.warns(UserWarning, match=r"skip pattern\(s\) \['layer.0.\*'\] matched no linear"):
        report = convert(tiny_llama(), "fp4", skip=["layer.0.*", "*.wq"]).minifloat_report
    assert "layers.0.attention.wk" in report.converted  # the typo kept nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(tiny_llama(), "fp4", skip=["layers.0.*", "output"])  # both match: no warning


def test_skip_callable_is_refused_not_inverted():
    # A torchao-style filter (True = convert) passed as `skip` used to keep exactly the layers it
    # meant to convert; now any callable there is refused, pointing at module_filter_fn.
    model = tiny_llama()
    with pytest.raises(TypeError, match=r"skip takes fnmatch patterns.*module_filter_fn"):
        convert(model, "fp4", skip=lambda module, fqn: True)
    with pytest.raises(TypeError, match="skip patterns must be strings"):
        convert(model, "fp4", skip=["layers.0.*", 3])
    with pytest.raises(TypeError, match="skip must be a pattern string or a list"):
        convert(model, "fp4", skip=3)
    with pytest.raises(TypeError, match="keep_head must be True or False, got 'no'"):
        convert(model, "fp4", keep_head="no")  # a non-empty string would have meant True
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert not hasattr(model, REPORT_ATTR)  # refused before marking: the model converts later
    assert convert(model, "fp4").minifloat_report.converted


def test_convert_takes_a_module():
    with pytest.raises(TypeError, match="convert takes an nn.Module, got OrderedDict"):
        convert(tiny_llama().state_dict(), "fp4")


def test_set_recipe_on_a_model_without_quantized_layers_warns():
    model = tiny_llama()
    with pytest.warns(UserWarning, match="changed nothing: the model holds no quantized layer"):
        assert set_recipe(model, "bf16") == []


def test_set_recipe_after_a_converting_recipe_that_swapped_nothing_says_what_to_do():
    model = tiny_llama()
    with pytest.warns(UserWarning, match="converted no layer"):
        convert(model, "bf16")
    with pytest.warns(UserWarning, match="converted with 'bf16', which swapped none: convert a"):
        assert set_recipe(model, "fp4") == []


@pytest.mark.parametrize(("first", "then"), [("fp4", "nvfp4"), ("nvfp4", "mxfp4")])
def test_set_recipe_refuses_another_keep_last_blocks(first, then):
    """fp4 -> nvfp4 quantized the last blocks nvfp4 keeps in bf16; nvfp4 -> mxfp4 left them in
    bf16: both silently unlike convert(model, then)."""
    model = Llama(dataclasses.replace(TINY, dim=128, ffn_dim=256, n_layers=4))
    convert(model, first)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=f"recipe {then} keeps the last .*converted with {first}"):
        set_recipe(model, then)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(m.recipe.name == first for m in model.modules() if isinstance(m, QuantLinear))
    set_recipe(model, "bf16")  # a recipe that quantizes nothing: always allowed


def test_module_filter_fn_must_return_bool():
    with pytest.raises(TypeError, match=r"must return a bool.*got None for 'layers.0"):
        convert(tiny_llama(), "fp4", module_filter_fn=lambda module, fqn: None)
    with pytest.raises(TypeError, match="module_filter_fn must be a callable"):
        convert(tiny_llama(), "fp4", module_filter_fn="layers.0.*")


def test_returns_model_with_report_attribute():
    model = tiny_llama()
    keys = list(model.state_dict())
    returned = convert(model, "fp8-rowwise")
    assert returned is model
    report = getattr(model, REPORT_ATTR)
    assert REPORT_ATTR == "minifloat_report" and isinstance(report, ConversionReport)
    assert report.recipe == "fp8-rowwise" and len(report.converted) == 14
    assert list(model.state_dict()) == keys  # the report is no parameter or buffer
    clone = copy.deepcopy(model)
    assert clone.minifloat_report == report and clone.minifloat_report is not report
    pair = convert(tiny_llama(), "fp4", return_report=True)
    assert isinstance(pair, tuple) and pair[1] is pair[0].minifloat_report


class _Tied(nn.Module):
    """An embedding and a tied output projection whose name is no head name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.hidden = nn.Linear(32, 32)
        self.unembed = nn.Linear(32, 64, bias=False)
        self.unembed.weight = self.embed.weight


def test_tied_head_found_by_identity():
    model = _Tied()
    report = convert(model, "fp4").minifloat_report
    assert report.converted == ["hidden"]
    reason = dict(report.skipped)["unembed"]
    assert reason == "output head, weight tied to embedding 'embed' (kept in high precision)"
    assert type(model.unembed) is nn.Linear
    # the name rule still holds for untied heads
    assert ("output", "output head (kept in high precision)") in convert(
        tiny_llama(), "fp4"
    ).minifloat_report.skipped
    untied = _Tied()
    untied.unembed.weight = nn.Parameter(untied.embed.weight.detach().clone())
    assert "unembed" in convert(untied, "fp4").minifloat_report.converted


class _Experts(nn.Module):
    """Fused expert weights [experts, out, in] and a router matrix, as plain parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(4, 32))
        self.w_experts = nn.Parameter(torch.randn(4, 64, 32))
        self.norm = nn.LayerNorm(32)  # 1-D parameters are no matrices: not reported
        self.proj = nn.Linear(32, 32)


def test_plain_matrix_parameters_are_reported():
    model = nn.Sequential(_Experts())
    report = convert(model, "fp8-tensorwise").minifloat_report
    assert report.converted == ["0.proj"]
    skipped = dict(report.skipped)
    assert set(skipped) == {"0.router", "0.w_experts"}
    assert skipped["0.w_experts"].startswith("3-D parameter [4, 64, 32] of _Experts (a stack of")
    assert "not in an nn.Linear or Conv1D layer" in skipped["0.router"]
    assert "0.w_experts" in str(report)


def test_warns_when_nothing_is_converted():
    with pytest.warns(UserWarning, match=r"converted no layer: the model has no nn.Linear"):
        convert(nn.Sequential(nn.Embedding(8, 16), nn.LayerNorm(16)), "fp4")
    with pytest.warns(UserWarning, match=r"all 3 linear layers were kept, e.g. '0': in_features"):
        convert(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)), "fp4")
    with pytest.warns(UserWarning, match=r"converted no layer: .*matched skip pattern"):
        convert(tiny_llama(), "fp4", skip="*")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(nn.Sequential(nn.Linear(16, 16)), "fp4")  # converts one: no warning


def test_converting_twice_raises():
    model = tiny_llama()
    convert(model, "fp4")
    with pytest.raises(AlreadyConvertedError, match="already converted"):
        convert(model, "fp8-rowwise")


@pytest.mark.parametrize("second", ["bf16", "fp4"])
def test_converting_twice_raises_when_nothing_was_swapped(second):
    # bf16 swaps nothing (autocast only); the mark still records the first conversion
    model = tiny_llama()
    keys = list(model.state_dict())
    with pytest.warns(UserWarning, match="converted no layer"):
        assert convert(model, "bf16").minifloat_report.converted == []
    with pytest.raises(AlreadyConvertedError, match="already converted with recipe 'bf16'"):
        convert(model, second)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    # the mark is no parameter or buffer, and a deepcopy of the converted model keeps it
    assert list(model.state_dict()) == keys
    with pytest.raises(AlreadyConvertedError, match="'bf16'"):
        convert(copy.deepcopy(model), second)
    # every layer skipped (skip pattern, unsuitable dims): marked as well
    skipped = tiny_llama()
    with pytest.warns(UserWarning, match="converted no layer"):
        assert convert(skipped, "fp8-rowwise", skip="*").minifloat_report.converted == []
    with pytest.raises(AlreadyConvertedError, match="'fp8-rowwise'"):
        convert(skipped, second)
    blockwise = tiny_llama()
    with pytest.warns(UserWarning, match="converted no layer"):  # dims: not multiples of 128
        assert convert(blockwise, "fp8-blockwise").minifloat_report.converted == []
    with pytest.raises(AlreadyConvertedError, match="'fp8-blockwise'"):
        convert(blockwise, second)
    # a fresh model converts normally, and its state_dict loads into the original architecture
    fresh = tiny_llama()
    assert convert(fresh, "fp4").minifloat_report.converted
    Llama(TINY).load_state_dict(fresh.state_dict(), strict=True)


def test_converting_a_model_with_a_converted_submodule_raises():
    model = tiny_llama()
    convert(model.layers[1], "fp8-rowwise")
    with pytest.raises(AlreadyConvertedError, match="submodule 'layers.1'.*'fp8-rowwise'"):
        convert(model, "fp4")
    other = tiny_llama()
    with pytest.warns(UserWarning, match="converted no layer"):
        convert(other.layers[0], "bf16")
    with pytest.raises(AlreadyConvertedError, match="submodule 'layers.0'.*'bf16'"):
        convert(other, "fp4")
    # QuantLinear layers put in by hand (no mark) are refused as before
    manual = tiny_llama()
    manual.layers[0].attention.wq = QuantLinear.from_linear(manual.layers[0].attention.wq, "fp4")
    with pytest.raises(AlreadyConvertedError, match=r"1 quantized layers.*wq.*'fp4'"):
        convert(manual, "fp8-rowwise")


@pytest.mark.parametrize("recipe", ["fp4", "fp8-rowwise", "bf16"])
def test_root_linear_is_refused(recipe):
    linear = nn.Linear(16, 16)
    keys = list(linear.state_dict())
    with pytest.raises(ValueError, match=r"cannot replace the root module.*from_linear"):
        convert(linear, recipe)
    assert list(linear.state_dict()) == keys == ["weight", "bias"]
    assert type(linear) is nn.Linear and not list(linear.children())
    # the suggested way works
    assert isinstance(QuantLinear.from_linear(linear, "fp4"), QuantLinear)


def test_report_type_and_unknown_recipe():
    model = nn.Sequential(nn.Linear(16, 16))
    assert isinstance(convert(model, "fp4").minifloat_report, ConversionReport)
    with pytest.raises(ValueError, match="unknown recipe"):
        convert(tiny_llama(), "fp5")


class _Block(nn.Module):
    """A transformer-ish block whose attention output projection is named `output`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.query = nn.Linear(dim, dim)
        self.attention.output = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, dim)  # a per-block "head" projection: no output head either


class _BlockModel(nn.Module):
    def __init__(self, dim: int = 32, vocab: int = 48) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim) for _ in range(2))
        self.output = nn.Linear(dim, vocab)


def test_output_heads_only_outside_repeated_blocks():
    model = _BlockModel()
    report = convert(model, "fp4").minifloat_report
    inner = [f"layers.{i}.{n}" for i in range(2) for n in ("attention.query", "attention.output")]
    assert sorted(report.converted) == sorted(inner + ["layers.0.head", "layers.1.head"])
    assert report.skipped == [("output", "output head (kept in high precision)")]
    assert isinstance(model.layers[0].attention.output, QuantLinear)
    assert type(model.output) is nn.Linear
    assert is_output_head("output") and is_output_head("lm_head") and is_output_head("model.head")
    assert not is_output_head("layers.0.attention.output") and not is_output_head("h.11.head")
    assert not is_output_head("layers.0.attention.wo")


# ---------------------------------------------------------------------------------------------
# A tiny model trained for a few dozen steps under fp4 and fp4-direct
# ---------------------------------------------------------------------------------------------


def _batches(n: int, batch: int = 8, seq: int = 32, vocab: int = 64):
    """A learnable synthetic language: each token is a fixed function of the two before it."""
    gen = torch.Generator().manual_seed(1)
    table = torch.randint(0, vocab, (vocab, vocab), generator=gen)
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        for i in range(2, seq + 1):
            t[:, i] = table[t[:, i - 2], t[:, i - 1]]
        yield t[:, :-1], t[:, 1:]


def _train(recipe: str, steps: int = 40) -> tuple[nn.Module, list[float]]:
    model = tiny_llama(TRAIN)
    convert(model, recipe, backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for inputs, targets in _batches(steps):
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _layer_output_sqnrs(model: nn.Module, recipe: str) -> torch.Tensor:
    """SQNR (dB) of what every converted layer computes under `recipe` against its float64
    product x·wᵀ, on one batch: the same weights and inputs for every recipe asked."""
    set_recipe(model, recipe)
    sqnrs: list[float] = []

    def hook(module, args, output):
        y_ref = nn.functional.linear(args[0].detach().double(), module.weight.detach().double())
        sqnrs.append(sqnr_db(y_ref, output.detach().double()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, QuantLinear)]
    with torch.no_grad():
        model(next(_batches(1))[0])
    for h in handles:
        h.remove()
    return torch.tensor(sqnrs)


@pytest.mark.slow
def test_tiny_model_trains_under_fp4_and_occ_improves_layer_output_sqnr():
    model, losses = _train("fp4")
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)  # measured a 1.9 drop; kernels move it by < 0.01
    sqnr_occ = _layer_output_sqnrs(model, "fp4")
    sqnr_direct = _layer_output_sqnrs(model, "fp4-direct")
    # The trained model's layers compute y closer to x·wᵀ with OCC (clamp at 0.99 + E4M3
    # compensation) than with the direct cast, on the same weights and inputs. The weights'
    # E2M1 error is the same in both and bounds y's SQNR near 20 dB; this tiny model's
    # activations are near-Gaussian but for a few layers, so the mean gain is small.
    assert (sqnr_occ > sqnr_direct).float().mean() >= TINY_OCC_LAYERS_IMPROVED, (
        sqnr_occ,
        sqnr_direct,
    )
    assert sqnr_occ.mean() > sqnr_direct.mean() + TINY_OCC_MEAN_GAIN_DB, (sqnr_occ, sqnr_direct)


def test_set_recipe_switches_the_converted_layers_in_place():
    """The final-phase switch: same modules and parameters; in bf16 the converted model computes
    exactly as the model never converted; a recipe a layer cannot take changes nothing."""
    plain = tiny_llama()
    model = convert(copy.deepcopy(plain), "fp4")
    params = list(model.parameters())
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert set_recipe(model, "bf16") == model.minifloat_report.converted
    assert all(p is q for p, q in zip(params, model.parameters(), strict=True))
    now = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(now) == len(layers) and all(a is b for a, b in zip(now, layers, strict=True))
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(tokens)
        logits.float().square().mean().backward()
        grads.append([logits] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cannot take recipe fp8-blockwise"):
        set_recipe(model, "fp8-blockwise")  # dims of 64: blockwise needs multiples of 128
    assert all(m.recipe.name == "bf16" for m in layers)
    check_recipe(model, "fp8-tensorwise")  # fits: no error, no change
    assert all(m.recipe.name == "bf16" for m in layers)
    set_recipe(model, "fp8-tensorwise")
    assert all(m.recipe.name == "fp8-tensorwise" for m in layers)


def test_a_layer_used_twice_is_converted_in_both_places():
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    convert(model, "fp4")
    assert isinstance(model[0], QuantLinear) and model[2] is model[0]
    assert model.minifloat_report.converted == ["0", "2"]
    assert model[0].weight is shared.weight  # one parameter, as before


@pytest.mark.parametrize("fn", [set_recipe, check_recipe])
def test_set_recipe_takes_a_module(fn):
    with pytest.raises(TypeError, match="expected an nn.Module, got str"):
        fn("model", "fp4")


def test_is_output_head_takes_a_name():
    with pytest.raises(TypeError, match="is_output_head takes a module name"):
        is_output_head(None)


def test_return_report_must_be_a_bool():
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(TypeError, match="return_report must be True or False"):
        convert(model, "fp4", return_report="yes")
    assert isinstance(model[0], nn.Linear) and not isinstance(model[0], QuantLinear)
