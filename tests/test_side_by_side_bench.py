"""benchmarks/side_by_side.sh: every RUN x SEED trains at once and comes back in one tarball."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(out: Path, **extra: str) -> dict[str, str]:
    tiny = "--device cpu --tokenizer byte --data-max-bytes 60000 " + " ".join(
        f"--model-override {kv}" for kv in ("dim=32", "n_layers=1", "n_heads=2", "ffn_dim=64")
    )
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "OUT": str(out), "MODEL": "tiny"}
    env |= {"DATA": "stdlib", "STEPS": "2", "EVAL": "2", "EVAL_BATCHES": "1", "BATCH": "2"}
    return env | {"SEQ": "32", "COMPILE": "", "EXTRA": tiny, **extra}


def test_runs_every_recipe_and_seed_and_packs_their_metrics(tmp_path):
    runs = ["bf16", "fp8-tensorwise:dgrad_fast_accum=off"]
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "side_by_side.sh"), *runs],
        env=_env(tmp_path, SEEDS="0 1"), capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("rc=0") == 4, done.stdout
    with tarfile.open(tmp_path / "side_by_side.tar.gz") as tar:
        names = set(tar.getnames())
        metrics = {n.removeprefix("./") for n in names if n.endswith("metrics.jsonl")}
        logs = [tar.extractfile(f"./seed{s}/{runs[1]}/metrics.jsonl").read() for s in (0, 1)]
    assert metrics == {f"seed{s}/{r}/metrics.jsonl" for s in (0, 1) for r in runs}
    assert not any(n.endswith(".pt") for n in names)  # checkpoints stay behind
    records = [[json.loads(line) for line in log.splitlines()] for log in logs]
    assert all("val_loss" in r[-1] and r[-1]["recipe"] == runs[1] for r in records)
    assert records[0][0]["loss"] != records[1][0]["loss"]  # --seed reached each run


def test_without_runs_it_says_how_to_call_it(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "side_by_side.sh")],
        env=_env(tmp_path), capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "usage:" in done.stderr
