"""benchmarks/profile_trees.sh: variant trees made from patches, each tree's profiled process on
its GPU with its own inductor cache, the generated code and every log packed in one tarball, and
an exit status that says whether all ran. The processes here are a stand-in that records how it
was called (the real one is benchmarks/train_e2e.py, tested on its own)."""

import subprocess
import tarfile
from pathlib import Path

from scripts import run_shell_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_shell_benchmark("profile_trees", *args, timeout=120, **env)


def _patch(tmp_path: Path) -> Path:
    """A patch that appends one line to src/minifloat/occ.py."""
    lines = (ROOT / "src" / "minifloat" / "occ.py").read_text().splitlines()
    n = len(lines)
    body = [f" {line}" for line in lines[-3:]] + ["+# variant"]
    text = "\n".join(
        ["--- a/src/minifloat/occ.py", "+++ b/src/minifloat/occ.py", f"@@ -{n - 2},3 +{n - 2},4 @@"]
        + body
    )
    path = tmp_path / "variant.patch"
    path.write_text(text + "\n")
    return path


def _fake_python(tmp_path: Path) -> Path:
    """Stands in for python3: logs its GPU, cache and arguments, leaves one large and one small
    generated file in its inductor cache, and a results file where it is given an --out-dir."""
    fake = tmp_path / "fake_python"
    fake.write_text(
        "#!/bin/bash\n"
        'echo "gpu=$CUDA_VISIBLE_DEVICES cache=$TORCHINDUCTOR_CACHE_DIR args=$*"\n'
        'mkdir -p "$TORCHINDUCTOR_CACHE_DIR/ab"\n'
        "head -c 30000 /dev/zero | tr '\\0' x > \"$TORCHINDUCTOR_CACHE_DIR/ab/big.py\"\n"
        'echo small > "$TORCHINDUCTOR_CACHE_DIR/ab/small.py"\n'
        "while [ $# -gt 0 ]; do case $1 in --out-dir) d=$2 ;; --tag) t=$2 ;; esac; shift; done\n"
        '[ -n "${d:-}" ] && echo "[]" > "$d/train_e2e_1.3B_ours_${t}_h200_x.json"\n'
        "exit 0\n"
    )
    fake.chmod(0o755)
    return fake


def test_prepare_applies_a_patch_to_a_copy_and_refuses_what_does_not_apply(tmp_path):
    trees = tmp_path / "trees"
    done = _run("--prepare", "v1", str(_patch(tmp_path)), TREES=str(trees))
    assert done.returncode == 0, done.stderr
    occ = (trees / "v1" / "src" / "minifloat" / "occ.py").read_text()
    assert occ.endswith("# variant\n")
    assert (trees / "v1" / "benchmarks" / "train_e2e.py").is_file()
    assert not (trees / "v1" / "benchmarks" / "results").exists()
    assert not (ROOT / "src" / "minifloat" / "occ.py").read_text().endswith("# variant\n")
    bad = tmp_path / "bad.patch"
    header = "--- a/src/minifloat/occ.py\n+++ b/src/minifloat/occ.py\n"
    bad.write_text(header + "@@ -1,1 +1,1 @@\n-x\n+y\n")
    refused = _run("--prepare", "v2", str(bad), TREES=str(trees))
    assert refused.returncode == 1 and "does not apply" in refused.stderr
    assert _run("--prepare", "work", str(bad), TREES=str(trees)).returncode == 2


def test_trees_alternate_between_gpus_and_come_back_with_their_code(tmp_path):
    trees, out = tmp_path / "trees", tmp_path / "out"
    assert _run("--prepare", "v1", str(_patch(tmp_path)), TREES=str(trees)).returncode == 0
    done = _run("fp4", "work,v1", TREES=str(trees), OUT=str(out), TAG="t",
                PY=str(_fake_python(tmp_path)))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line for line in done.stdout.splitlines() if " rc=" in line) == [
        "v1 rc=0",
        "work rc=0",
    ]
    with tarfile.open(out / "profile_trees_t.tar.gz") as tar:
        names = {n.lstrip("./") for n in tar.getnames()}
        logs = {t: tar.extractfile(f"./{t}.log").read().decode() for t in ("work", "v1")}
        diff = tar.extractfile("./diff_work_v1.md").read().decode()
    assert {"code/work/big.py", "code/v1/big.py", "status.txt"} <= names
    # the first tree's results against the other's, by benchmarks/profile_diff.py
    assert "args=benchmarks/profile_diff.py " in diff
    assert "train_e2e_1.3B_ours_t_work_h200_x.json" in diff
    assert "train_e2e_1.3B_ours_t_v1_h200_x.json" in diff
    assert not any(n.endswith("small.py") for n in names)  # only the large generated files
    assert logs["work"].startswith("gpu=0 ") and logs["v1"].startswith("gpu=1 ")
    assert "./benchmarks/train_e2e.py" in logs["work"]
    assert f"{trees}/v1/benchmarks/train_e2e.py" in logs["v1"]
    for tree, log in logs.items():
        assert f"--rows fp4 --profile fp4 --tag t_{tree}" in log
        assert "--layers 6" in log and "--model 1.3B" in log
    assert logs["work"].split()[1] != logs["v1"].split()[1]  # a cache of its own each


def test_a_failed_tree_fails_the_call_and_a_missing_tree_runs_nothing(tmp_path):
    out = tmp_path / "out"
    missing = _run("fp4", "work,nope", TREES=str(tmp_path / "trees"), OUT=str(out))
    assert missing.returncode == 2 and "--prepare nope" in missing.stderr
    assert not out.exists()
    failed = _run("fp4", "work", OUT=str(out), PY="false", GPUS="1")
    assert failed.returncode == 1 and "work rc=1" in failed.stdout
    assert (out / "profile_trees_trees.tar.gz").is_file()  # the log still comes back
    assert _run().returncode == 2 and "usage:" in _run().stderr
