"""Tests for minifloat.train.metrics: the JSONL log, MFU and the plain progress display."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from minifloat.train.errors import RunWarning
from minifloat.train.metrics import MetricsLogger, ProgressDisplay, mfu, peak_flops


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_new_run_overwrites_and_resume_truncates(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    for step in (2, 4, 6, 8):
        logger.log({"step": step, "loss": 1.0 / step})
    logger.close()
    # Resuming from a checkpoint at step 4 drops the records the resumed run will repeat.
    logger = MetricsLogger(tmp_path, resume_step=4)
    logger.log({"step": 6, "loss": 0.5})
    logger.close()
    assert _steps(tmp_path / "metrics.jsonl") == [2, 4, 6]
    MetricsLogger(tmp_path).close()
    assert _steps(tmp_path / "metrics.jsonl") == []


def _write(path: Path, steps: list[int], tail: bytes = b"") -> None:
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps]
    path.write_bytes("".join(lines).encode() + tail)


@pytest.mark.parametrize(
    ("tail", "warns", "expected"),
    [
        (b'{"step": 5, "lo', True, [1, 2, 3, 4, 6]),
        (b"\x00\x00\x00\x00", False, [1, 2, 3, 4, 6]),
        (b'{"step": 5, "loss": 1.0}', False, [1, 2, 3, 4, 5, 6]),
    ],
    ids=["torn record", "NUL padding", "no final newline"],
)
def test_a_damaged_last_line_does_not_block_a_resume(
    tmp_path: Path, tail: bytes, warns: bool, expected: list[int]
) -> None:
    """A killed run may leave half a record (or NUL bytes) at the end: resuming drops it (a torn
    record with a warning) instead of failing with a raw JSON error."""
    _write(tmp_path / "metrics.jsonl", [1, 2, 3, 4], tail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = MetricsLogger(tmp_path, resume_step=5)
    assert [w.category for w in caught] == ([RunWarning] if warns else [])
    assert all("dropped damaged line(s) 5 (not a JSON record)" in str(w.message) for w in caught)
    logger.log({"step": 6, "loss": 0.5})
    logger.close()
    assert _steps(tmp_path / "metrics.jsonl") == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file


def test_a_damaged_line_inside_the_log_is_dropped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n<<garbage>>\n{"step": 2}\n[3]\n{"step": 3}\n')
    with pytest.warns(RunWarning, match="dropped damaged line.* 2, 4 "):
        MetricsLogger(tmp_path, resume_step=3).close()
    assert _steps(path) == [1, 2, 3]


def test_resuming_with_nothing_to_drop_leaves_the_file_as_it_is(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [1, 2])
    inode = (tmp_path / "metrics.jsonl").stat().st_ino
    MetricsLogger(tmp_path, resume_step=2).close()
    assert (tmp_path / "metrics.jsonl").stat().st_ino == inode  # appended to, not rewritten


def test_a_resumed_run_killed_before_its_first_record_loses_nothing(tmp_path: Path) -> None:
    """Real SIGKILL right after the logger of a resumed run is created (before any record): the
    records kept from before the checkpoint must all still be there. (The logger used to reopen
    the file with "w" and write the kept records into a buffer that the kill threw away.)"""
    _write(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5, 6])
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from minifloat.train.metrics import MetricsLogger\n"
        "logger = MetricsLogger(Path(sys.argv[1]), resume_step=4)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path / "off", enabled=False)
    logger.log({"step": 1})
    logger.close()
    assert not (tmp_path / "off").exists()


def test_mfu_against_peak() -> None:
    assert mfu(6e9, 1e4, 1e15) == pytest.approx(0.06)  # float64 arithmetic: rounding only
    assert mfu(6e9, 1e4, None) is None
    # tokens/s of all ranks together over all their peaks: 2 devices at the same rate per device
    assert mfu(6e9, 2e4, 1e15, devices=2) == pytest.approx(0.06)
    assert peak_flops(torch.device("cpu")) is None


def test_plain_progress_prints_every_n_steps(capsys: pytest.CaptureFixture) -> None:
    display = ProgressDisplay(6, mode="plain", label="bf16", print_every=3)
    for step in range(1, 7):
        display.update(step, {"loss": 2.5, "tok/s": 1234.5, "mfu": 0.25})
    display.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[bf16] step 3/6  loss 2.5  tok/s 1,234  mfu 25.0%",
        "[bf16] step 6/6  loss 2.5  tok/s 1,234  mfu 25.0%",
    ]
