"""benchmarks/train_e2e.py's optimizer choice: torch's fused AdamW for fp32 states, minifloat's
AdamW for the presets that keep fp32 weights, one-line errors before any GPU time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifloat.optim import AdamW
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("train_e2e")


def test_optimizer_per_state_preset(bench):
    net = nn.Linear(64, 64)
    assert type(bench.make_optimizer(net, "fp8-fp16")) is AdamW
    opt = bench.make_optimizer(net, "fp8-fp16")
    assert (opt.exp_avg_dtype, opt.exp_avg_sq_dtype) == ("fp8", "fp16")
    if torch.cuda.is_available():  # torch's fused AdamW needs a CUDA (or MPS) build to step
        assert type(bench.make_optimizer(net.cuda(), "fp32")) is torch.optim.AdamW


@pytest.mark.parametrize(("name", "message"), [("fp9", "choose one of"), ("lean", "bf16 weights")])
def test_bad_state_presets_fail_before_gpu_time(bench, name, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(["--model", "tiny", "--device", "cpu", "--optim-states", name])
