"""Quantized FSDP2 weight all-gather (minifloat.fsdp_quantized) in one process: what it refuses,
GatheredWeight serving only QuantLinear, the precompute's batched quantization against one shard
at a time, and the multipliers DGE gets. The 2-rank tests are in test_fsdp_quantized.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fsdp_nets import RECIPES, Net, net
from minifloat import fsdp_plan, recipes
from minifloat.fsdp_quantized import enable_quantized_all_gather
from minifloat.kernels import EmulatedBackend, operand

# ---- refusals (one process) -------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["fp4", "fp4-occ"])
def test_occ_recipes_are_refused(recipe):
    with pytest.raises(ValueError, match="OCC"):
        enable_quantized_all_gather(net(recipe))


@pytest.mark.parametrize(
    "recipe", ["fp8-tensorwise:scale_format=pow2", "fp4-dge:scale_format=pow2"]
)
def test_power_of_two_scales_are_refused(recipe):
    with pytest.raises(ValueError, match="pow2 scales"):
        fsdp_plan.plan_for(recipes.get(recipe))


def test_split_weight_blocks_are_refused():
    model = Net("fp8-blockwise", 128, 128)  # 64 rows a rank: a 128-row block would be split
    with pytest.raises(ValueError, match="multiple of the 128-row blocks"):
        enable_quantized_all_gather(model, world_size=2)
    assert enable_quantized_all_gather(model, world_size=1) == 4


def test_uneven_shards_are_refused():
    with pytest.raises(ValueError, match="divisible by the 3 ranks"):
        enable_quantized_all_gather(net("fp8-rowwise"), world_size=3)


@pytest.mark.parametrize("world", [0, -2, 2.0])
def test_world_size_must_be_a_positive_int(world):
    """0 divided by zero; -2 and 2.0 were accepted."""
    with pytest.raises(ValueError, match=f"world_size must be a positive int, got {world!r}"):
        enable_quantized_all_gather(net("fp8-rowwise"), world_size=world)


def test_enabled_unsharded_model_is_unchanged():
    # Wrapped but not sharded: the same outputs and gradients as the plain model (the wrapper
    # only changes what FSDP2 all-gathers); its state_dict holds plain tensors.
    ref, model = net("fp4-dge"), net("fp4-dge")
    assert enable_quantized_all_gather(model) == 4
    x = torch.randn(8, 64)
    y, y_ref = model(x), ref(x)
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        assert type(p.grad) is torch.Tensor and torch.equal(p.grad, p_ref.grad)
    assert all(type(v) is torch.Tensor for v in model.state_dict().values())


def test_an_optimizer_built_before_keeps_updating_the_weights():
    """The weights were replaced by new Parameters, which an optimizer built before the call
    did not hold: its steps left them unchanged, without an error."""
    ref, model = net("fp8-tensorwise"), net("fp8-tensorwise")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = list(model.parameters())
    initial = [p.detach().clone() for p in held]
    assert enable_quantized_all_gather(model) == 4
    assert all(a is b for a, b in zip(held, model.parameters(), strict=True))
    x = torch.randn(8, 64)
    for m, o in ((model, opt), (ref, opt_ref)):
        m(x).sum().backward()
        o.step()
    for p, p_ref, p0 in zip(model.parameters(), ref.parameters(), initial, strict=True):
        assert torch.equal(p.detach(), p_ref.detach())
        assert not torch.equal(p.detach(), p0)  # the step moved every weight


def test_gathered_weight_serves_only_quantlinear():
    model = net("fp8-rowwise")
    enable_quantized_all_gather(model)
    shard = model.layers[0].up.weight.data
    payload, meta = shard.fsdp_pre_all_gather(_OneRankMesh(), shard.shape, shard.stride(),
                                              model.layers[0].up, None)  # fmt: skip
    gathered, _ = shard.fsdp_post_all_gather(payload, meta, torch.float32)
    assert gathered.shape == shard.shape and gathered.dtype == torch.float32
    for misuse in (lambda: gathered + 1, lambda: F.linear(torch.ones(2, 64), gathered)):
        with pytest.raises(RuntimeError, match="only QuantLinear"):
            misuse()


class _OneRankMesh:
    """The two DeviceMesh methods fsdp_pre_all_gather uses, for one rank without a group."""

    ndim = 1

    def size(self) -> int:
        return 1


# ---- the precompute's batched quantization equals one shard at a time ---------------------------

BATCH_SHAPES = [(64, 96), (32, 96), (128, 256)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_batch_equals_one_at_a_time(recipe):
    # precompute_quantized_weights quantizes a block's shards in one compiled call on the GPU;
    # the all-gathers one shard at a time, eagerly. Both must send the same bits.
    plan = fsdp_plan.plan_for(recipes.get(recipe))
    backend = EmulatedBackend()
    gen = torch.Generator().manual_seed(3)
    shapes = [(256, 256)] * 2 if recipe == "fp8-blockwise" else BATCH_SHAPES
    ws = [torch.randn(s, generator=gen) * 10 ** torch.randn(1, generator=gen) for s in shapes]
    ws[0][0, :3] = torch.tensor([0.0, -448.0 * 8, 1e-9])  # zero, a large and a tiny entry
    history = torch.rand(3, 16, generator=gen) if plan.delayed is not None else None
    plans, histories = [plan] * len(ws), [history] * len(ws)
    amaxes = fsdp_plan.shard_amaxes_many(backend, plans, ws)
    compiled = torch.compile(fsdp_plan.quantize_weights, fullgraph=True)
    got = compiled(backend, plans, ws, amaxes, histories)
    for w, a, one in zip(ws, amaxes, got, strict=True):
        want = fsdp_plan.quantize_weight(backend, plan, w, a, history)
        leaves = [pytree.tree_leaves(x) for x in (one, want)]
        assert [u is None for u in leaves[0]] == [v is None for v in leaves[1]], recipe
        pairs = zip(*leaves, strict=True)
        assert all(u is None or torch.equal(u, v) for u, v in pairs), recipe


@pytest.mark.parametrize("recipe", ["fp4-dge", "fp4-dge:scaling.weight=tensor", "fp8-rowwise"])
def test_dge_gets_the_multipliers_the_fprop_weight_was_rounded_with(recipe):
    # The sharded DGE hook evaluates f' at w * m ("inv" scales), as the unsharded layer does:
    # m of the fprop operand, in the weight's layout (global amax for tensor scales)
    plan = fsdp_plan.plan_for(recipes.get(recipe))
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    amaxes = fsdp_plan.global_amaxes(fsdp_plan.shard_amaxes(EmulatedBackend(), plan, w), None)
    *_, scale, m = fsdp_plan.quantize_weight(EmulatedBackend(), plan, w, amaxes, None)
    spec = recipes.get(recipe).fprop.rhs
    _, want_scale, want_m = operand.quantize_operand(
        w, spec.fmt, spec.granularity, scale_format=spec.scale_format, with_multiplier=True
    )
    assert torch.equal(scale, want_scale) and torch.equal(m, want_m)
