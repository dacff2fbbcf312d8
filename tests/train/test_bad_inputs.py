"""The `minifloat` command line against bad input: every case exits non-zero with one line
``minifloat: error: ...`` (no traceback) and leaves every file as it was.

The cases run in this process through ``main()`` (a subprocess per case would cost seconds of
torch import each); tests/train/test_cli.py runs a few as real subprocesses. Cases that get as far
as loading data may fill the data cache (``cache/``); nothing else may change.
"""

from __future__ import annotations

import hashlib
import lzma
from pathlib import Path

import pytest

from minifloat.train.cli import _train_config, build_parser, main
from minifloat.train.run_dir import RunDirectory

TINY = [
    "--model", "tiny", "--model-override", "dim=32", "--model-override", "n_layers=1",
    "--model-override", "n_heads=2", "--model-override", "ffn_dim=64", "--tokenizer", "byte",
    "--data-max-bytes", "60000", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "0",
    "--steps", "2", "--device", "cpu", "--cache-dir", "cache", "--quiet",
]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A directory with a finished run (``existing``), one held by another run (``locked``), a
    file where a directory belongs, a truncated .xz corpus and TOML files with ``lr = nan`` and
    a misspelled key."""
    root = tmp_path_factory.mktemp("bad_inputs")
    import os

    cwd = Path.cwd()
    os.chdir(root)
    try:
        assert main(["train", *TINY, "--out", "existing"]) == 0
    finally:
        os.chdir(cwd)
    (root / "afile").write_text("not a directory\n")
    packed = lzma.compress(b"def f():\n    return 1\n" * 20_000)
    (root / "truncated.xz").write_bytes(packed[: len(packed) // 2])
    (root / "nan.toml").write_text("lr = nan\n")
    (root / "typo.toml").write_text("batchsize = 4\n")
    (root / "locked").mkdir()
    holder = RunDirectory(root / "locked", resume=False, overwrite=False, resumable=True)
    holder.open()
    yield root
    holder.close()


def _state(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` (the data cache aside) with its content hash."""
    state = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative.parts[0] == "cache":
            continue
        state[str(relative)] = (
            "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        )
    return state


CASES = [
    # Non-finite and out-of-range hyper-parameters: each used to train into NaN weights.
    (["train", "--lr", "inf"], 2, "lr must be positive and finite, got inf"),
    (["train", "--lr", "nan"], 2, "lr must be positive and finite, got nan"),
    (["train", "--weight-decay", "nan"], 2, "weight-decay must be >= 0 and finite, got nan"),
    (["train", "--grad-clip", "nan"], 2, "grad-clip must be >= 0 and finite (0: off), got nan"),
    (["train", "--z-loss", "nan"], 2, "z-loss must be >= 0 and finite (0: off), got nan"),
    (["train", "--z-loss", "-1"], 2, "z-loss must be >= 0 and finite"),
    (["train", "--warmup-fraction", "nan"], 2, "warmup-fraction must be in [0, 1), got nan"),
    (["train", "--min-lr-ratio", "inf"], 2, "min-lr-ratio must be in [0, 1] and finite"),
    (["train", "--spike-k", "nan"], 2, "spike-k must be >= 0 and finite"),
    (["train", "--grad-norm-spike-k", "inf"], 2, "grad-norm-spike-k must be >= 0 and finite"),
    (["train", "--embed-grad-shrink", "nan"], 2, "embed-grad-shrink must be in (0, 1]"),
    (["train", "--lr", "20"], 2, "lr x weight-decay must be below 1"),
    (["train", "--max-skip-fraction", "1.5"], 2, "max-skip-fraction must be in [0, 1]"),
    (["train", "--keep-checkpoints", "0"], 2, "keep-checkpoints must be at least 1, got 0"),
    # A seed torch cannot take, and a token count no run reaches (it trained at an LR of 1e-40).
    (["train", "--seed", "-1"], 2, "seed must be an integer in [0, 2^63), got -1"),
    (["train", "--seed", str(2**70)], 2, "seed must be an integer in [0, 2^63)"),
    (["train", "--tokens", "1e40"], 2, "tokens=1e+40 give 9.77e+36 steps: at most 2^40"),
    (["train", "--tokens", "1e6", "--grad-accum", "0"], 2, "grad-accum must be at least 1"),
    (["train", "--config", "nan.toml"], 2, "lr must be positive and finite, got nan"),
    # A key the file misspelled is named with the file and the setting it was probably meant as.
    (
        ["train", "--config", "typo.toml"],
        2,
        "typo.toml: unknown setting 'batchsize' (did you mean 'batch_size'?)",
    ),
    (["train", "--resume", "--overwrite"], 2, "give either resume or overwrite, not both"),
    # Model overrides that used to end in a traceback.
    (["train", *TINY, "--model-override", "n_heads=0"], 2, "does not accept these overrides"),
    (["train", *TINY, "--model-override", "dim=1.5"], 2, "model override dim must be an integer"),
    (
        ["train", *TINY, "--model-override", "vocab_size=100"],
        2,
        "vocab_size=100 is smaller than the tokenizer's vocabulary of 257 tokens",
    ),
    # The run directory: a run is never replaced or joined by accident.
    (["train", *TINY, "--out", "existing"], 2, "existing already holds a run (checkpoint.pt"),
    (["train", *TINY, "--out", "locked", "--overwrite"], 2, "locked is in use by another run"),
    (["train", *TINY, "--out", "afile"], 2, "--out afile exists and is not a directory"),
    (["train", *TINY, "--out", "afile/run"], 2, "--out afile/run: afile exists and is not a dir"),
    (["data", "export", "stdlib", "--out", "afile/c.xz"], 2, "cannot write afile/c.xz: afile is a"),
    # `--out "$UNSET"` wrote the run's files into the current directory
    (["train", *TINY, "--out", ""], 2, "out must name a run directory, got ''"),
    # the byte tokenizer ignored it: the run trained with 257 tokens and said nothing
    (
        ["train", *TINY, "--tokenizer", "byte", "--vocab-size", "10"],
        2,
        "vocab-size 10 applies to the bpe tokenizer; the byte tokenizer's vocabulary is its 257",
    ),
    (["compare", *TINY, "--recipes", "bf16,bf16"], 2, "recipe bf16 is named more than once"),
    (["compare", *TINY, "--recipes", "fp4,fp4:dge.k=5"], 2, "fp4:dge.k=5 computes exactly as"),
    # a quantized recipe that converts no layer of the model trained bf16 under its name
    (["train", *TINY, "--recipe", "fp8-blockwise"], 2, "converted no layer: all 8 linear layers"),
    (
        ["compare", *TINY, "--recipes", "bf16,fp8-blockwise"],
        2,
        "would train in high precision under the name fp8-blockwise",
    ),
    # Data: an empty name (`--data "$UNSET"`) used to train on the current directory.
    (["train", *TINY, "--data", ""], 2, "data must be a corpus (stdlib, site-packages, english)"),
    # Data: a truncated compressed corpus (the message is the data module's).
    (["train", *TINY, "--data", "truncated.xz"], 2, ""),
    # Out of memory: the run fails (status 1) with what to lower.
    (
        ["train", *TINY, "--model-override", f"ffn_dim={2**44}"],
        1,
        "out of memory building the model on cpu",
    ),
]


@pytest.mark.parametrize(("args", "status", "fragment"), CASES, ids=[" ".join(
    a for a in c[0] if a not in TINY or a.startswith("--model-override")
)[:60] for c in CASES])  # fmt: skip
def test_bad_input_is_one_line_and_touches_nothing(
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    args: list[str],
    status: int,
    fragment: str,
) -> None:
    monkeypatch.chdir(workdir)
    before = _state(workdir)
    capsys.readouterr()
    try:
        got = main(args)
    except SystemExit as exc:  # argparse usage errors exit from inside parse_args
        got = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert got == status, err
    assert len(err) == 1 and err[0].startswith("minifloat: error: "), err
    assert fragment in err[0]
    assert _state(workdir) == before


def test_integral_float_overrides_are_accepted() -> None:
    """`dim=1e3` and `n_layers=2.0` used to reach the model as floats (TypeError in torch); they
    are the integers 1000 and 2, as TOML's `tokens = 2e9` is a count."""
    argv = ["train", "--model-override", "dim=1e3", "--model-override", "n_layers=2.0"]
    config = _train_config(build_parser().parse_args(argv))
    assert config.model_overrides == {"dim": 1000, "n_layers": 2}
    assert all(type(v) is int for v in config.model_overrides.values())


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["train"], False),
        (["--traceback", "train"], True),
        (["train", "--traceback"], True),  # after the command too; it used to be refused there
        (["data", "info", "english", "--traceback"], True),
    ],
)
def test_traceback_flag_before_or_after_the_command(argv: list[str], shown: bool) -> None:
    assert build_parser().parse_args(argv).traceback is shown
