"""Scripts of benchmarks/ in tests: a Python one loaded as a module (for the tests that drive its
main()), a shell one run in a clean environment, and a tiny training run for those that read one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py imported under the module name `<name>_bench`."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.compile looks functions' modules up by name
    spec.loader.exec_module(module)
    return module


def run_shell_benchmark(name: str, *args: str, timeout: float = 600, **env: str):
    """`bash benchmarks/<name>.sh ARGS` from the repository's root, with only PATH and `env` in
    its environment; the completed process, its output captured as text."""
    return subprocess.run(
        ["bash", str(BENCHMARKS / f"{name}.sh"), *args], env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True, text=True, cwd=BENCHMARKS.parent, timeout=timeout,
    )  # fmt: skip


TINY = ("dim=32", "n_layers=2", "n_heads=2", "ffn_dim=64")


def train_tiny(out: Path, recipe: str, *args: str) -> Path:
    """A `minifloat train` run of a two-block, 32-wide model on the CPU into `out` (its cache
    beside it), batch 2 x 32 tokens, no evaluation; `args` add or override flags (e.g. --steps).
    Returns `out`."""
    from minifloat.train.cli import main

    overrides = [arg for kv in TINY for arg in ("--model-override", kv)]
    status = main(["train", "--recipe", recipe, "--model", "tiny", *overrides, "--steps", "3",
                   "--batch-size", "2", "--seq-len", "32", "--eval-batches", "0",
                   "--device", "cpu", "--cache-dir", str(out.parent / f"{out.name}_cache"),
                   "--out", str(out), "--quiet", *args])  # fmt: skip
    assert status == 0, f"minifloat train {recipe} failed"
    return out
