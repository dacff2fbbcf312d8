"""Checks of a saved optimizer state before `AdamW.load_state_dict` changes anything.

A state dict is a nest of plain dicts: one saved for other parameters, by another optimizer or
with options AdamW does not implement would otherwise load partly (the old moments gone), fail
deep in a decode with no parameter named, or (block-scaled moments of a larger tensor) load
silently: the decode keeps the first elements it needs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minifloat.optim.codecs import get_state_format

__all__ = ["check_group_options", "check_saved_state", "check_structure", "local_tensor"]

# torch.optim.AdamW options that change the update; AdamW implements neither, so a state dict
# saved with one on would resume another trajectory without a word.
UNSUPPORTED_OPTIONS = ("maximize", "amsgrad")
MOMENTS = ("exp_avg", "exp_avg_sq")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (shares storage), or `t` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def check_structure(state_dict: object) -> None:
    """ValueError unless `state_dict` has an optimizer state dict's two parts."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"not an optimizer state dict (needs 'state' and 'param_groups'), got {keys}"
        )


def check_group_options(saved_group: dict[str, Any], index: int) -> None:
    """ValueError for a saved group option that AdamW would ignore but the saver applied."""
    for name in UNSUPPORTED_OPTIONS:
        if saved_group.get(name):
            raise ValueError(
                f"param group {index} was saved with {name}=True, which minifloat's AdamW "
                "does not implement"
            )


def check_saved_state(
    pid: object, saved: object, param: torch.Tensor, local_numel: int, shape: list[int] | None
) -> None:
    """ValueError unless `saved` is an AdamW state for `param`: its keys, and moments of the
    param's size (and shape, where the state dict recorded it)."""
    if not isinstance(saved, dict) or not {"step", *MOMENTS} <= saved.keys():
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(
            f"the saved state of param {pid} is not an AdamW state (needs step, exp_avg, "
            f"exp_avg_sq), got {keys}"
        )
    if shape is not None and list(param.shape) != list(shape):
        raise ValueError(
            f"the saved state of param {pid} is for shape {list(shape)}, this param has shape "
            f"{list(param.shape)} (a state dict of other parameters, or in another order)"
        )
    for key in MOMENTS:
        scaled = get_state_format(saved.get(f"{key}_format", "fp32")).scaled
        if scaled and saved.get(f"{key}_scale") is None:
            raise ValueError(f"the saved {key} of param {pid} is block-scaled but has no scale")
        held = _moment_numel(saved[key], saved.get(f"{key}_scale"), local_numel)
        if held != local_numel:
            raise ValueError(
                f"the saved {key} of param {pid} holds {held} elements, this param (shape "
                f"{list(param.shape)}) needs {local_numel}"
            )


def _moment_numel(payload: torch.Tensor, scale: torch.Tensor | None, numel: int) -> int:
    """The number of elements a saved moment holds: the tensor's own, or for a block-scaled
    payload [blocks, block] (padded to whole blocks) `numel` if its block count fits it."""
    local = local_tensor(payload)
    if scale is None:
        return local.numel()
    blocks, block = (local.shape[0], local.shape[1]) if local.dim() == 2 else (0, 1)
    if blocks == math.ceil(numel / block) and scale.numel() == blocks:
        return numel
    return blocks * block
