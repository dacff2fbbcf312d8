"""Process runtime of a training run: device choice, torchrun process group, seeding.

Distributed training is detected from ``WORLD_SIZE``, the variable torchrun sets for every
worker (torchrun's documented contract; ``init_process_group`` reads the rest of its variables
itself). Parallelism stays out of the model: the trainer wraps it with DDP or FSDP afterwards.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "Runtime",
    "all_gather_objects",
    "any_rank",
    "broadcast_object",
    "is_out_of_memory",
    "join_process_group",
    "max_across_ranks",
    "mean_across_ranks",
    "rank_device",
    "seed_everything",
    "setup",
]


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Where this process runs: its device and place in the process group."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    owns_process_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self, *, finished: bool = False) -> None:
        """Destroy the process group if :func:`setup` created it.

        ``finished``: every rank ended the run normally, so all of them reach this call; a
        barrier first keeps a rank from tearing down its connections while a peer is still in
        its last collective or writing the checkpoint after it. Leave it False on failure: a
        barrier that a failed peer never joins would hang until the process group's timeout.
        """
        if self.owns_process_group and dist.is_initialized():  # owned: more than one rank
            if finished:
                dist.barrier()
            # Release finished async work (DDP hook futures hold Python objects) before the
            # group goes: gloo threads freeing them during interpreter shutdown can abort.
            gc.collect()
            dist.destroy_process_group()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA device is available")
    return device


def setup(device: str = "auto") -> Runtime:
    """Resolve the device and, under torchrun (WORLD_SIZE > 1), join the process group.

    Each rank uses CUDA device ``LOCAL_RANK`` (torchrun's rank within its node; else ``rank %
    device_count``); the backend is NCCL on CUDA, bound to that device, and gloo on CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    base = _resolve_device(device)
    if world_size <= 1:
        if base.type == "cuda" and base.index is not None:
            torch.cuda.set_device(base)
        return Runtime(device=base)
    owns = not dist.is_initialized()
    if owns:
        base = join_process_group(base.type)
    elif base.type == "cuda":
        base = rank_device("cuda")
    return Runtime(device=base, rank=dist.get_rank(), world_size=dist.get_world_size(),
                   owns_process_group=owns)  # fmt: skip


def rank_device(device_type: str) -> torch.device:
    """This rank's device, made current: the GPU of ``LOCAL_RANK`` (torchrun's rank within its
    node; without it ``RANK % device_count``) on CUDA, else ``device_type``'s device."""
    if device_type != "cuda":
        return torch.device(device_type)
    local = os.environ.get("LOCAL_RANK")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    device = torch.device(
        "cuda", int(local) if local is not None else rank % torch.cuda.device_count()
    )
    torch.cuda.set_device(device)
    return device


def join_process_group(
    device_type: str, *, timeout: datetime.timedelta | None = None
) -> torch.device:
    """Join torchrun's process group (its environment variables) on this rank's device, which
    it returns: NCCL bound to the rank's GPU (:func:`rank_device`), gloo on CPU.

    Bound, NCCL builds its communicator for that GPU; unbound, every barrier warns that it
    guesses the device from the current one.
    """
    device = rank_device(device_type)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                            device_id=device if cuda else None)  # fmt: skip
    return device


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) so a run is reproducible."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def mean_across_ranks(value: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """Average a scalar tensor over all ranks (identity on one process)."""
    if not runtime.distributed:
        return value
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / runtime.world_size


def all_gather_objects(obj: Any, runtime: Runtime) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one process)."""
    if not runtime.distributed:
        return [obj]
    out: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(out, obj)
    return out


def max_across_ranks(value: float, runtime: Runtime) -> float:
    """The largest of every rank's ``value`` (``value`` itself on one process)."""
    if not runtime.distributed:
        return value
    box = torch.tensor([float(value)], device=runtime.device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def any_rank(flag: bool, runtime: Runtime) -> bool:
    """True on every rank if ``flag`` is true on any (identity on one process)."""
    return max_across_ranks(1.0 if flag else 0.0, runtime) > 0


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: torch.OutOfMemoryError (CUDA and others), or
    the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def broadcast_object(obj: Any, runtime: Runtime) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself on one process)."""
    if not runtime.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
