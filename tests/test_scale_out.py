"""benchmarks/scale_out.py on CPU: two gloo ranks under torchrun, FSDP2, chunks resumed from
checkpoints, and the report built from what the runs recorded."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from minifloat.models.llama import Llama, get_config
from scripts import load_benchmark
from torchrun_ranks import run_torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scale_out.py"
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
# One layer of width 32, byte tokens, 8 steps of 2 x 32 tokens per rank: ~4 s of work per launch.
TINY = [
    "--model", "tiny", "--model-override", "dim=32", "--model-override", "n_layers=1",
    "--model-override", "n_heads=2", "--model-override", "ffn_dim=64",
    "--data", "stdlib", "--tokenizer", "byte", "--data-max-bytes", "200000", "--cache-dir",
    "cache", "--seq-len", "32", "--batch-size", "2", "--warmup-steps", "2", "--measure-steps",
    "6", "--no-compile", "--device", "cpu", "--eval-batches", "1", "--progress", "off",
]  # fmt: skip
REQUIRED_KEYS = ("model", "recipe", "gpus", "tokens_per_s_per_gpu", "mfu", "peak_mem_gib")


@pytest.fixture(scope="module")
def scale_out() -> ModuleType:
    return load_benchmark("scale_out")


def _torchrun(cwd: Path, *args: str) -> str:
    return run_torchrun([str(SCRIPT), "run", *TINY, *args], cwd=cwd, timeout=180).stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 and fp4 in two chunks of 4 steps, bf16 uninterrupted, torchao (if installed)."""
    root = tmp_path_factory.mktemp("scale_out")
    for recipe in ("bf16", "fp4"):
        for _ in range(2):
            _torchrun(root, "--recipe", recipe, "--chunk-steps", "4", "--runs", "chunked")
    _torchrun(root, "--recipe", "bf16", "--runs", "whole", "--no-checkpoint")
    if HAS_TORCHAO:
        _torchrun(root, "--recipe", "torchao-float8-tensorwise", "--runs", "chunked")
    return root


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "scale_out.jsonl").read_text().splitlines()]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_second_chunk_resumes_bit_exactly(runs: Path) -> None:
    """Two chunks of 4 steps give the losses of one 8-step run, bit for bit (FSDP2, gloo)."""
    chunked, whole = runs / "chunked" / "tiny_bf16", runs / "whole" / "tiny_bf16"
    records = _records(chunked)
    assert [r["event"] for r in records] == ["start", "end", "start", "end"]
    assert [r["start_step"] for r in records] == [0, 0, 4, 4]
    assert [r["end_step"] for r in records if r["event"] == "end"] == [4, 8]
    assert records[0]["gpus"] == 2 and "scale_out.py run" in records[0]["command"]
    assert (chunked / "DONE").is_file() and (whole / "DONE").is_file()
    assert not (whole / "checkpoint.pt").exists()  # --no-checkpoint
    split, full = _metrics(chunked), _metrics(whole)
    assert [r["step"] for r in split] == list(range(1, 9))
    assert [r["loss"] for r in split] == [r["loss"] for r in full]
    assert split[-1]["val_loss"] == full[-1]["val_loss"]


@pytest.mark.slow
def test_fp4_run_continues_across_chunks(runs: Path) -> None:
    run = runs / "chunked" / "tiny_fp4"
    starts = [r for r in _records(run) if r["event"] == "start"]
    assert [(r["start_step"], r["stop_step"]) for r in starts] == [(0, 4), (4, 8)]
    assert starts[0]["minifloat_recipe"] == "fp4"
    losses = [r["loss"] for r in _metrics(run)]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < math.log(257)  # below a uniform guess over the byte vocabulary


@pytest.mark.slow
def test_report_writes_markdown_json_and_curves(runs: Path, tmp_path: Path, scale_out) -> None:
    md, js, png = scale_out.write_report(runs / "chunked", tmp_path, rewarm=1, day="2026-01-02")
    assert md.name == "scale_out_cpu_2026-01-02.md" and png.stat().st_size > 10_000
    twin = json.loads(js.read_text())
    records = {r["recipe"]: r for r in twin["records"]}
    assert {"bf16", "fp4"} <= set(records)
    for record in records.values():
        assert all(key in record for key in REQUIRED_KEYS)
        assert record["model"] == "tiny" and record["gpus"] == 2 and record["complete"]
        assert record["tokens_per_s_per_gpu"] > 0
        assert record["mfu"] is None and record["peak_mem_gib"] is None  # CPU: no peak, no CUDA
        assert 0 < record["final_loss"] < math.log(257)
    # Steps 3..8 follow the 2 warm-up steps; step 5 is the first after the resume at step 4.
    assert records["bf16"]["steps_measured"] == 5 and records["bf16"]["chunks"] == 2
    assert len(twin["losses"]["tiny_bf16"]) == 8
    text = md.read_text()
    assert "| tiny | bf16 | 2 |" in text and "| tiny | fp4 | 2 |" in text
    assert "1.00x" in text and "--chunk-steps 4" in text


