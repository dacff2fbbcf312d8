"""Tests for the `minifloat` command line, run as `python -m minifloat` in a subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minifloat.train.checkpointer import read_stored_config
from minifloat.train.cli import _train_config, build_parser, main, parse_count

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
    (root / "override_key.toml").write_text("[model_overrides]\nfoo = 1\n")
    (root / "str_steps.toml").write_text('steps = "abc"\n')
    (root / "flat_overrides.toml").write_text("model_overrides = 3\n")
    (root / "empty_run").mkdir()
    (root / "garbage_run").mkdir()
    (root / "garbage_run" / "checkpoint.pt").write_bytes(b"this is no checkpoint\n" * 20)
    return root


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["train", "--recipe", "fp5"], "unknown recipe 'fp5'"),
        (["train", "--steps", "0"], "must be a positive integer"),
        (["frobnicate"], "invalid choice"),
        (["train", "--model-override", "foo=1"], "unknown model override 'foo'; valid keys: dim"),
    ],
)
def test_bad_input_is_one_line_exit_2(workdir: Path, args: list[str], fragment: str) -> None:
    proc = _run(*args, cwd=workdir)
    _assert_one_line_error(proc, fragment)
    assert len(proc.stderr.strip().splitlines()) == 1


SWITCH = ["--switch-recipe", "bf16"]


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
        (["train", "--compile", "--compile-mode", "fast"], "compile-mode must be one of default"),
        (["train", "--size-rule", "1024"], "size rule must be IN:OUT"),
        (["train", "--compile-mode", "max-autotune"], "compile-mode max-autotune needs compile"),
        (["train", "--compile-scope", "block"], "compile-scope block needs compile"),
        (["train", "--compile", "--compile-scope", "layer"], "compile-scope must be one of model"),
        (["train", "--model-override", "dim=abc"], "model override dim must be an integer"),
        (["train", "--model-override", "dim=30"], "dim=30 is not divisible by n_heads=4"),
        # Overrides are checked before any data work: the unknown corpus is not reached.
        (["train", "--data", "nosuchcorpus", "--model-override", "foo=1"], "override 'foo'"),
        (["train", "--config", "override_key.toml"], "unknown model override 'foo'"),
        (["compare", "--recipes", "bf16,fp32", "--model-override", "foo=1"], "override 'foo'"),
        (["train", "--config", "str_steps.toml"], "steps must be an integer, got 'abc'"),
        (
            ["train", "--config", "flat_overrides.toml", "--model-override", "dim=64"],
            "model-overrides must be a table",
        ),
        (["train", "--tokens", "2.5"], "expected a whole number, got '2.5'"),
        (["train", "--tokens=-1e3"], "must be a positive integer"),
        (["train", "--out", "empty_run", "--resume"], "no checkpoint in empty_run"),
        (["train", "--out", "garbage_run", "--resume"], "is not a valid minifloat checkpoint ("),
        (["export", "garbage_run", "--out", "hf"], "is not a valid minifloat checkpoint ("),
        (["export", "no_such_run", "--out", "hf"], "run directory no_such_run does not exist"),
        (["export", "small.toml", "--out", "hf"], "run directory small.toml is a file, not a"),
        (["export", "empty_run", "--out", "hf"], "empty_run holds no checkpoint.pt"),
        (["train", "--recipe", "fp4", "--switch-recipe", "bf16"], "bf16 needs switch-at"),
        (["train", "--switch-at", "0.9"], "switch-at needs switch-recipe"),
        (["train", "--recipe", "fp4", *SWITCH, "--switch-at", "0"], "must be a fraction in (0, 1)"),
        (["train", "--recipe", "fp4", *SWITCH, "--switch-at", "x"], "invalid float value: 'x'"),
        (["train", "--recipe", "fp4", *SWITCH, "--switch-at", "9", "--steps", "9"], "step 9 is"),
        (["train", "--switch-recipe", "fp5", "--switch-at", "0.9"], "unknown recipe 'fp5'"),
        (["train", "--recipe", "fp4+switch=bf16+at=0.9"], "--recipe fp4 --switch-recipe bf16"),
        (["compare", "--recipes", "bf16,fp4+switch=bf16"], "expected RECIPE+switch="),
    ],
)
# A third-party DeprecationWarning raised by the first import of a module (which test runs first
# decides) is not the CLI's output; Python hides those outside pytest anyway.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
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
    assert "weights_only" not in err[0]


@pytest.mark.parametrize(
    ("text", "value"),
    [("12", 12), ("2e9", 2_000_000_000), ("1.5e6", 1_500_000), ("2E3", 2000), ("1_000", 1000),
     ("123456789012345678901", 123456789012345678901)],
)  # fmt: skip
def test_counts_accept_scientific_notation(text: str, value: int) -> None:
    assert parse_count(text) == value and type(parse_count(text)) is int


@pytest.mark.parametrize("text", ["2.5", "1.5e0", "0", "-3", "-1e3", "nan", "inf", "abc", ""])
def test_counts_reject_fractions_and_non_positive(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_count(text)


def test_tokens_in_scientific_notation_reach_the_config() -> None:
    config = _train_config(build_parser().parse_args(["train", "--tokens", "2e9"]))
    assert config.tokens == 2_000_000_000 and config.steps is None


def test_switch_flags_reach_the_config() -> None:
    flags = ["train", "--recipe", "fp4", "--switch-recipe", "bf16", "--switch-at", "0.9"]
    config = _train_config(build_parser().parse_args(flags))
    assert (config.recipe, config.switch_recipe, config.switch_at) == ("fp4", "bf16", 0.9)
    step = _train_config(build_parser().parse_args([*flags[:-1], "8240", "--steps", "9156"]))
    assert step.switch_at == 8240.0


def test_grad_norm_spike_k_reaches_the_config() -> None:
    args = build_parser().parse_args(["train", "--grad-norm-spike-k", "4.5"])
    assert _train_config(args).grad_norm_spike_k == 4.5
    assert _train_config(build_parser().parse_args(["train"])).grad_norm_spike_k == 0.0


def test_too_little_data_for_one_batch(workdir: Path) -> None:
    proc = _run("train", "--config", "small.toml", "--data", "few_docs", "--steps", "2",
                "--out", "runs/x", cwd=workdir)  # fmt: skip
    _assert_one_line_error(proc, "tokens")


def test_loss_chunk_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["train", "--loss-chunk", "4096"])
    assert _train_config(args).loss_chunk == 4096
    assert _train_config(build_parser().parse_args(["train"])).loss_chunk == 0


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
    table, accumulation, variants = proc.stdout.split("\n\n")
    assert accumulation.startswith("On FP8 tensor cores fprop accumulates fast")
    header, *rows = table.splitlines()
    assert header.split()[:4] == ["recipe", "fprop", "dgrad", "wgrad"]
    names = [row.split()[0] for row in rows]
    assert {"fp32", "fp16", "bf16"} <= set(names)
    assert rows[names.index("bf16")].split()[1:4] == ["bf16", "bf16", "bf16"]
    assert rows[names.index("fp8-tensorwise")].count("fast accum") == 1  # dgrad's
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


def _main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def test_resume_takes_the_runs_settings_from_its_checkpoint(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(workdir)
    first = ["train", "--config", "small.toml", "--recipe", "fp32", "--seed", "3", "--lr", "2e-3",
             "--grad-accum", "2", "--steps", "6", "--stop-after", "3", "--log-every", "1",
             "--out", "runs/resume", "--quiet"]  # fmt: skip
    assert _main(first, capsys)[0] == 0
    expected = read_stored_config(workdir / "runs/resume/checkpoint.pt")
    assert expected["seed"] == 3 and expected["model_overrides"]["dim"] == 32
    # Only --out and --resume: every other setting comes from the checkpoint.
    config = _train_config(build_parser().parse_args(["train", "--out", "runs/resume", "--resume"]))
    assert {**config.to_dict(), "resume": False, "stop_after": 3} == expected
    # Flags given on resume apply on top; one that changes the trajectory is a clear mismatch.
    resume = ["train", "--out", "runs/resume", "--resume", "--quiet"]
    status, _, err = _main([*resume, "--recipe", "bf16"], capsys)
    assert status == 2 and "recipe: checkpoint='fp32', now='bf16'" in err
    status, _, err = _main([*resume, "--steps", "12"], capsys)
    assert status == 2 and "total_steps: checkpoint=6, now=12" in err
    assert len(err.strip().splitlines()) == 1
    status, out, err = _main(resume, capsys)
    assert status == 0, err
    assert "fp32 tiny: 6 steps" in out
    steps = [json.loads(x)["step"] for x in (workdir / "runs/resume/metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5, 6]
    stored = read_stored_config(workdir / "runs/resume/checkpoint.pt")
    assert {**stored, "resume": False, "stop_after": 3} == expected
