"""Faults of real runs, with real processes and real signals: a SIGKILL in the middle of a
checkpoint save, a save that fails (the file-size limit), a resumed run killed before its first
metrics record, two runs on one directory, SIGTERM/SIGINT, which must leave a checkpoint, and a
second SIGINT, which stops the run at once. After each fault the run is
resumed and must end exactly (bit for bit, every step's loss) as an uninterrupted run does.

The runs are ``python CHILD MODE MARKER minifloat-train-args...``: CHILD runs the ``minifloat``
command line, with one piece of test instrumentation per MODE that stops the run at a known
point (so the test can act there) instead of at a random time.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minifloat.train.checkpoint import load_checkpoint
from minifloat.train.run_dir import LOCK_NAME

pytestmark = pytest.mark.slow

CHILD = r"""
import os, signal, sys, time
from pathlib import Path
from minifloat.train import cli, trainer

mode, marker, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]

def wait_for(path):
    while not path.exists():
        time.sleep(0.02)

def mark(text):
    # The test acts as soon as MARKER exists, so it must appear with its text: written aside and
    # renamed (os.rename: the mode below patches os.replace).
    part = marker.with_suffix(".part")
    part.write_text(text)
    os.rename(part, marker)

if mode == "hang-in-second-save":
    # The second checkpoint save stops after writing its temporary file, before the rename.
    replace, saves = os.replace, []
    def hanging_replace(src, dst):
        if str(src).endswith(".tmp") and Path(dst).name == "checkpoint.pt":
            saves.append(dst)
            if len(saves) == 2:
                mark(str(src))
                time.sleep(600)
        replace(src, dst)
    os.replace = hanging_replace
elif mode == "die-in-first-step":
    # SIGKILL at the first step: after the metrics log is opened, before any record.
    def die(self):
        mark("dying")
        os.kill(os.getpid(), signal.SIGKILL)
    trainer.Trainer.train_step = die
elif mode == "hold-before-step-4":
    # After step 3 the run waits (holding its directory) until the test creates MARKER.done.
    step = trainer.Trainer.train_step
    def held_step(self):
        if self.step == 3:
            mark("at step 3")
            wait_for(marker.with_suffix(".done"))
        return step(self)
    trainer.Trainer.train_step = held_step
