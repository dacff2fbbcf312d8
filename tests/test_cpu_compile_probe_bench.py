"""benchmarks/cpu_compile_probe.py: compiled fp8-delayed on the CPU against eager, one step of
the tiny LLaMA. Under torch 2.13.0 inductor's C++ vector code gives 18 of 21 gradients wrong by
up to ~30 % (pytorch/pytorch#185702, a local buffer of an outer-loop fusion over a tiled loop;
docs/hopper_sessions.md, session 81) in the kernel fusing the ffn norm's backward with the
recompute region's FP8 casts; scalar code (cpp.simdlen=1) is right. Since session 82 the library
leaves the region out on the emulation (recompute.py), and compiled equals eager to rounding;
`--region always` puts it back to pin the bug. CPU only: the GPU's Triton code is another
generator."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_compile_probe  # noqa: E402

_TORCH = TorchVersion(torch.__version__)


_TORCH_BUG = pytest.mark.xfail(
    (2, 13) <= _TORCH < (2, 14),
    reason="torch 2.13's C++ outer-loop fusion over a tiled loop (pytorch#185702)",
    raises=AssertionError,
    strict=True,  # a torch with the fix passes: then drop this mark
)


@pytest.mark.parametrize(
    ("region", "simdlen"),
    [
        ("auto", None),  # what the library does: no region on the emulation
        pytest.param("always", None, marks=_TORCH_BUG),  # the region on the emulation: the bug
        ("always", 1),  # scalar code: right with the region too
    ],
)
def test_compiled_fp8_delayed_equals_eager_on_cpu(region, simdlen, tmp_path: Path) -> None:
    argv = ["--out-dir", str(tmp_path), "--region", region]
    argv += [] if simdlen is None else ["--simdlen", str(simdlen)]
    rec = cpu_compile_probe.main(argv)
    assert rec["compiled_loss"] == rec["eager_loss"]
    assert rec["differ_past_1e-5"] == 0, rec["rel"]
