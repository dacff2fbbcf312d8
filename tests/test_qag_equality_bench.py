"""benchmarks/qag_equality.py end to end on the CPU (one gloo rank, its own process): the
script the GPU calls runs, and the quantized all-gather equals the unsharded model.

With inductor's `emulate_precision_casts`: by default inductor keeps a fused bf16 intermediate
unrounded, so two graphs that fuse or recompute the SwiGLU's output h differently (here the
unsharded and the FSDP2 block) quantize different values of it, whatever the all-gather does
(docs/distributed.md, sessions 14-15; since session 62's `models/swiglu.py` the two graphs differ
there for fp8-tensorwise too: w2's gradients, 4 % apart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

ROOT = Path(__file__).resolve().parents[1]


# torch 2.11's C++ code generator drops a fp32 -> bf16 -> fp32 round trip even under
# `emulate_precision_casts` (`cache_dtype_convert`; fixed in 2.13, pytorch/pytorch#185337): the
# FSDP2 block's backward then quantizes the recomputed h unrounded, and w2's gradients differ
# 2-4 % (docs/hopper_sessions.md, session 81). CUDA's code generator is not affected.
_TORCH_2_11_CPP = pytest.mark.xfail(
    TorchVersion(torch.__version__) < (2, 13),
    reason="torch < 2.13 ignores emulate_precision_casts in one CPU kernel (pytorch#185337)",
    raises=AssertionError,  # the bit_exact assert: a crash of the script still fails
    strict=False,  # 2.12 not tried
)


# fp8-delayed: its unsharded model runs the recompute region, the quantized all-gather's does not
# (recompute.applies); on the emulation neither since session 82, where torch 2.13's C++ code
# generator had miscompiled the region (pytorch#185702) and the two differed in 18 of 21
# gradients
@_TORCH_2_11_CPP
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_unsharded_and_quantized_all_gather_agree_compiled(recipe: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "qag_equality.py"), "--model", "tiny",
         "--device", "cpu", "--recipes", recipe, "--modes", "none,qag",
         "--steps", "1", "--emulate-precision-casts", "--out", str(tmp_path)],
        check=True, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    (result,) = json.loads((tmp_path / "qag_equality.json").read_text())
    assert (result["mode"], result["reference"], result["compiled"]) == ("qag", "none", True)
    assert result["bit_exact"], result["steps"]
