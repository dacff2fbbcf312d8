"""Tests for minifloat.train.export and `minifloat export`: a trained run as a HF LLaMA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from minifloat.models import Llama, get_config
from minifloat.train.checkpoint import CheckpointError, load_checkpoint
from minifloat.train.cli import main
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.export import export_run

SMALL = ["dim=32", "n_layers=2", "n_heads=2", "ffn_dim=64"]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step fp4 run (quantized layers: the export must hold their high-precision weights)
    with a small BPE tokenizer."""
    root = tmp_path_factory.mktemp("export")
    overrides = [arg for kv in SMALL for arg in ("--model-override", kv)]
    status = main(["train", "--recipe", "fp4", "--model", "tiny", *overrides, "--steps", "3",
                   "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
                   "--data-max-bytes", "60000", "--eval-batches", "0", "--device", "cpu",
                   "--cache-dir", str(root / "cache"), "--out", str(root / "run"),
                   "--quiet"])  # fmt: skip
    assert status == 0
    return root / "run"


def _our_model(run: Path) -> Llama:
    """The trained model, rebuilt here from the checkpoint independently of run_export."""
    state = load_checkpoint(run / "checkpoint.pt")["model"]
    vocab = state["tok_embeddings.weight"].shape[0]
    model = Llama(get_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=64, vocab_size=vocab))
    model.load_state_dict(state)
    return model.eval()


def test_export_command_writes_the_trained_weights(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from safetensors.torch import load_file

    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "(fp4 tiny, step 3)" in out and "model.safetensors" in out
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    assert config["max_position_embeddings"] == 256  # the trainer's rule: the preset's length
    tensors = load_file(str(tmp_path / "hf/model.safetensors"))
    ours = _our_model(run_dir).state_dict()
    down = ours["layers.1.feed_forward.w2.weight"]
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"], down)
    assert torch.equal(tensors["lm_head.weight"], ours["output.weight"])
    assert not (tmp_path / "hf/tokenizer.json").exists()  # only with --with-tokenizer


def test_export_refuses_destinations_that_would_mix_or_lose_files(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    hf = tmp_path / "hf"
    assert main(["export", str(run_dir), "--out", str(hf)]) == 0
    with pytest.raises(ValueError, match="is not empty; .* overwrite"):
        export_run(run_dir, hf)  # a second export over the first one
    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(hf)]) != 0
    assert "is not empty" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--out", str(hf), "--overwrite"]) == 0
    with pytest.raises(ValueError, match="is the run directory itself"):
        export_run(run_dir, run_dir, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        export_run(run_dir, tmp_path / "file")


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (logits check)")
def test_exported_run_gives_the_same_logits_in_transformers(run_dir: Path, tmp_path: Path) -> None:
    import transformers

    exported = export_run(run_dir, tmp_path / "hf", with_tokenizer=True)
    assert {p.name for p in exported.files} >= {"model.safetensors", "tokenizer.json"}
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("def export(run):\n    return run\n")["input_ids"]
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = _our_model(run_dir)(tokens)
        got = hf.eval()(tokens).logits
    # Two implementations of one fp32 forward (their op order may differ): ~1e-6 on logits of a
    # few units (measured 0 today); a wrong weight layout moves them by ~0.1.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_export_of_a_bad_run_dir_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        export_run(tmp_path / "missing", tmp_path / "hf")
    (tmp_path / "run.dcp" / "checkpoint.dcp").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="holds a sharded checkpoint"):
        export_run(tmp_path / "run.dcp", tmp_path / "hf")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn/checkpoint.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"not a valid minifloat checkpoint \("):
        export_run(tmp_path / "torn", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_with_tokenizer_on_a_byte_run_is_refused(tmp_path: Path) -> None:
    overrides = [arg for kv in SMALL for arg in ("--model-override", kv)]
    status = main(["train", "--model", "tiny", *overrides, "--steps", "1", "--tokenizer", "byte",
                   "--batch-size", "2", "--seq-len", "32", "--data-max-bytes", "60000",
                   "--eval-batches", "0", "--device", "cpu", "--cache-dir", str(tmp_path / "c"),
                   "--out", str(tmp_path / "run"), "--quiet"])  # fmt: skip
    assert status == 0
    with pytest.raises(ValueError, match="byte tokenizer"):
        export_run(tmp_path / "run", tmp_path / "hf", with_tokenizer=True)
    assert not (tmp_path / "hf").exists()


def test_export_falls_back_when_the_newest_checkpoint_is_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = [arg for kv in SMALL for arg in ("--model-override", kv)]
    status = main(["train", "--model", "tiny", *overrides, "--steps", "4", "--ckpt-every", "2",
                   "--tokenizer", "byte", "--batch-size", "2", "--seq-len", "32",
                   "--data-max-bytes", "60000", "--eval-batches", "0", "--device", "cpu",
                   "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "run"),
                   "--quiet"])  # fmt: skip
    assert status == 0
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"\0" * 64)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert "step 2)" in out  # checkpoint.1.pt holds step 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"minifloat: warning: exporting {tmp_path / 'run' / 'checkpoint.1.pt'}")