def test_timed_steps_skip_warmup_and_the_steps_after_each_resume(scale_out) -> None:
    steps = range(1, 21)
    timed = scale_out.timed_steps(steps, [0, 8, 14], warmup=3, rewarm=2)
    assert timed == [4, 5, 6, 7, 8, 11, 12, 13, 14, 17, 18, 19, 20]
    # A chunk killed before it logged anything changes nothing: its steps are attributed to
    # the chunk that repeated them.
    assert scale_out.timed_steps(steps, [0, 8, 8, 14], warmup=3, rewarm=2) == timed


def test_chunk_start_reads_markers_and_fresh_discards_them(scale_out, tmp_path: Path) -> None:
    (tmp_path / "DONE").write_text("8\n")
    assert scale_out._chunk_start(tmp_path, fresh=False) is None
    (tmp_path / "scale_out.jsonl").write_text("{}\n")
    assert scale_out._chunk_start(tmp_path, fresh=True) == 0
    assert not any(tmp_path.iterdir())
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="--fresh"):
        scale_out._chunk_start(tmp_path, fresh=False)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--recipe", "bf16", "--no-checkpoint", "--chunk-steps", "4"], "needs --chunk-steps 0"),
        (["--recipe", "fp3"], "unknown recipe"),
        (["--recipe", "torchao-float8-tensorwise", "--quantized-all-gather"],
         "does not apply to torchao-float8-tensorwise"),
        (["--recipe", "bf16", "--quantized-all-gather"], "needs a quantized recipe"),
        (["--recipe", "fp4", "--quantized-all-gather"], "OCC"),
    ],
)  # fmt: skip
def test_run_rejects_bad_arguments(scale_out, capsys, extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        scale_out.main(["run", *TINY, *extra])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and message in err.splitlines()[-1]  # one line says why


# ---- quantized weight all-gather ---------------------------------------------------------------

QAG_RECIPE = "fp8-tensorwise"  # E4M3, one tensor scale (all-reduced, not all-gathered)


@pytest.fixture(scope="module")
def qag_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fp8-tensorwise with the plain and with the quantized all-gather, 3 steps each."""
    root = tmp_path_factory.mktemp("scale_out_qag")
    short = ["--warmup-steps", "1", "--measure-steps", "2", "--no-checkpoint", "--runs", "qag"]
    _torchrun(root, "--recipe", QAG_RECIPE, *short)
    _torchrun(root, "--recipe", QAG_RECIPE, "--quantized-all-gather", *short)
    return root / "qag"


def _param_counts(vocab_size: int) -> tuple[int, int, int]:
    """(parameters in the blocks, of them in the blocks' linear weights, outside the blocks)
    of the TINY model, counted on a plain Llama."""
    model = Llama(get_config("tiny", dim=32, n_layers=1, n_heads=2, ffn_dim=64,
                             vocab_size=vocab_size))  # fmt: skip
    in_blocks = sum(p.numel() for p in model.layers.parameters())
    linear = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, nn.Linear))
    return in_blocks, linear, sum(p.numel() for p in model.parameters()) - in_blocks


@pytest.mark.slow
def test_quantized_all_gather_run_records_fewer_bytes(qag_runs: Path) -> None:
    plain = _records(qag_runs / f"tiny_{QAG_RECIPE}")
    qag = _records(qag_runs / f"tiny_{QAG_RECIPE}+qag")
    assert [r["quantized_allgather"] for r in (plain[0], qag[0])] == [False, True]
    assert plain[0]["recipe"] == qag[0]["recipe"] == QAG_RECIPE
    in_blocks, linear, root = _param_counts(plain[0]["vocab_size"])
    # fp32 all-gathers: the blocks twice (forward, backward re-gather), the root once.
    assert plain[-1]["allgather_bytes_per_step"] == 4 * (2 * in_blocks + root)
    # FP8: 1 byte instead of 4 per linear weight parameter, in both gathers of a block; the
    # tensor scale does not travel, so at most a 4-byte scale per weight row comes on top.
    fp8 = 4 * (2 * in_blocks + root) - 2 * 3 * linear
    sent = qag[-1]["allgather_bytes_per_step"]
    assert fp8 <= sent <= fp8 + 2 * 4 * linear // 32  # rows of >= 32 parameters here
    assert 0.3 < sent / plain[-1]["allgather_bytes_per_step"] < 0.75
    model_bytes = qag[-1]["allgather_model_bytes"]
    assert model_bytes["fp32"] == 4 * linear and model_bytes["quantized"] < model_bytes["fp32"]
    assert plain[-1]["allgather_model_bytes"]["quantized"] == 4 * linear
    # The quantized all-gather sends what the GEMMs would have quantized anyway: same losses.
    losses = [[r["loss"] for r in _metrics(run)] for run in qag_runs.iterdir()]
    assert losses[0] == losses[1] and len(losses[0]) == 3


@pytest.mark.slow
def test_report_shows_quantized_all_gather_columns(qag_runs: Path, tmp_path: Path,
                                                   scale_out) -> None:  # fmt: skip
    md, js, _ = scale_out.write_report(qag_runs, tmp_path, rewarm=1, day="2026-01-03")
    records = json.loads(js.read_text())["records"]
    assert [r["quantized_allgather"] for r in records] == [False, True]  # plain run first
    plain, qag = records
    ratio = qag["allgather_bytes_per_step"] / plain["allgather_bytes_per_step"]
    assert qag["qag_allgather_bytes_vs_plain"] == pytest.approx(ratio)
    speed = qag["tokens_per_s_per_gpu"] / plain["tokens_per_s_per_gpu"]
    assert qag["qag_tokens_per_s_vs_plain"] == pytest.approx(speed)
    assert plain["qag_tokens_per_s_vs_plain"] is None
    lines = md.read_text().splitlines()
    header = next(line for line in lines if line.startswith("| model |"))
    assert "| QAG | QAG vs plain |" in header and "| all-gather MB/step |" in header
    rows = [line for line in lines if line.startswith(f"| tiny | {QAG_RECIPE} | 2 |")]
    assert len(rows) == 2 and "| no |" in rows[0] and "| yes |" in rows[1]
    assert f"| {speed:.2f}x |" in rows[1]
    assert f"| {plain['allgather_bytes_per_step'] / 1e6:,.1f} |" in rows[0]


def test_allgather_bytes_count_micro_batches_and_the_backward_regather(scale_out) -> None:
    model = _small_model(ffn_dim=64)
    in_blocks = sum(p.numel() for p in model.layers.parameters())
    root = sum(p.numel() for p in model.parameters()) - in_blocks
    per_step, whole = scale_out.allgather_bytes_per_step(
        model, list(model.layers), 2, micro_batches=3
    )
    assert per_step == 3 * 4 * (2 * in_blocks + root)
    assert whole["quantized"] == 0 and whole["other"] == 4 * (in_blocks + root)  # no QuantLinear


def test_trainer_fsdp_reshards_after_forward(scale_out) -> None:
    """The per-step count assumes apply_fsdp's default, which the trainer does not override."""
    from minifloat.distributed import apply_fsdp

    default = inspect.signature(apply_fsdp).parameters["reshard_after_forward"].default
    assert default is scale_out.RESHARD_AFTER_FORWARD is True
    source = (Path(__file__).resolve().parents[1] / "src/minifloat/train/model.py").read_text()
    assert "reshard_after_forward" not in source


def test_run_dir_names_the_quantized_all_gather_run(scale_out, tmp_path: Path) -> None:
    assert scale_out.run_dir(tmp_path, "1.3B", "fp8-rowwise").name == "1.3B_fp8-rowwise"
    qag = scale_out.run_dir(tmp_path, "1.3B", "fp8-rowwise", quantized_all_gather=True)
    assert qag.name == "1.3B_fp8-rowwise+qag"


def _small_model(ffn_dim: int) -> Llama:
    model = Llama(get_config("tiny", dim=32, n_layers=1, n_heads=2, ffn_dim=ffn_dim,
                             vocab_size=64))  # fmt: skip
    model.init_weights(0)
    return model


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (not a dependency)")
def test_torchao_transform_swaps_aligned_linears_and_trains_on_cpu(scale_out) -> None:
    model = _small_model(ffn_dim=40)  # 40 is not a multiple of 16: the FFN stays nn.Linear
    swapped = scale_out.torchao_float8_tensorwise(model)
    assert swapped == [f"layers.0.attention.{n}" for n in ("wq", "wk", "wv", "wo")]
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert all(kinds[name] == "Float8Linear" for name in swapped)
    assert kinds["output"] == "Linear" and kinds["layers.0.feed_forward.w1"] == "Linear"
    # torch 2.13 has a CPU _scaled_mm, so the float8 layers run forward and backward here.
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    grad = model.layers[0].attention.wq.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (not a dependency)")
def test_torchao_run_trains_under_fsdp(runs: Path) -> None:
    run = runs / "chunked" / "tiny_torchao-float8-tensorwise"
    end = _records(run)[-1]
    assert end["float8_layers"] == 7  # wq wk wv wo w1 w2 w3; the head stays high precision
    float8, bf16 = _metrics(run), _metrics(runs / "chunked" / "tiny_bf16")
    # Same weights and batches: the first loss differs only by fp8 rounding of the GEMMs.
    assert abs(float8[0]["loss"] - bf16[0]["loss"]) < 0.02


def test_torchao_recipe_without_torchao_says_how_to_install(scale_out, monkeypatch) -> None:
    # torchao is a dev dependency; None in sys.modules makes its import fail as if it were absent
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(RuntimeError, match="needs torchao"):
        scale_out.torchao_float8_tensorwise(_small_model(ffn_dim=64))
