"""Tests for minifloat.train.metrics: the JSONL log, MFU and the plain progress display."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path / "off", enabled=False)
    logger.log({"step": 1})
    logger.close()
    assert not (tmp_path / "off").exists()


def test_mfu_against_peak() -> None:
    assert mfu(6e9, 1e4, 1e15) == pytest.approx(0.06)
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