elif mode == "file-size-limit":
    # Writes past 200 kB fail with EFBIG (as writes to a full disk fail with ENOSPC): every
    # checkpoint save fails, the small metrics records do not.
    import resource
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
sys.exit(cli.main(argv))
"""

SMALL = {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}
STEPS = 8


def _args(out: Path, cache: Path, *extra: str) -> list[str]:
    overrides = [a for k, v in SMALL.items() for a in ("--model-override", f"{k}={v}")]
    return ["train", "--model", "tiny", *overrides, "--tokenizer", "byte", "--data-max-bytes",
            "60000", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "0",
            "--log-every", "1", "--device", "cpu", "--cache-dir", str(cache), "--steps",
            str(STEPS), "--out", str(out), "--quiet", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[float]]:
    """(child script, data cache, the losses of an uninterrupted run).

    The uninterrupted run is a process of its own, as the runs it is compared with are: in this
    process, state that earlier tests left behind (a thread count, say) could change its bits."""
    root = tmp_path_factory.mktemp("faults")
    child = root / "child.py"
    child.write_text(CHILD)
    done = _cli(*_args(root / "reference", root / "cache"), cwd=root)
    assert done.returncode == 0, done.stderr
    return child, root / "cache", _losses(root / "reference")


def _start(child: Path, mode: str, marker: Path, args: list[str]) -> subprocess.Popen:
    command = [sys.executable, str(child), mode, str(marker), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}): {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minifloat", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _leftovers(out: Path) -> list[str]:
    """What a finished run must not leave: temporary files and its lock."""
    return sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp") or p.name == LOCK_NAME)


# 1 in 30 to 1 in 250 runs on a 2-core CPU the last assertion fails by 9.5e-7 in step 4's loss: the
# first AdamW update after the resume differs in the embedding, with bit-identical inputs. A fresh
# run has differed too, so it is not the resume; cause not found (docs/training.md, "Checkpoints
# and resuming"). Not loosened: that would hide it.
def test_kill_during_a_checkpoint_save(setup, tmp_path: Path) -> None:
    child, cache, reference = setup
    out, marker = tmp_path / "run", tmp_path / "saving"
    proc = _start(child, "hang-in-second-save", marker, _args(out, cache, "--ckpt-every", "2"))
    _wait_for(marker, proc)
    proc.kill()  # SIGKILL between writing the step-4 checkpoint and renaming it into place
    proc.wait(timeout=60)
    assert [p.name for p in out.glob(".checkpoint.pt.*.tmp")] == [Path(marker.read_text()).name]
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2  # the previous one is intact
    assert len(_losses(out)) == 4  # records up to step 4, written before the save began

    # A resumed run killed before its first metrics record: nothing already recorded is lost.
    marker = tmp_path / "dying"
    proc = _start(child, "die-in-first-step", marker, _args(out, cache, "--resume"))
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL and marker.exists()
    assert _losses(out) == reference[:2]  # the records after the checkpoint (step 2) dropped

    done = _cli(*_args(out, cache, "--resume"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _losses(out) == reference  # bit for bit, each step once
    assert _leftovers(out) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_writes_a_checkpoint_and_a_second_run_is_locked_out(
    setup, tmp_path: Path, signum: int
) -> None:
    child, cache, reference = setup
    out, marker = tmp_path / "run", tmp_path / "held"
    proc = _start(child, "hold-before-step-4", marker, _args(out, cache))
    try:
        _wait_for(marker, proc)
        if signum == signal.SIGTERM:  # a second run on the same directory, meanwhile
            metrics = (out / "metrics.jsonl").read_bytes()
            second = _cli(*_args(out, cache, "--overwrite"), cwd=tmp_path)
            assert second.returncode == 2
            (line,) = second.stderr.strip().splitlines()
            assert line.startswith(f"minifloat: error: {out} is in use by another run (pid "
                                   f"{proc.pid} on host ")  # fmt: skip
            assert line.endswith("wait for it to finish or give another --out")
            assert (out / "metrics.jsonl").read_bytes() == metrics  # --overwrite did nothing
        proc.send_signal(signum)
        marker.with_suffix(".done").write_text("")
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines() == [
        f"minifloat: interrupted by {name} after step 4; checkpoint {out / 'checkpoint.pt'}; "
        "continue with --resume"
    ]
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 4
    assert _losses(out) == reference[:4]
    assert _leftovers(out) == []

    done = _cli(*_args(out, cache, "--resume"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _losses(out) == reference


def _checkpoints(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("checkpoint*.pt"))}


def test_a_checkpoint_that_cannot_be_written_leaves_every_earlier_one(
    setup, tmp_path: Path
) -> None:
    """A save that fails for real (over the process's file-size limit, as on a full disk) used
    to end in `minifloat: error: [Errno 27] File too large` (exit 2, no path, no step) after
    the older checkpoint had been rotated out for a copy of the newest."""
    child, cache, reference = setup
    out = tmp_path / "run"
    first = _cli(*_args(out, cache, "--ckpt-every", "2", "--stop-after", "4"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = _checkpoints(out)
    assert [load_checkpoint(out / name)["step"] for name in before] == [2, 4]  # .1.pt, .pt

    args = _args(out, cache, "--ckpt-every", "2", "--resume")
    proc = _start(child, "file-size-limit", tmp_path / "unused", args)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    newest = out / "checkpoint.pt"
    assert stderr.strip().splitlines() == [
        f"minifloat: error: could not write the checkpoint of step 6 to {newest} ([Errno "
        f"{errno.EFBIG}] {os.strerror(errno.EFBIG)}); newest checkpoint {newest} (step 4); "
        "continue with --resume once the cause is fixed"
    ]
    assert _checkpoints(out) == before  # both, byte for byte
    assert _leftovers(out) == []

    done = _cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _losses(out) == reference


def test_a_second_sigint_stops_at_once_and_names_the_newest_checkpoint(
    setup, tmp_path: Path
) -> None:
    """The second Ctrl-C (for a step or save that hangs) used to print `minifloat:
    interrupted` and nothing on where the run can continue from."""
    child, cache, reference = setup
    out, marker = tmp_path / "run", tmp_path / "held"
    args = _args(out, cache, "--ckpt-every", "2")
    proc = _start(child, "hold-before-step-4", marker, args)
    try:
        _wait_for(marker, proc)
        proc.send_signal(signal.SIGINT)  # recorded: the run would stop after step 4
        time.sleep(1)
        proc.send_signal(signal.SIGINT)  # acts at once, in step 4
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert stderr.strip().splitlines() == [
        f"minifloat: interrupted by a second SIGINT after step 3; newest checkpoint "
        f"{out / 'checkpoint.pt'} (step 2); continue with --resume"
    ]
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2
    assert _leftovers(out) == []

    done = _cli(*args, "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _losses(out) == reference
