"""PeakMemory: training's peak with diagnostic passes kept out (the SQNR probe's)."""

from __future__ import annotations

import pytest
import torch

from minifloat.train.memory import PeakMemory


def test_cpu_reads_no_peak_and_runs_the_pass() -> None:
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    assert memory.bytes() is None and not memory.enabled
    assert memory.apart(lambda: 42) == (42, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pass_apart_leaves_the_training_peak_alone() -> None:
    device = torch.device("cuda")
    memory = PeakMemory(device)
    memory.reset()
    base = torch.cuda.memory_allocated(device)  # what earlier tests left allocated
    train = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # 64 MiB "training"
    del train
    trained = memory.bytes()
    assert trained >= base + 64 * 2**20

    def probe() -> int:  # a diagnostic that needs four times as much
        return torch.ones(256 * 2**20, dtype=torch.uint8, device=device).numel()

    numel, peak = memory.apart(probe)
    assert numel == 256 * 2**20 and peak >= base + 256 * 2**20
    assert memory.bytes() == trained  # the probe's 256 MiB did not enter training's peak
    more = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)  # training goes on
    assert memory.bytes() >= base + 128 * 2**20 > trained
    del more
