"""minifloat.train.runtime on two CPU ranks (gloo)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from gloo_ranks import WORLD, spawn
from minifloat.train.runtime import Runtime

LATE = 1.5  # seconds rank 1 spends "writing its checkpoint" before it closes


def _close_after(rank: int, out: Path, finished: bool) -> None:
    runtime = Runtime(device=torch.device("cpu"), rank=rank, world_size=WORLD,
                      owns_process_group=True)  # fmt: skip
    if rank == 1:
        time.sleep(LATE)
        (out / "entered").write_text(repr(time.time()))
    runtime.close(finished=finished)
    assert not dist.is_initialized()
    if rank == 0:
        (out / "left").write_text(repr(time.time()))


def test_a_finished_run_leaves_the_group_together(tmp_path: Path) -> None:
    """No rank tears gloo down while a peer is still working (the likely cause of a CI hang
    after a checkpoint that rank 0 wrote once rank 1 had left): rank 0's close waits for
    rank 1's."""
    spawn(_close_after, tmp_path, True)
    entered, left = (float((tmp_path / name).read_text()) for name in ("entered", "left"))
    assert left >= entered


def test_a_failed_run_leaves_without_waiting(tmp_path: Path) -> None:
    """After a failure a peer may never reach close: rank 0 must not wait for it."""
    spawn(_close_after, tmp_path, False)
    entered, left = (float((tmp_path / name).read_text()) for name in ("entered", "left"))
    assert left < entered


def _join_with_setup(rank: int, port: int) -> None:
    import os

    from minifloat.train.runtime import setup

    # spawn's own group: setup must make the run's. Both ranks leave it together: a rank that
    # tore it down right after its own init once closed the pairs its peer was still connecting
    # ("Gloo connectFullMesh failed ... Connection closed by peer", CI in session 77)
    dist.barrier()
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    runtime = setup("cpu")
    assert runtime.owns_process_group and dist.get_backend() == "gloo"
    assert (runtime.rank, runtime.world_size, runtime.device) == (rank, WORLD, torch.device("cpu"))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == WORLD * (WORLD + 1) / 2
    runtime.close(finished=True)
    assert not dist.is_initialized()


def test_setup_joins_torchruns_group_from_its_variables() -> None:
    """Under torchrun (RANK, WORLD_SIZE, MASTER_*), setup makes the group and owns it."""
    from gloo_ranks import _free_port

    spawn(_join_with_setup, _free_port())
