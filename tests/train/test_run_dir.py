"""Tests for minifloat.train.run_dir: one run per directory, no run replaced by accident, no
temporary files left behind. (Two real processes contend in tests/train/test_faults.py.)"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from minifloat.train.errors import RunDirError
from minifloat.train.run_dir import LOCK_NAME, RunDirectory, run_files


def _open(path: Path, **kwargs) -> RunDirectory:
    options = {"resume": False, "overwrite": False, "resumable": True, **kwargs}
    run = RunDirectory(path, **options)
    run.open()
    return run


def test_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = _open(tmp_path / "run")
    try:
        # flock conflicts between two open files even in one process, as between processes.
        with pytest.raises(RunDirError) as info:
            _open(tmp_path / "run", resume=True)
        message = str(info.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "is in use by another run" in message and "\n" not in message
    finally:
        first.close()
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released and removed
    _open(tmp_path / "run").close()  # free again


def test_a_stale_lock_file_does_not_block(tmp_path: Path) -> None:
    # A run killed with SIGKILL leaves its lock file; the kernel released the lock itself.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text("pid 1 on host gone, since 2026-01-01")
    run = _open(tmp_path / "run")
    assert f"pid {os.getpid()}" in (tmp_path / "run" / LOCK_NAME).read_text()
    run.close()


def test_an_earlier_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "checkpoint.pt").write_bytes(b"old")
    (out / "checkpoint.1.pt").write_bytes(b"older")
    (out / "tensorboard").mkdir()
    (out / "notes.txt").write_text("mine")
    assert [p.name for p in run_files(out)] == ["checkpoint.1.pt", "checkpoint.pt", "metrics.jsonl"]
    with pytest.raises(RunDirError, match="already holds a run .*--resume or replace it with "
                                          "--overwrite"):  # fmt: skip
        _open(out)
    with pytest.raises(RunDirError, match="already holds a run") as info:
        _open(out, resumable=False)  # e.g. compare, which saves no checkpoints
    assert "--resume" not in str(info.value)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    assert not (out / LOCK_NAME).exists()
    _open(out, resume=True).close()
    assert (out / "checkpoint.pt").read_bytes() == b"old"
    _open(out, overwrite=True).close()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # only the run's files went


def test_stale_temporary_files_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / ".checkpoint.dcp.tmp").mkdir(parents=True)
    (out / ".checkpoint.dcp.tmp" / "__0_0.distcp").write_bytes(b"half")
    (out / ".checkpoint.pt.k2j4x.tmp").write_bytes(b"half")
    (out / ".metrics.jsonl.a8b.tmp").write_text("half")
    (out / "keep.tmp").write_text("not ours")
    _open(out).close()
    assert sorted(p.name for p in out.iterdir()) == ["keep.tmp"]


def test_a_directory_created_for_nothing_is_removed(tmp_path: Path) -> None:
    run = _open(tmp_path / "a" / "run")
    run.close()  # e.g. the data failed to load: nothing was written
    assert list(tmp_path.iterdir()) == []  # "a" was created for it too
    (tmp_path / "b").mkdir()
    _open(tmp_path / "b").close()  # it existed before: it stays
    assert (tmp_path / "b").is_dir()


def test_out_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="exists and is not a directory"):
        _open(tmp_path / "file")
