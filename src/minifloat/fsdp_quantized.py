"""Turn on the quantized FSDP2 weight all-gather for a model's `QuantLinear` layers.

    enable_quantized_all_gather(model, world_size=W)  # before fully_shard and the optimizer
    fully_shard(block) ...; fully_shard(model)
    # or in one call: apply_fsdp(model, quantized_all_gather=True)

Each QuantLinear weight becomes a `ShardedWeight` parameter (fsdp_weight.py): the same fp32
values, which FSDP2 then all-gathers quantized (1 byte a parameter for FP8 weights, 0.5 for
E2M1, plus scales; fsdp_plan.py says what and why). state_dict() still holds plain fp32 tensors
(DTensors of plain local shards once sharded), so checkpoints do not depend on this option.

Tensor- and column-scaled weights (fp8-tensorwise, fp8-delayed, fp8-rowwise's dgrad operand)
need the amax of the whole weight: one small all-reduce per weight and all-gather. After the
optimizer step, `precompute_weight_scales(model)` all-reduces the amaxes of every such weight
at once (torchao's pattern), and the all-gathers use them until a weight changes:

    optimizer.step()
    precompute_weight_scales(model)  # collective: every rank, same place
"""

from __future__ import annotations

import torch
from torch import nn

from minifloat import fsdp_plan
from minifloat.fsdp_weight import ShardedWeight
from minifloat.kernels import get_backend
from minifloat.linear import QuantLinear

__all__ = [
    "enable_quantized_all_gather",
    "all_gather_bytes",
    "plain_state_dict_hook",
    "precompute_weight_scales",
]


def _layers(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def enable_quantized_all_gather(model: nn.Module, *, world_size: int | None = None) -> int:
    """Make FSDP2 all-gather every QuantLinear weight of `model` quantized; returns how many.

    Call before `fully_shard` and before building the optimizer (the weight parameters are
    replaced, with the same values). With `world_size`, the sharding layout is checked now
    (out_features divisible by it; block-scaled weights: rows per rank a multiple of the block),
    else at the first all-gather. Raises ValueError (one line) for recipes the quantized
    all-gather cannot reproduce exactly (OCC; see `fsdp_plan.plan_for`), already sharded
    weights and weights shared between layers.
    """
    seen: dict[int, str] = {}
    count = 0
    for name, layer in _layers(model):
        plan = fsdp_plan.plan_for(layer.recipe)
        weight = layer.weight
        if type(weight).__name__ == "DTensor":
            raise ValueError(f"{name}: enable the quantized all-gather before fully_shard")
        if id(weight) in seen:
            raise ValueError(f"{name}: weight shared with {seen[id(weight)]}; not supported")
        seen[id(weight)] = name
        if world_size is not None:
            fsdp_plan.check_layout(plan, layer.out_features, layer.in_features, world_size)
        if isinstance(weight.data, ShardedWeight):
            continue
        new = nn.Parameter(ShardedWeight(weight.data), requires_grad=weight.requires_grad)
        seen[id(new)] = name
        layer.weight = new
        layer.register_state_dict_post_hook(plain_state_dict_hook)
        count += 1
    return count


def _plain(t):  # noqa: ANN001, ANN202
    """`t` with a plain local tensor: a ShardedWeight unwrapped, a DTensor rebuilt around the
    unwrapped local shard (same mesh, placements, global shape)."""
    if isinstance(t, ShardedWeight):
        return t._hp
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, ShardedWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local._hp, t.device_mesh, t.placements, run_check=False, shape=t.shape,
            stride=t.stride(),
        )  # fmt: skip
    return t


def plain_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:  # noqa: ANN001
    """state_dict post-hook: the weight as a plain fp32 tensor (or DTensor of one), so that
    checkpoints hold no ShardedWeight."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = _plain(state_dict[key])


def all_gather_bytes(model: nn.Module, world_size: int) -> dict[str, int]:
    """Bytes all-gathered per model all-gather (one forward's worth), summed over the ranks'
    inputs: "quantized" for QuantLinear weights as they are sent (values + travelling scales),
    "fp32" for the same weights in fp32, "other" for every other parameter at its dtype."""
    quant = fp32 = other = 0
    ids = set()
    for _, layer in _layers(model):
        n, k = layer.out_features, layer.in_features
        ids.add(id(layer.weight))
        fp32 += 4 * n * k
        if isinstance(layer.weight.data, ShardedWeight) or _is_sharded_quantized(layer.weight):
            plan = fsdp_plan.plan_for(layer.recipe)
            quant += world_size * fsdp_plan.payload_bytes(plan, n // world_size, k)
        else:
            quant += 4 * n * k
    for p in model.parameters():
        if id(p) not in ids:
            other += p.numel() * p.element_size()
    return {"quantized": quant, "fp32": fp32, "other": other}


def _is_sharded_quantized(p) -> bool:  # noqa: ANN001
    return isinstance(getattr(p, "_local_tensor", None), ShardedWeight)


@torch.no_grad()
def precompute_weight_scales(model: nn.Module) -> int:
    """All-reduce the global amaxes of every sharded QuantLinear weight of `model` that needs
    them, with one MAX all-reduce per process group (one in all for a model sharded on one
    mesh), and store them on the shards; returns how many weights got them.

    Call after the optimizer step (and after anything else that writes weights), on every rank
    at the same point: it is collective. FSDP2's all-gathers then take the weights' tensor and
    column scales from the stored amaxes instead of one all-reduce per weight and all-gather
    (forward and backward, every micro-batch). The values are those the per-weight
    all-reduces give (the reduction is elementwise), so the scales are the same bit for bit.

    A weight changed after this call (any in-place write: its version counters move) or whose
    recipe changed falls back to its own all-reduce at its next all-gather; so does a weight
    that was never precomputed. Every rank makes that choice alike as long as all ranks run
    the same ops on their shards, as data-parallel training does.
    """
    by_group: dict[int, tuple[object, list]] = {}
    for _, layer in _layers(model):
        param = layer.weight
        shard = getattr(param, "_local_tensor", None)
        if not isinstance(shard, ShardedWeight):
            continue  # not sharded (yet), or a plain all-gather
        plan = fsdp_plan.plan_for(layer.recipe)
        backend = get_backend(layer.backend, shard.device)
        amaxes = fsdp_plan.shard_amaxes(backend, plan, shard._hp)
        if not amaxes:
            continue  # row or block scales: local, nothing to all-reduce
        mesh = param.device_mesh
        group = mesh.get_group() if mesh.size() > 1 else None
        entry = by_group.setdefault(id(group), (group, []))
        entry[1].append((param, shard, plan, amaxes))
    count = 0
    for group, entries in by_group.values():
        flat = fsdp_plan.global_amaxes([a for *_, amaxes in entries for a in amaxes], group)
        for param, shard, plan, amaxes in entries:
            shard.store_amaxes(param, plan, flat[: len(amaxes)])
            flat = flat[len(amaxes) :]
            count += 1
    return count
