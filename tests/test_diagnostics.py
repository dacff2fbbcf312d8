"""Per-layer quantization SQNR (minifloat.diagnostics): values, isolation, trainer integration."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minifloat import occ, recipes
from minifloat.convert import convert, set_recipe
from minifloat.diagnostics import OPERANDS, measure_layer_sqnr, summarize
from minifloat.quantize import fake_quantize, quantize
from minifloat.sqnr import sqnr_db
from minifloat.train.config import TrainConfig
from minifloat.train.trainer import train
from tolerances import DIAGNOSTICS_SQNR_ABS_TOL_DB

VOCAB = 64


class TinyLM(nn.Module):
    """Embedding -> two quantizable linears -> high-precision head (kept by convert)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.gelu(self.fc1(self.emb(tokens)))))


def _model(recipe: str) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():  # heavy-tailed inputs, so OCC clamps something
        model.emb.weight.mul_(torch.rand(VOCAB, 1) * 8)
    report = convert(model, recipe).minifloat_report
    assert report.converted == ["fc1", "fc2"]
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4, 25), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _reference_tensors(model: TinyLM, recipe: recipes.Recipe) -> dict[str, dict]:
    """x, y (forward) and dy (plain backward with retain_grad) of each layer, on a copy."""
    model = copy.deepcopy(model)
    seen: dict[str, dict] = {}

    def hook(name):
        def fn(_module, args, out):
            out.retain_grad()
            seen[name] = {"x": args[0].detach(), "y": out}

        return fn

    for name in ("fc1", "fc2"):
        getattr(model, name).register_forward_hook(hook(name))
    inputs, targets = _batch()
    with torch.autocast("cpu", dtype=recipe.autocast_dtype):
        logits = model(inputs)
    F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    for name, t in seen.items():  # as the layer sees them: [tokens, features]
        t["x"] = t["x"].reshape(-1, t["x"].shape[-1])
        t["dy"] = t["y"].grad.reshape(-1, t["y"].shape[-1])
        t["y"] = t["y"].detach().reshape(t["dy"].shape)
        t["w"] = getattr(model, name).weight.detach()
        t["b"] = getattr(model, name).bias
    return seen


def _expected_fp4(t: dict, cfg: recipes.OCCConfig) -> dict[str, float]:
    """The fp4 recipe by hand: OCC-compensated E2M1 input, E2M1 weight, E5M2 gradients with the
    fprop row scales folded in (dgrad: per weight channel; wgrad: per token)."""
    x, w, dy = t["x"].float(), t["w"], t["dy"].float()
    lo, hi = occ.thresholds(x, cfg)
    s_x = quantize(occ.clamp(x, lo, hi), "e2m1", "row").scale  # [M, 1]
    s_w = quantize(w, "e2m1", "row").scale.t()  # [1, N]
    bias = None if t["b"] is None else t["b"].detach()
    return {
        "input": sqnr_db(x, occ.occ_activation(x, "e2m1", "row", cfg)),
        "weight": sqnr_db(w, fake_quantize(w, "e2m1", "row")),
        "grad_output": sqnr_db(dy, fake_quantize(dy * s_w, "e5m2", "row") / s_w),
        "grad_output_t": sqnr_db(dy, fake_quantize((dy * s_x).t(), "e5m2", "row").t() / s_x),
        "output": sqnr_db(F.linear(x, w, bias), t["y"]),
    }


def _expected_fp8_tensorwise(t: dict) -> dict[str, float]:
    x, w, dy = t["x"].float(), t["w"], t["dy"].float()
    bias = None if t["b"] is None else t["b"].detach()
    g = sqnr_db(dy, fake_quantize(dy, "e5m2", "tensor"))
    return {
        "input": sqnr_db(x, fake_quantize(x, "e4m3", "tensor")),
        "weight": sqnr_db(w, fake_quantize(w, "e4m3", "tensor")),
        "grad_output": g,
        "grad_output_t": g,
        "output": sqnr_db(F.linear(x, w, bias), t["y"]),
    }


@pytest.mark.parametrize("name", ["fp4", "fp4:occ.alpha=0.9", "fp8-tensorwise"])
def test_sqnr_matches_an_independent_computation(name: str) -> None:
    recipe = recipes.get(name)
    model = _model(name)
    measured = measure_layer_sqnr(model, *_batch(), recipe=recipe)
    assert set(measured) == {"fc1", "fc2"}
    for layer, tensors in _reference_tensors(model, recipe).items():
        if name.startswith("fp4"):
            expected = _expected_fp4(tensors, recipe.occ)
        else:
            expected = _expected_fp8_tensorwise(tensors)
        assert set(measured[layer]) == set(OPERANDS)
        for operand in OPERANDS:
            assert measured[layer][operand] == pytest.approx(
                expected[operand], abs=DIAGNOSTICS_SQNR_ABS_TOL_DB
            ), (layer, operand)
    # FP4 loses far more than FP8 on every operand it quantizes to 4 bits.
    if name == "fp8-tensorwise":
        assert min(measured["fc1"][op] for op in ("input", "weight")) > 25
    else:
        assert max(measured["fc1"][op] for op in ("weight", "output")) < 25


