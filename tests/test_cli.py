"""Tests for the `minifloat` command line, run as `python -m minifloat` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minifloat.cli import _train_config, build_parser, main

SMALL_TOML = """
model = "tiny"
tokenizer = "byte"
data-max-bytes = 200000
batch_size = 4
seq_len = 32
eval_every = 3
eval_batches = 2
device = "cpu"

[model_overrides]
dim = 32
n_layers = 1
n_heads = 2
ffn_dim = 64
"""


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minifloat", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    """Exit status 2, no traceback, and the error is one line (after any data-progress lines)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("minifloat: error: ")]
    assert errors == [lines[-1]], proc.stderr
    assert fragment in lines[-1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    (root / "small.toml").write_text(SMALL_TOML)
    for i in range(4):  # a few short documents: far fewer tokens than one batch needs
        (root / "few_docs").mkdir(exist_ok=True)
        (root / "few_docs" / f"doc{i}.txt").write_text(f"document {i}: just a few words\n")
    (root / "binary.bin").write_bytes(b"\x00\x01\x02" * 100)
    (root / "bad.toml").write_text("steps = = 3\n")
    (root / "unknown_key.toml").write_text('colour = "blue"\n')
    return root


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["train", "--recipe", "fp5"], "unknown recipe 'fp5'"),
        (["train", "--steps", "0"], "must be a positive integer"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_exit_2(workdir: Path, args: list[str], fragment: str) -> None:
    proc = _run(*args, cwd=workdir)
    _assert_one_line_error(proc, fragment)
    assert len(proc.stderr.strip().splitlines()) == 1


# The same checks in-process (a subprocess per case would cost seconds of torch import each).
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["train", "--model", "huge"], "unknown model 'huge'"),
        (["train", "--data", "nosuchcorpus"], "unknown corpus 'nosuchcorpus'"),
        (["train", "--data", "binary.bin", "--tokenizer", "byte"], "binary"),
        (["train", "--optim-states", "fp2"], "unknown optimizer states 'fp2'"),
        (["train", "--steps", "5", "--parallel", "tp"], "invalid choice"),
        (["train", "--steps", "5", "--tokens", "9"], "either steps or tokens"),
        (["train", "--config", "missing.toml"], "missing.toml"),
        (["train", "--config", "bad.toml"], "cannot parse bad.toml"),
        (["train", "--config", "unknown_key.toml"], "unknown setting 'colour'"),
        (["train", "--model-override", "dim"], "expected KEY=VALUE"),
        (["compare", "--recipes", "bf16,fp5"], "unknown recipe 'fp5'"),
        (["compare", "--recipes", "bf16,fp4:k=3"], "unknown variant key 'k'"),
        (["train", "--recipe", "fp4:occ.alpha=2"], "alpha must lie in (0.5, 1)"),
        (["train", "--sqnr-every", "-1"], "sqnr-every must be >= 0"),
        (["train", "--sqnr-every", "5", "--parallel", "fsdp"], "sqnr-every needs whole layers"),
        (["train", "--ckpt-format", "sharded"], "checkpoint-format sharded needs parallel=fsdp"),
        (["train", "--ckpt-format", "zip"], "invalid choice"),
    ],
)
def test_bad_input_in_process(
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    args: list[str],
    fragment: str,
) -> None:
    monkeypatch.chdir(workdir)
    try:
        status = main(args)
    except SystemExit as exc:  # argparse usage errors exit from inside parse_args
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minifloat: error: ") and fragment in err[0]


def test_too_little_data_for_one_batch(workdir: Path) -> None:
    proc = _run("train", "--config", "small.toml", "--data", "few_docs", "--steps", "2",
                "--out", "runs/x", cwd=workdir)  # fmt: skip
    _assert_one_line_error(proc, "tokens")


def test_train_from_toml_with_flag_overrides(workdir: Path) -> None:
    proc = _run("train", "--config", "small.toml", "--steps", "6", "--recipe", "bf16",
                "--out", "runs/train", "--quiet", cwd=workdir)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "bf16 tiny: 6 steps" in proc.stdout
    records = (workdir / "runs/train/metrics.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["step"] == 6
    # --resume of a finished run has nothing to do: a clear error, not a fresh start.
    proc = _run("train", "--config", "small.toml", "--steps", "6", "--recipe", "bf16",
                "--out", "runs/train", "--resume", cwd=workdir)  # fmt: skip
    _assert_one_line_error(proc, "already at step 6")
    proc = _run("train", "--config", "small.toml", "--steps", "6", "--recipe", "fp32",
                "--out", "runs/train", "--resume", cwd=workdir)  # fmt: skip
    _assert_one_line_error(proc, "recipe: checkpoint='bf16', now='fp32'")


def test_compare_prints_table_and_plot_path(workdir: Path) -> None:
    proc = _run("compare", "--recipes", "fp32,bf16", "--config", "small.toml", "--steps", "4",
                "--out", "runs/cmp", "--quiet", cwd=workdir)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| fp32 |" in proc.stdout and "| bf16 |" in proc.stdout
    assert "plot: runs/cmp/loss_curves.png" in proc.stdout
    assert (workdir / "runs/cmp/loss_curves.png").is_file()
    assert (workdir / "runs/cmp/comparison.json").is_file()


def test_recipes_lists_per_gemm_precisions(workdir: Path) -> None:
    proc = _run("recipes", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    table, variants = proc.stdout.split("\n\n")
    header, *rows = table.splitlines()
    assert header.split()[:4] == ["recipe", "fprop", "dgrad", "wgrad"]
    names = [row.split()[0] for row in rows]
    assert {"fp32", "fp16", "bf16"} <= set(names)
    assert rows[names.index("bf16")].split()[1:4] == ["bf16", "bf16", "bf16"]
    assert variants.startswith("variants: BASE:KEY=VALUE")
    assert {"dge.k", "occ.alpha", "scaling"} <= {line.split()[0] for line in variants.splitlines()}


def test_sqnr_every_and_variants_reach_the_config(workdir: Path) -> None:
    argv = ["compare", "--recipes", "bf16,fp4:dge.k=3", "--sqnr-every", "7"]
    args = build_parser().parse_args([*argv, "--config", str(workdir / "small.toml")])
    config = _train_config(args)
    assert config.sqnr_every == 7 and config.model == "tiny"
    args = build_parser().parse_args(["train", "--recipe", "fp4:scaling=tensor", "--steps", "3"])
    assert (
        _train_config(args).recipe == "fp4:scaling=tensor" and _train_config(args).sqnr_every == 0
    )


def test_ckpt_format_reaches_the_config() -> None:
    args = build_parser().parse_args(["train", "--parallel", "fsdp", "--ckpt-format", "sharded"])
    assert _train_config(args).checkpoint_format == "sharded"
    assert _train_config(build_parser().parse_args(["train"])).checkpoint_format == "full"


def test_data_info_and_export(workdir: Path) -> None:
    (workdir / "doc.txt").write_text("hello world\n" * 50)
    proc = _run("data", "info", "doc.txt", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["bytes"] == 600 and len(info["sha256"]) == 64
    proc = _run("data", "export", "doc.txt", "--out", "doc.xz", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    proc = _run("data", "info", "doc.xz", cwd=workdir)
    assert json.loads(proc.stdout)["sha256"] == info["sha256"]
