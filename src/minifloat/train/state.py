"""Gathering and restoring the model/optimizer part of a training checkpoint.

Plain and DDP models use ordinary state dicts. FSDP2 models hold sharded DTensors; their full
(unsharded) state is gathered to CPU through ``torch.distributed.checkpoint.state_dict`` so the
checkpoint file looks the same whatever the parallelism. Non-persistent buffers are not in
``state_dict()`` but may be training state; they are saved per rank. (The fp8-delayed amax
history is persistent since 2026-11-23; checkpoints written before keep it among these.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["extra_buffers", "load_full_state", "full_state", "restore_buffers"]


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, fsdp: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state), unsharded; every rank must call it under FSDP."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(model, optimizer, options=options)
    return model.state_dict(), optimizer.state_dict()


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
    *,
    fsdp: bool,
) -> None:
    """Inverse of :func:`full_state` (strict: missing or unexpected keys raise)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=options,
        )
        return
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optim_state)


def extra_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of this rank's own buffers: the non-persistent ones (those ``state_dict()``
    leaves out) and the fp8-delayed amax histories.

    A history is in ``state_dict()`` too, but under data parallelism every rank records the
    amaxes of its own micro-batches, so each rank's history is its own state: a sharded
    checkpoint keeps one copy of a replicated buffer, which would give every rank rank 0's.
    """
    persistent = set(model.state_dict().keys())
    return {
        name: buf.detach().cpu().clone()
        for name, buf in model.named_buffers()
        if name not in persistent or name.endswith("amax_history")
    }


def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Put buffers saved by :func:`extra_buffers` back, on each buffer's current device."""
    for name, value in buffers.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        current = getattr(module, attr)
        setattr(module, attr, value.to(current.device))
