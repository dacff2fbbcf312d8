"""Run a command under torchrun with two CPU ranks, and say where it hung if it does.

A hang under CI is otherwise only a timeout (one was seen once, after a run had printed its
summary): here every process of the run (the torchrun agent and its workers) has Python's
faulthandler on, and on timeout gets SIGABRT, which makes each print the stack of every thread
before the test fails with that output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def run_torchrun(args: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 *args`` in ``cwd``;
    fails the test with the output (stacks included, on a hang) unless it exits with 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _abort(proc)
        pytest.fail(
            f"torchrun hung for {timeout:.0f} s; the stacks of its processes:\n"
            f"{stderr[-12000:]}\n{stdout[-2000:]}"
        )
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited with {proc.returncode}:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _abort(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT to the workers (torchrun starts each in its own session), then to the agent:
    faulthandler prints every stack to the shared stderr. SIGKILL whatever is left."""
    workers = _children(proc.pid)
    for pid in workers:  # one at a time: their stacks would interleave
        _signal(pid, signal.SIGABRT)
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGABRT)
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        for pid in workers:
            _signal(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # not Linux, or already gone
        return []


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
