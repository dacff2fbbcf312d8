"""benchmarks/head_loss.py: every variant computes the same loss; a one-line exit without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifloat.train.head_loss import DeferredHead
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("head_loss")


def test_variants_agree_on_the_cpu(bench):
    torch._dynamo.reset()
    head = DeferredHead(nn.Linear(32, 300, bias=False))
    hidden = torch.randn(96, 32, requires_grad=True)
    targets = torch.randint(0, 300, (96,))
    fns = bench.variants(head, [40, 96])
    assert list(fns) == ["unchunked, eager loss", "unchunked, compiled loss", "chunked 40",
                         "chunked 96"]  # fmt: skip
    losses = []
    for fn in fns.values():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(fn(hidden, targets)[0].detach())
        bench.step(fn, hidden, head, targets)
        assert hidden.grad is None and head.weight.grad is None  # step clears them
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], rtol=1e-6, atol=0.0)
    torch._dynamo.reset()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_needs_a_gpu(bench):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--tokens", "64"])
