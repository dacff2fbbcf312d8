"""benchmarks/ab_interleaved.sh: a base tree made from git, four processes in opposite orders,
one tarball with every record, a side-by-side summary, arguments for the new processes alone
(an A/B of options), and an exit status that says whether all four ran."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from scripts import run_shell_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_shell_benchmark("ab_interleaved", *args, timeout=600, **env)


@pytest.mark.slow
def test_prepare_then_four_processes_packed_with_a_summary(tmp_path):
    base, out = tmp_path / "base", tmp_path / "out"
    prepared = _run("--prepare", "HEAD", AB_BASE=str(base))
    assert prepared.returncode == 0, prepared.stderr
    assert (base / "src" / "minifloat" / "dge.py").is_file()
    assert (base / "benchmarks" / "train_interleaved.py").is_file()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    assert (base / "REV").read_text().strip() == rev
    done = _run("t", "bf16", AB_BASE=str(base), OUT=str(out), MODEL="tiny", ROUNDS="1",
                STEPS="1", PY=sys.executable,
                EXTRA="--device cpu --compile-scope none --warmup 1",
                NEW_ARGS="--compile-options triton.max_tiles=2")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line for line in done.stdout.splitlines() if " rc=" in line) == [
        f"{n} rc=0" for n in ("base0", "base1", "new0", "new1")
    ]
    with tarfile.open(out / "ab_t.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        summary = tar.extractfile("ab_t/summary.txt").read().decode()
        trees = tar.extractfile("ab_t/trees.txt").read().decode()
        options = {
            Path(n).name.split("_")[5]: json.load(tar.extractfile(n))[0]["compile_options"]
            for n in tar.getnames() if n.endswith(".json")
        }  # fmt: skip
    for name in ("base0", "base1", "new0", "new1"):
        assert any(n.startswith(f"train_interleaved_tiny_ours_t_{name}_") and n.endswith(".json")
                   for n in names), name  # fmt: skip
        assert f"{name}.log" in names
    assert summary.startswith("bf16: base0 ") and summary.count(" ms (1.000x)") == 4
    assert rev in trees and "with --compile-options triton.max_tiles=2" in trees
    assert options == {"new0": {"triton.max_tiles": 2}, "new1": {"triton.max_tiles": 2},
                       "base0": {}, "base1": {}}  # fmt: skip
    assert not (out / "ab_t").exists()  # only the tarball is left to come back


def test_a_failed_process_fails_the_call_and_nothing_runs_without_a_base(tmp_path):
    base, out = tmp_path / "base", tmp_path / "out"
    missing = _run("t", "bf16", AB_BASE=str(base), OUT=str(out))
    assert missing.returncode == 2 and "--prepare" in missing.stderr
    assert _run().returncode == 2 and "usage:" in _run().stderr
    base.joinpath("src").mkdir(parents=True)
    failed = _run("t", "bf16", AB_BASE=str(base), OUT=str(out), PY="false")
    assert failed.returncode == 1 and "new0 rc=1" in failed.stdout
    assert (out / "ab_t.tar.gz").is_file()  # the logs still come back


@pytest.mark.parametrize("half, order", [("0", ["new0", "base0"]), ("1", ["base1", "new1"])])
def test_one_gpu_halves_run_one_order_each(tmp_path, half, order):
    """HALF: a one-GPU machine runs one GPU's order per call, on GPU 0, in that order."""
    base, out = tmp_path / "base", tmp_path / "out"
    base.joinpath("src").mkdir(parents=True)
    done = _run("t", "bf16", AB_BASE=str(base), OUT=str(out), PY="true", HALF=half)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if " rc=" in line] == [
        f"{n} rc=0" for n in order
    ]
    bad = _run("t", "bf16", AB_BASE=str(base), OUT=str(out), PY="true", HALF="2")
    assert bad.returncode == 2 and "HALF must be 0 or 1" in bad.stderr
