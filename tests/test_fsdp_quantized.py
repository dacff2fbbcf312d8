"""Quantized FSDP2 weight all-gather (minifloat.fsdp_quantized) on 2 gloo CPU ranks.

Against the unsharded model in one process (each rank's batch shard run through it, gradients
summed as FSDP averages them): the all-gathered weight operands equal `backend.quantize(full
weight)` (values and scales), the forward outputs are equal bit for bit, the gradients too
(tolerance below for DGE), and each all-gather input holds 1 byte a parameter (FP8) or 0.5
(E2M1) plus the scales that travel. What one process can check (refusals, the precompute's
batched quantization) is in test_fsdp_quantized_local.py.
"""

from __future__ import annotations

import copy
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_nets import RECIPES, net
from gloo_ranks import WORLD, spawn
from minifloat import delayed, fsdp_plan, recipes
from minifloat.distributed import apply_fsdp
from minifloat.fsdp_quantized import (
    all_gather_bytes,
    precompute_quantized_weights,
)
from minifloat.fsdp_weight import GatheredWeight, ShardedWeight, _quantized_key
from minifloat.kernels import EmulatedBackend
from minifloat.linear import QuantLinear
from tolerances import DGE_GRAD_REL_TOL

# QuantLinear weights (of the 4) whose scales need a global amax, by recipe: tensor scales
# (fp8-tensorwise), fp8-delayed's weight amax, fp8-rowwise's column-scaled dgrad operand.
AMAX_WEIGHTS = {"fp8-tensorwise": 4, "fp8-delayed": 4, "fp8-rowwise": 4}
AMAX_WEIGHTS["fp8-rowwise:scale_format=fp32"] = 4
AMAX_WEIGHTS.update({r: 0 for r in RECIPES if r not in AMAX_WEIGHTS})  # row and block scales
# Bytes of values per parameter in the all-gather input, by weight format.
VALUE_BYTES = {"e4m3": 1.0, "e5m2": 1.0, "e2m1": 0.5}


