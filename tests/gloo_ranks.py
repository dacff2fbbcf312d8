"""Run a test body on 2 CPU ranks: processes spawned by the test, joined in a gloo group."""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    fn: Callable[..., None], *args: object, world: int = WORLD, timeout_s: float | None = None
) -> None:
    """Call ``fn(rank, *args)`` on `world` ranks; a failure on any rank fails the caller.
    ``timeout_s``: how long a collective waits for a missing rank before it raises (gloo's
    default is 30 minutes; a test of a hang sets a short one, to fail rather than hang)."""
    mp.spawn(_entry, args=(fn, _free_port(), args, world, timeout_s), nprocs=world, join=True)


def _entry(
    rank: int, fn: Callable[..., None], port: int, args: tuple, world: int, timeout_s: float | None
) -> None:
    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)  # what torchrun sets; the trainer joins this group
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    try:
        fn(rank, *args)
        if dist.is_initialized():  # fn may have left the group itself (Runtime.close)
            # Both ranks leave together: tearing gloo down while the peer still has collectives
            # in flight aborted a process once ("terminate called without an active exception").
            dist.barrier()
            # Drop finished async work (DDP hook futures hold Python objects) while the
            # interpreter is fully alive; gloo worker threads releasing them at finalization abort.
            gc.collect()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Passed: leave without interpreter finalization, the other place that abort happened in CI
    # (pytorch/pytorch#179291). A failure above still raises and mp.spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