def test_export_of_a_run_switched_to_fp8_delayed(tmp_path: Path, dataset) -> None:
    """A run that ends in fp8-delayed (here after a final-phase switch) holds amax histories in
    its checkpoint; the exported model is the weights alone."""
    from minifloat.train import TrainConfig, train

    config = TrainConfig(recipe="fp8-tensorwise", switch_recipe="fp8-delayed", switch_at=0.5,
                         model="tiny", model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2,
                         "ffn_dim": 64}, steps=2, batch_size=2, seq_len=32, eval_batches=0,
                         out_dir=str(tmp_path / "run"), device="cpu")  # fmt: skip
    train(config, dataset=dataset, progress=False)
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"]
    assert any(k.endswith(".amax_history") for k in state)
    exported = export_run(tmp_path / "run", tmp_path / "hf")
    assert exported.step == 2 and exported.recipe == "fp8-tensorwise"


def test_export_of_a_run_whose_recipe_draws_random_numbers(tmp_path: Path, dataset) -> None:
    """mxfp4's layers keep a counter-based random state (`rng_state`) in the checkpoint: training
    state, which the exported model leaves out as it does amax histories."""
    from minifloat.train import TrainConfig, train

    config = TrainConfig(recipe="mxfp4", model="tiny", model_overrides={"dim": 32, "n_layers": 1,
                         "n_heads": 2, "ffn_dim": 64}, steps=2, batch_size=2, seq_len=32,
                         eval_batches=0, out_dir=str(tmp_path / "run"), device="cpu")  # fmt: skip
    train(config, dataset=dataset, progress=False)
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"]
    assert any(k.endswith(".rng_state") for k in state)
    exported = export_run(tmp_path / "run", tmp_path / "hf")
    assert exported.step == 2 and exported.recipe == "mxfp4"


def test_a_run_stored_before_block_became_the_default_scope(run_dir: Path, tmp_path: Path) -> None:
    """Before session 57 every run stored compile_scope "model" (then the default), compiled
    or not; a config now refuses a scope without compile. Such a run still resumes and exports."""
    import shutil

    from minifloat.train.checkpoint import read_checkpoint_header, save_checkpoint
    from minifloat.train.cli import _train_config, build_parser

    old = tmp_path / "run"
    shutil.copytree(run_dir, old)
    header = read_checkpoint_header(old / "checkpoint.pt")
    state = load_checkpoint(old / "checkpoint.pt")
    assert state["config"]["compile"] is False and state["config"]["compile_scope"] is None
    state["config"] = {**state["config"], "compile_scope": "model"}
    save_checkpoint(old / "checkpoint.pt", state, fields=header["fields"])
    with pytest.raises(ConfigError, match="compile-scope model needs compile"):
        TrainConfig.from_dict(state["config"])
    config = _train_config(build_parser().parse_args(["train", "--out", str(old), "--resume"]))
    assert config.compile_scope is None and config.compiled_scope is None
    assert export_run(old, tmp_path / "hf").step == 3