def _data(dim: int, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(10 + step)
    x = torch.randn(WORLD * 8, dim, generator=gen)
    t = torch.randint(0, 8, (WORLD * 8,), generator=gen)
    return list(x.chunk(WORLD)), list(t.chunk(WORLD))


def _counting(record: list):  # noqa: ANN202
    """fsdp_pre_all_gather that records (module, bytes of each all-gather input)."""
    original = ShardedWeight.fsdp_pre_all_gather

    def pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001, ANN202
        tensors, meta = original(self, mesh, outer_size, outer_stride, module, mp_policy)
        record.append((module, [t.numel() * t.element_size() for t in tensors]))
        return tensors, meta

    return pre_all_gather


def _check_operands(model: nn.Module, ref: nn.Module) -> None:
    """The gathered operands equal the operands quantized from the full weight, bit for bit."""
    backend = EmulatedBackend()
    for block, ref_block in zip(model.layers, ref.layers, strict=True):
        block.unshard()
        for name in ("up", "down"):
            layer, ref_layer = getattr(block, name), getattr(ref_block, name)
            assert isinstance(layer.weight, GatheredWeight)
            plan = fsdp_plan.plan_for(layer.recipe)
            for g in plan.operands:
                got = layer.weight.operand(backend, g.spec, transpose=g.transpose)
                scale = None  # fp8-delayed: the scale of the weight's amax history
                if layer.recipe.delayed is not None:
                    scale = delayed.history_scale(
                        ref_layer.amax_history, delayed.WEIGHT, delayed.amax(ref_layer.weight),
                        g.spec.fmt, layer.recipe.delayed,
                    )  # fmt: skip
                want = backend.quantize(
                    ref_layer.weight, g.spec, transpose=g.transpose, scale=scale
                )
                assert torch.equal(got.values(), want.values()), (layer.recipe.name, name)
                assert torch.equal(got.scale, want.scale), (layer.recipe.name, name)
                assert got.granularity == want.granularity and got.data.dtype == want.data.dtype
        block.reshard()


def _check_bytes(record: list, model: nn.Module, recipe: str) -> None:
    """Each all-gather input: values at 1 or 0.5 byte a parameter, plus travelling scales."""
    plan = fsdp_plan.plan_for(recipes.get(recipe))
    per_gather = 0
    for module, sizes in record:
        rows, cols = module.out_features // WORLD, module.in_features
        sent = sum(sizes)
        assert sent == fsdp_plan.payload_bytes(plan, rows, cols)
        values = sum(VALUE_BYTES[g.spec.fmt] for g in plan.operands) * rows * cols
        scales = sent - values  # [rows, 1] or block fp32 scales; none for tensor scales
        assert scales in (0, 4 * rows, 4 * (rows // 128) * -(-cols // 128)), (recipe, scales)
        assert values == sizes[0] + (sizes[2] if len(plan.operands) == 2 else 0)
        per_gather += sent
    # Forward and backward all-gather every block (reshard_after_forward), on each rank.
    assert per_gather * WORLD == 2 * all_gather_bytes(model, WORLD)["quantized"], recipe


def _reference_grads(ref: nn.Module, xs: list, ts: list, rank: int, recipe: str) -> None:
    """Gradients FSDP should produce: the mean over ranks of each batch shard's gradient."""
    if recipe == "fp8-delayed":  # the amax history is per rank state: a replica per rank
        F.cross_entropy(ref(xs[rank]), ts[rank]).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        return
    for x, t in zip(xs, ts, strict=True):
        (F.cross_entropy(ref(x), t) / WORLD).backward()


def _counting_all_reduces(record: list):  # noqa: ANN202
    """torch.distributed.all_reduce that records each call (the amax all-reduces: FSDP2 itself
    all-gathers and reduce-scatters)."""
    original = dist.all_reduce

    def all_reduce(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        record.append(args[0].numel())
        return original(*args, **kwargs)

    return mock.patch.object(dist, "all_reduce", all_reduce)


def _precompute(model: nn.Module, recipe: str) -> None:
    """precompute_quantized_weights: every weight quantized, its global amaxes in one
    all-reduce (none for row and block scales)."""
    record: list = []
    with _counting_all_reduces(record):
        assert precompute_quantized_weights(model) == 4
    assert len(record) == min(1, AMAX_WEIGHTS[recipe]), (recipe, record)


def _counting_quantizations(record: list):  # noqa: ANN202
    """fsdp_plan.quantize_weight that records each shard it quantizes."""
    original = fsdp_plan.quantize_weight

    def quantize_weight(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        record.append(args[2].shape)
        return original(*args, **kwargs)

    return mock.patch.object(fsdp_plan, "quantize_weight", quantize_weight)


def _check_grads(model: nn.Module, ref: nn.Module, recipe: str, step: int) -> None:
    """The sharded model's full gradients equal the reference's (DGE weights: within
    DGE_GRAD_REL_TOL)."""
    dge = recipes.get(recipe).dge is not None
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        grad = p.grad.full_tensor()
        if dge and name.endswith("weight") and "head" not in name:
            err = (grad - p_ref.grad).abs().max() / p_ref.grad.abs().max()
            assert err <= DGE_GRAD_REL_TOL, (recipe, name, err.item())
        else:
            assert torch.equal(grad, p_ref.grad), (recipe, step, name)


def _matches_unsharded_worker(rank: int) -> None:
    for recipe in RECIPES:
        ref = net(recipe)
        model = apply_fsdp(copy.deepcopy(ref), quantized_all_gather=True)
        assert isinstance(model.layers[0].up.weight._local_tensor, ShardedWeight)
        # Step 0: nothing precomputed; step 1: precomputed after the update; step 2:
        # precomputed before it (stale): the forward's all-gathers quantize (and all-reduce
        # amaxes) per weight again. The backward's re-gathers send the forward's bytes.
        for step in range(3):
            xs, ts = _data(model.head.in_features, step)
            record: list = []
            reduces: list = []
            quantized: list = []
            counting = mock.patch.object(ShardedWeight, "fsdp_pre_all_gather", _counting(record))
            with counting, _counting_all_reduces(reduces), _counting_quantizations(quantized):
                y = model(xs[rank])
                F.cross_entropy(y, ts[rank]).backward()
            _check_bytes(record, model, recipe)
            # once per weight and step (the forward's all-gather) unless precomputed
            assert len(reduces) == (0 if step == 1 else AMAX_WEIGHTS[recipe]), (recipe, step)
            assert len(quantized) == (0 if step == 1 else 4), (recipe, step)
            assert torch.equal(y, ref(xs[rank])), (recipe, step)  # before ref's history moves
            _reference_grads(ref, xs, ts, rank, recipe)
            _check_grads(model, ref, recipe, step)
            _check_operands(model, ref)  # an all-gather now sends what quantizing w gives
            if step == 1:
                _precompute(model, recipe)  # then changed by the update: stale
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.grad
            if step == 0:
                _precompute(model, recipe)  # as the trainer does after optimizer.step()
            model.zero_grad()
            ref.zero_grad()
            # Same point for the next step (DGE grads differ by rounding): the state_dict is
            # plain fp32, gathered here into the unsharded reference.
            state = model.state_dict()
            params = {k: v for k, v in state.items() if "amax_history" not in k}
            assert all(type(v._local_tensor) is torch.Tensor for v in params.values())
            ref.load_state_dict({k: v.full_tensor() for k, v in params.items()}, strict=False)
        pairs = zip(model.modules(), ref.modules(), strict=True)
        histories = [(m.amax_history, r.amax_history) for m, r in pairs
                     if getattr(m, "amax_history", None) is not None]  # fmt: skip
        assert len(histories) == (4 if recipe == "fp8-delayed" else 0)
        assert all(torch.equal(a, b) for a, b in histories)
    _optimizer_step_makes_amaxes_stale(rank)
    _kept_shard_serves_one_forward(rank)
    _dge_refuses_accumulation(rank)


def _optimizer_step_makes_amaxes_stale(rank: int) -> None:
    """minifloat's AdamW (unfused and fused) writes the shards through `to_local()`, not the
    DTensor: shards quantized (and amaxes reduced) before its step must not be sent after it."""
    from minifloat.optim import AdamW

    for fused in (False, True):
        model = apply_fsdp(net("fp8-tensorwise"), quantized_all_gather=True)
        opt = AdamW(model.parameters(), lr=1e-2, fused=fused)
        xs, ts = _data(64, 0)
        for stale in (False, True):
            F.cross_entropy(model(xs[rank]), ts[rank]).backward()
            if stale:
                _precompute(model, "fp8-tensorwise")
            opt.step()
            opt.zero_grad()
            if not stale:
                _precompute(model, "fp8-tensorwise")
            reduces: list = []
            with _counting_all_reduces(reduces):
                model(xs[rank])
            assert len(reduces) == (4 if stale else 0), (fused, stale)


def _kept_shard_serves_one_forward(rank: int) -> None:
    """A precomputed shard is sent by the next forward and its backward's re-gather; a second
    forward quantizes again, written or not: compiled writes (a compiled optimizer update, a
    compiled backward's fp8-delayed history record) move no version counter to tell."""
    for recipe in ("fp8-tensorwise", "fp8-delayed"):
        model = apply_fsdp(net(recipe), quantized_all_gather=True)
        xs, ts = _data(64, 0)
        precompute_quantized_weights(model)
        for expected in (0, 4):  # after the precompute; then without one (no write between)
            quantized: list = []
            with _counting_quantizations(quantized):
                F.cross_entropy(model(xs[rank]), ts[rank]).backward()
            assert len(quantized) == expected, (recipe, expected, len(quantized))


def _dge_refuses_accumulation(rank: int) -> None:
    """Reduce-scatter on every micro-batch (no no_sync) would scale the accumulated part twice."""
    model = apply_fsdp(net("fp4-dge"), quantized_all_gather=True)
    xs, ts = _data(64, 0)
    F.cross_entropy(model(xs[rank]), ts[rank]).backward()
    with pytest.raises(RuntimeError, match="one reduce-scatter per optimizer step"):
        F.cross_entropy(model(xs[rank]), ts[rank]).backward()


def _checkpoint_worker(rank: int) -> None:
    # A full state dict through torch.distributed.checkpoint, as the trainer saves it: plain
    # fp32 tensors; loaded into a fresh quantized-all-gather model and into a plain FSDP one,
    # both then compute the same outputs as the model it came from.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = apply_fsdp(net("fp4-dge"), quantized_all_gather=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xs, ts = _data(64, 0)
    for _ in range(2):
        F.cross_entropy(model(xs[rank]), ts[rank]).backward()
        opt.step()
        opt.zero_grad()
    full = get_model_state_dict(model, options=options)
    if rank == 0:
        assert all(type(v) is torch.Tensor for v in full.values())
        assert full["layers.0.up.weight"].shape == (128, 64)
    shared = [full]
    dist.broadcast_object_list(shared, src=0)
    for quantized in (True, False):
        fresh = net("fp4-dge")
        for layer in fresh.modules():  # other values, so that the load must set them
            if isinstance(layer, QuantLinear):
                nn.init.zeros_(layer.weight)
        fresh = apply_fsdp(fresh, quantized_all_gather=quantized)
        set_model_state_dict(fresh, shared[0], options=options)
        assert isinstance(fresh.layers[0].up.weight._local_tensor, ShardedWeight) == quantized
        assert torch.equal(fresh(xs[rank]), model(xs[rank])), quantized


def _trainer_resume_worker(rank: int, root: str) -> None:
    # The trainer with --quantized-all-gather (meta-device init, sharded checkpoints): stopping
    # after 2 steps and resuming gives the losses of an uninterrupted run bit for bit. The
    # uninterrupted run's third step sends the shards quantized after the second; the resumed
    # one quantizes them in its first all-gathers (fp8-tensorwise: all-reducing per weight).
    from minifloat.train.build import load_dataset
    from minifloat.train.config import TrainConfig
    from minifloat.train.trainer import Trainer, train

    for recipe in ("fp4-dge", "fp8-tensorwise"):
        config = TrainConfig(
            recipe=recipe, model="tiny", data="stdlib", tokenizer="byte", device="cpu",
            model_overrides={"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64},
            data_max_bytes=100_000, cache_dir=f"{root}/cache{rank}", out_dir=f"{root}/{recipe}",
            parallel="fsdp", quantized_all_gather=True, checkpoint_format="sharded", steps=4,
            batch_size=2, seq_len=16, lr=3e-3, eval_every=0, eval_batches=1, log_every=1,
        )  # fmt: skip
        dataset = load_dataset(config, progress=False)
        trainer = Trainer(
            dataclasses.replace(config, out_dir=f"{root}/{recipe}-full", save_checkpoints=False),
            dataset=dataset, progress=False,
        )  # fmt: skip
        shard = trainer.raw_model.layers[0].attention.wq.weight._local_tensor
        assert isinstance(shard, ShardedWeight)
        full = trainer.run()
        layer = trainer.raw_model.layers[0].attention.wq
        # quantized after the last step (fresh, or sent since by an evaluation forward)
        kept, plan = shard._quantized, fsdp_plan.plan_for(layer.recipe)
        assert kept.key == _quantized_key(layer, shard, plan)
        half = train(dataclasses.replace(config, stop_after=2), dataset=dataset, progress=False)
        rest = train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
        assert half.losses == full.losses[:2] and rest.losses == full.losses, (recipe, rest)


# Compiled blocks (torch.compile per block, as the trainer's --compile-scope block): one recipe
# per quantized-weight layout: a tensor-scaled FP8 weight, a row-scaled one whose dgrad operand
# is the column-scaled wᵀ (a transposed view), packed E2M1 with travelling row scales and DGE.
COMPILED_RECIPES = ["fp8-tensorwise", "fp8-rowwise", "fp4-dge"]


def _compiled_worker(rank: int) -> None:
    """Under torch.compile the quantized all-gather gives the gradients of the plain all-gather
    of the same compiled model. Until session 14 the compiled graph read the gathered weight's
    payload as its own inputs, dropped the weight from the graph and gave it no gradient: the
    quantized weights did not train (their .grad stayed None)."""
    for recipe in COMPILED_RECIPES:
        grads = {}
        for quantized in (False, True):
            torch._dynamo.reset()
            model = net(recipe)
            for block in model.layers:
                block.compile()
            apply_fsdp(model, quantized_all_gather=quantized)
            for step in range(2):
                xs, ts = _data(model.head.in_features, step)
                F.cross_entropy(model(xs[rank]), ts[rank]).backward()
                grads[quantized, step] = {
                    n: p.grad.full_tensor() for n, p in model.named_parameters()
                }  # every parameter has a gradient: .grad is None would raise here
                if quantized:
                    precompute_quantized_weights(model)
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.5 * p.grad
                model.zero_grad()
        dge = recipes.get(recipe).dge is not None
        # DGE's weight gradients differ by fp32 rounding (DGE_GRAD_REL_TOL), so do the weights
        # after the first update: its second step starts elsewhere and is not compared.
        for step in range(1 if dge else 2):
            for name, ref in grads[False, step].items():
                got = grads[True, step][name]
                if dge and name.endswith("weight") and "head" not in name:
                    err = (got - ref).abs().max() / ref.abs().max()
                    assert err <= DGE_GRAD_REL_TOL, (recipe, step, name, err.item())
                else:
                    assert torch.equal(got, ref), (recipe, step, name)


def test_quantized_all_gather_under_compile_trains_the_weights():
    spawn(_compiled_worker)


def _worker(rank: int, root: str) -> None:
    _matches_unsharded_worker(rank)
    _checkpoint_worker(rank)
    _trainer_resume_worker(rank, root)


def test_quantized_all_gather_matches_unsharded_model_and_checkpoints(tmp_path):
    # One spawn for all: starting the two ranks costs ~20 s on a 2-core CI machine.
    spawn(_worker, str(tmp_path))


def _one_rank_worker(rank: int) -> None:
    """One rank: FSDP2's world-size-1 shortcut copies only an extension's first all-gather
    input, so a shard of several tensors (travelling scales, two operands) is sent packed into
    one (fsdp_plan.pack_payload). Every recipe gives the unsharded model's gradients; the kept
    tensors are views of the packed one (its bytes held once); compiled as in two ranks."""
    for recipe in RECIPES:
        ref = net(recipe)
        model = apply_fsdp(copy.deepcopy(ref), quantized_all_gather=True)
        plan = fsdp_plan.plan_for(recipes.get(recipe))
        tensors = sum(1 + g.gathers_scale for g in plan.operands)
        dge = recipes.get(recipe).dge is not None
        for step in range(1 if dge else 2):  # DGE: weights differ by rounding after an update
            xs, ts = _data(model.head.in_features, step)
            record: list = []
            with mock.patch.object(ShardedWeight, "fsdp_pre_all_gather", _counting(record)):
                F.cross_entropy(model(xs[0]), ts[0]).backward()
            F.cross_entropy(ref(xs[0]), ts[0]).backward()
            for module, sizes in record:
                assert len(sizes) == 1, (recipe, sizes)
                need = fsdp_plan.payload_bytes(plan, module.out_features, module.in_features)
                assert need <= sizes[0] < need + tensors * fsdp_plan.PACK_ALIGN, (recipe, sizes)
                kept = module.weight._local_tensor._quantized
                if tensors > 1:
                    base = kept.packed[0].untyped_storage().data_ptr()
                    assert all(t.untyped_storage().data_ptr() == base for t in kept.tensors)
                else:
                    assert kept.packed is None  # sent as it is
            _check_grads(model, ref, recipe, step)
            with torch.no_grad():
                for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
                    p -= 0.5 * p.grad
                    p_ref -= 0.5 * p_ref.grad
            precompute_quantized_weights(model)
            model.zero_grad()
            ref.zero_grad()
    _compiled_worker(rank)


def test_one_rank_sends_each_shard_as_one_tensor():
    spawn(_one_rank_worker, world=1)


def test_pack_payload_round_trip():
    """Packed tensors come back bit for bit, as views, each on a 16-byte boundary."""
    gen = torch.Generator().manual_seed(0)
    tensors = (
        torch.randint(0, 256, (5, 7), dtype=torch.uint8, generator=gen),
        torch.randn(5, 1, generator=gen),
        torch.randint(0, 256, (3, 3), dtype=torch.uint8, generator=gen),
        torch.randn(1, 2, generator=gen),
    )
    flat, layout = fsdp_plan.pack_payload(tensors)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert [offset for offset, _, _ in layout] == [0, 48, 80, 96]
    back = fsdp_plan.unpack_payload(flat, layout)
    for t, b in zip(tensors, back, strict=True):
        assert b.dtype == t.dtype and torch.equal(b, t)
        assert b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert (b.storage_offset() * b.element_size()) % fsdp_plan.PACK_ALIGN == 0


def test_hopper_kernels_are_traced_on_fake_tensors():
    """Dynamo propagates fake tensors through GatheredWeight's dispatch outside
    `is_compiling()`; the Hopper backend must give its plain quantizer code there, not a
    compiled twin that launches kernels on tensors without data (the fp4 all-gather failed to
    compile on the GPU with "Cannot access data pointer", session 16). A fake CUDA tensor needs
    no GPU; the end-to-end check is `benchmarks/qag_equality.py` on the GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from minifloat.kernels import operand as op
    from minifloat.kernels.hopper import HopperBackend

    with FakeTensorMode():
        fake = torch.empty(4, 4, dtype=torch.uint8, device="cuda")
    assert HopperBackend().kernel(op.unpack_e2m1, fake) is op.unpack_e2m1


def test_trainer_flag_needs_fsdp():
    from minifloat.train.config import ConfigError, TrainConfig
    from minifloat.train.config_checks import check_config

    with pytest.raises(ConfigError, match="quantized-all-gather needs parallel=fsdp"):
        check_config(TrainConfig(recipe="fp8-tensorwise", quantized_all_gather=True))
