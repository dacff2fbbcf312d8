"""Turn on the quantized FSDP2 weight all-gather for a model's `QuantLinear` layers.

    enable_quantized_all_gather(model, world_size=W)  # before fully_shard and the optimizer
    fully_shard(block) ...; fully_shard(model)
    # or in one call: apply_fsdp(model, quantized_all_gather=True)

Each QuantLinear weight becomes a `ShardedWeight` parameter (fsdp_weight.py): the same fp32
values, which FSDP2 then all-gathers quantized (1 byte a parameter for FP8 weights, 0.5 for
E2M1, plus scales; fsdp_plan.py says what and why). state_dict() still holds plain fp32 tensors
(DTensors of plain local shards once sharded), so checkpoints do not depend on this option.

Each shard is quantized once per step and kept (fsdp_weight.py): the backward's re-gather sends
the forward's bytes. Left to the all-gathers, the forward's quantizes each weight on its own,
and tensor- and column-scaled weights (fp8-tensorwise, fp8-delayed, fp8-rowwise's dgrad
operand) all-reduce the amax of the whole weight there, one small all-reduce each. After the
optimizer step, `precompute_quantized_weights(model)` does it for every weight at once: one
all-reduce of all the amaxes (torchao's pattern for its scales) and, on the GPU, one compiled
call per block of weights that quantizes them all; the all-gathers then only send:

    optimizer.step()
    precompute_quantized_weights(model)  # collective: every rank, same place
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
    "precompute_quantized_weights",
]


def _layers(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def enable_quantized_all_gather(model: nn.Module, *, world_size: int | None = None) -> int:
    """Make FSDP2 all-gather every QuantLinear weight of `model` quantized; returns how many.

    Call before `fully_shard`. The weight parameters stay the same objects (their tensors are
    swapped for quantizing ones with the same values), so an optimizer built before still
    updates them. With `world_size`, the sharding layout is checked now
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
        # swapped into the same Python object, not assigned: an optimizer built before this
        # call holds that object, and would otherwise never update the weight again
        torch.utils.swap_tensors(weight, new)
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


def _by_block(model: nn.Module) -> list[list[QuantLinear]]:
    """The sharded quantized-all-gather QuantLinears of `model`, grouped by the innermost FSDP
    module that all-gathers them (a block) and by backend, in module order."""
    from torch.distributed.fsdp import FSDPModule

    owner: dict[QuantLinear, nn.Module] = {}
    for module in model.modules():  # pre-order: an inner FSDP module overrides its parent
        if isinstance(module, FSDPModule) or module is model:
            for sub in module.modules():
                if isinstance(sub, QuantLinear) and _is_sharded_quantized(sub.weight):
                    owner[sub] = module
    blocks: dict[tuple[int, str], list[QuantLinear]] = {}
    for layer, module in owner.items():
        blocks.setdefault((id(module), layer.backend), []).append(layer)
    return list(blocks.values())


@torch.no_grad()
def precompute_quantized_weights(model: nn.Module) -> int:
    """Quantize every sharded QuantLinear weight of `model` for its next all-gathers; returns
    how many. Collective: call it after the optimizer step (and after anything else that writes
    weights), on every rank at the same point.

    First the global amaxes that tensor and column scales need (fp8-tensorwise, fp8-delayed,
    fp8-rowwise's dgrad operand), with one MAX all-reduce per process group instead of one per
    weight and all-gather; then each shard's quantized values and scales, one compiled call per
    block of weights on the GPU (`fsdp_plan.quantize_weights`). The all-gathers then send them
    as they are. The values are those each all-gather would compute (the same quantizers and
    the same elementwise amax reduction), bit for bit.

    The next forward's all-gathers send these (and its backward's re-gathers the same); a
    later forward quantizes anew unless this is called again in between (fsdp_weight.py says
    why: compiled writes move no version counter). A weight written eagerly after this call,
    whose recipe changed, or (fp8-delayed) whose amax history moved is quantized again at its
    next all-gather too, all-reducing its amax there. Every rank makes that choice alike as
    long as all ranks run the same ops on their shards, as data-parallel training does.
    """
    blocks = []
    for layers in _by_block(model):
        shards = [layer.weight._local_tensor for layer in layers]
        plans = [fsdp_plan.plan_for(layer.recipe) for layer in layers]
        backend = get_backend(layers[0].backend, shards[0].device)
        hps = [shard._hp for shard in shards]
        amaxes = backend.kernel(fsdp_plan.shard_amaxes_many, hps[0])(backend, plans, hps)
        mesh = layers[0].weight.device_mesh
        group = mesh.get_group() if mesh.size() > 1 else None
        blocks.append((layers, shards, plans, backend, hps, amaxes, group))
    local: dict[int, tuple[object, list[torch.Tensor]]] = {}  # per process group, block order
    for *_, amaxes, group in blocks:
        local.setdefault(id(group), (group, []))[1].extend(a for per in amaxes for a in per)
    reduced = {key: iter(fsdp_plan.global_amaxes(flat, group))
               for key, (group, flat) in local.items()}  # fmt: skip
    count = 0
    for layers, shards, plans, backend, hps, amaxes, group in blocks:
        it = reduced[id(group)]  # one all-reduce per group, split back in the same order
        amaxes = [[next(it) for _ in per] for per in amaxes]
        histories = [layer.amax_history if p.delayed is not None else None
                     for layer, p in zip(layers, plans, strict=True)]  # fmt: skip
        quantized = backend.kernel(fsdp_plan.quantize_weights, hps[0])(
            backend, plans, hps, amaxes, histories
        )
        for layer, shard, plan, q in zip(layers, shards, plans, quantized, strict=True):
            shard.store_quantized(layer, plan, q, fresh=True)
            count += 1
    return count