def test_model_state_is_untouched() -> None:
    model = _model("fp8-delayed")
    inputs, targets = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(inputs)  # give the amax histories something to restore
    histories = [m.amax_history.clone() for m in (model.fc1, model.fc2)]
    params = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    first = measure_layer_sqnr(model, inputs, targets, recipe=recipes.get("fp8-delayed"))
    assert torch.equal(torch.get_rng_state(), rng)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    for before, layer in zip(histories, (model.fc1, model.fc2), strict=True):
        assert torch.equal(before, layer.amax_history)
    again = measure_layer_sqnr(model, inputs, targets, recipe=recipes.get("fp8-delayed"))
    assert again == first and first["fc1"]["grad_output"] is not None


def test_unquantized_model_and_summary() -> None:
    model = TinyLM()
    assert measure_layer_sqnr(model, *_batch(), recipe=recipes.get("bf16")) == {}
    model = _model("fp4")
    set_recipe(model, "bf16")  # a final phase in bf16: nothing quantized, nothing to measure
    assert measure_layer_sqnr(model, *_batch(), recipe=recipes.get("bf16")) == {}
    set_recipe(model, "fp4")
    assert set(measure_layer_sqnr(model, *_batch(), recipe=recipes.get("fp4"))) == {"fc1", "fc2"}
    layers = {"a": {"input": 10.0, "weight": 20.0}, "b": {"input": 4.0, "weight": None}}
    summary = summarize(layers)
    assert summary["input"] == {"mean_db": 7.0, "min_db": 4.0, "worst_layer": "b"}
    assert summary["weight"]["worst_layer"] == "a" and "output" not in summary


# ---- the trainer's --sqnr-every -------------------------------------------------------------


def _config(tmp_path: Path, **changes) -> TrainConfig:
    base = TrainConfig(
        model="tiny",
        model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
        steps=6,
        batch_size=2,
        seq_len=32,
        lr=3e-3,
        eval_every=3,
        eval_batches=1,
        log_every=2,
        save_checkpoints=False,
        device="cpu",
    )
    return dataclasses.replace(base, out_dir=str(tmp_path), **changes)


# fp4: OCC's sampled thresholds and DGE; fp8-delayed: amax histories the probe must not advance.
@pytest.mark.parametrize("recipe", ["fp4", "fp8-delayed"])
def test_training_is_identical_with_the_diagnostic(tmp_path: Path, dataset, recipe: str) -> None:
    plain = train(_config(tmp_path / "off", recipe=recipe), dataset=dataset, progress=False)
    probed = train(_config(tmp_path / "on", recipe=recipe, sqnr_every=4), dataset=dataset,
                   progress=False)  # fmt: skip
    assert probed.losses == plain.losses and probed.val_losses == plain.val_losses
    records = [json.loads(line) for line in probed.metrics_path.read_text().splitlines()]
    sqnr = [r for r in records if "layer_sqnr" in r]
    assert [r["step"] for r in sqnr] == [4, 6]  # every 4 steps and at the last step
    layers = sqnr[-1]["layer_sqnr"]
    assert set(layers) == {f"layers.0.{n}" for n in ("attention.wq", "attention.wk",
        "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
        "feed_forward.w3")}  # fmt: skip
    assert all(set(v) == set(OPERANDS) for v in layers.values())
    assert all("loss" in r for r in records if "layer_sqnr" not in r)


def test_recipe_by_name_and_conv1d_layers() -> None:
    """A recipe name failed with an AttributeError (every other API takes names); a model with
    GPT-2's QuantConv1D layers gave {} without a word. A QuantConv1D holding fc1's weight
    transposed ([in, out]) multiplies the same operands, so it measures exactly as fc1."""
    model = _model("fp4")
    by_name = measure_layer_sqnr(model, *_batch(), recipe="fp4")
    assert by_name == measure_layer_sqnr(model, *_batch(), recipe=recipes.get("fp4"))
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    from minifloat.conv1d import QuantConv1D

    conv = conv1d(nf=64, nx=32)  # fc1 is 32 -> 64
    with torch.no_grad():
        conv.weight.copy_(model.fc1.weight.t())
        conv.bias.copy_(model.fc1.bias)
    model.fc1 = QuantConv1D.from_conv1d(conv, "fp4")
    measured = measure_layer_sqnr(model, *_batch(), recipe="fp4")
    assert set(measured) == {"fc1", "fc2"} and set(measured["fc1"]) == set(OPERANDS)
    assert measured == by_name


def test_inference_mode_is_refused_in_one_line() -> None:
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside torch.inference_mode"):
        measure_layer_sqnr(_model("fp4"), *_batch(), recipe="fp4")
