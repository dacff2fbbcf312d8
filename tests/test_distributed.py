"""minifloat.distributed on CPU: 2 gloo processes spawned by each test (1 for the one-rank
test)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bits import bits_equal
from gloo_ranks import WORLD, spawn
from minifloat.convert import convert
from minifloat.distributed import (
    GradCommState,
    apply_fsdp,
    fsdp_reduce_dtype,
    measure_grad_comm,
    reduce_mean,
    register_grad_comm_hook,
)
from minifloat.linear import QuantLinear
from minifloat.models.llama import Llama, get_config
from minifloat.optim import OPTIM_STATE_PRESETS, AdamW
from minifloat.sqnr import sqnr_db
from tolerances import ADAM_UPDATE_SQNR_DB, ALLREDUCE_SQNR_DB, DDP_GRAD_SQNR_DB


def _tiny_model(seed: int = 0) -> Llama:
    config = get_config(
        "tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16
    )
    model = Llama(config)
    model.init_weights(seed)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (2 * WORLD, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(WORLD)[rank]


# ---- hooks vs fp32 all-reduce ----------------------------------------------------------------


def _hooks_worker(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    # Heavy-tailed values over many binades, like real gradients.
    grad = torch.randn(10_001, generator=gen) * torch.exp(2 * torch.randn(10_001, generator=gen))
    for (kind, fmt), min_db in ALLREDUCE_SQNR_DB.items():
        report = measure_grad_comm(grad, kind, fp8_format=fmt)
        assert report.sqnr_db >= min_db, (kind, fmt, report)
        out = reduce_mean(grad, kind, fp8_format=fmt)[0].wait()
        gathered = [torch.empty_like(out) for _ in range(WORLD)]
        dist.all_gather(gathered, out)
        assert torch.equal(gathered[0], gathered[1]), f"{kind}/{fmt}: ranks disagree"
        expected_ratio = {"fp32": 1.0, "bf16": 2.0, "fp8": 4.0}[kind]
        # payload bytes plus a few per-bucket scales: within 1% of the dtype ratio (measured 0.1%)
        assert report.compression == pytest.approx(expected_ratio, rel=0.01), (kind, report)
    # Non-finite gradients must not become finite.
    bad = grad.clone()
    if rank == 1:
        bad[7] = float("inf")
    for kind in ("fp32", "bf16", "fp8"):
        out = reduce_mean(bad, kind)[0].wait()
        assert not torch.isfinite(out).all(), kind


def test_hooks_match_fp32_allreduce_within_format_bounds():
    spawn(_hooks_worker)


# ---- DDP training vs single process ------------------------------------------------------------


def _ddp_worker(rank: int) -> None:
    for kind, min_db in DDP_GRAD_SQNR_DB.items():
        ref = _tiny_model()
        model = DDP(_tiny_model())
        state = register_grad_comm_hook(model, kind)
        lr = 1e-2
        opt = AdamW(model.parameters(), lr=lr)
        opt_ref = AdamW(ref.parameters(), lr=lr)
        losses = []
        x, y = _batch(0)  # one batch, so the loss must fall
        p0 = [p.detach().clone() for p in ref.parameters()]
        for step in range(4):
            if kind == "fp32":  # identical gradients keep the two models (nearly) identical
                pairs = zip(ref.parameters(), model.module.parameters(), p0, strict=True)
                for p_ref, p, start in pairs:
                    assert sqnr_db(p_ref - start, p - start) >= ADAM_UPDATE_SQNR_DB, step
            at = _tiny_model()  # compare each step's gradients at the same point
            at.load_state_dict(model.module.state_dict())
            _loss(at, x, y).backward()
            _loss(ref, x, y).backward()
            loss = _loss(model, _shard(x, rank), _shard(y, rank))
            loss.backward()
            for p_at, p in zip(at.parameters(), model.module.parameters(), strict=True):
                assert sqnr_db(p_at.grad, p.grad) >= min_db, (kind, step)
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
            dist.all_reduce(loss.detach_(), op=dist.ReduceOp.AVG)
            losses.append(loss.item())
        assert state.calls >= 4 and state.bytes_sent > 0
        assert losses[-1] < losses[0] - 0.05, (kind, losses)  # measured drop 0.82, every kind


def test_ddp_training_matches_single_process():
    spawn(_ddp_worker)


def _chunked_head_ddp_worker(rank: int) -> None:
    """The head deferred in a DDP-wrapped model and applied with the loss in chunks
    (train/head_loss.py): the head's gradient reaches DDP's all-reduce from the loss's backward,
    so every rank holds the whole batch's gradients of the unchunked single process."""
    from minifloat.train.head_loss import ChunkedHeadObjective, defer_head

    ref, model = _tiny_model(), DDP(_tiny_model())
    objective = ChunkedHeadObjective(defer_head(model.module), chunk_tokens=12, mode="eager")
    for step in range(2):
        x, y = _batch(step)
        _loss(ref, x, y).backward()
        with objective.deferring():
            hidden = model(_shard(x, rank))
        objective(hidden, _shard(y, rank))[1].backward()
        for p_ref, p in zip(ref.parameters(), model.module.parameters(), strict=True):
            assert sqnr_db(p_ref.grad, p.grad) >= DDP_GRAD_SQNR_DB["fp32"], step
        ref.zero_grad()
        model.zero_grad()


def test_ddp_trains_a_chunked_head():
    spawn(_chunked_head_ddp_worker)


def _ddp_trainer_worker(rank: int, root: str) -> None:
    # Every rank builds the same rope tables (Llama.init_weights): DDP must not broadcast
    # them before each forward, as it broadcasts the buffers it holds.
    from minifloat.train.config import TrainConfig
    from minifloat.train.trainer import Trainer

    config = TrainConfig(
        recipe="bf16", model="tiny", data="stdlib", tokenizer="byte", device="cpu",
        model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
        data_max_bytes=100_000, cache_dir=f"{root}/cache{rank}", out_dir=f"{root}/ddp",
        parallel="ddp", steps=1, batch_size=2, seq_len=16, eval_every=0, save_checkpoints=False,
    )  # fmt: skip
    trainer = Trainer(config, progress=False)
    held = trainer.model.modules_buffers  # what DDP broadcasts
    assert trainer.raw_model.rope_cos.numel() > 0
    assert not any(b is trainer.raw_model.rope_cos or b is trainer.raw_model.rope_sin for b in held)
    assert math.isfinite(trainer.train_step()["loss"])


def test_ddp_does_not_broadcast_the_rope_tables(tmp_path):
    spawn(_ddp_trainer_worker, str(tmp_path))


# ---- FSDP2 training vs single process ----------------------------------------------------------


def _fsdp_worker(rank: int) -> None:
    ref = _tiny_model()
    model = apply_fsdp(_tiny_model(), reduce_dtype=fsdp_reduce_dtype("fp32"))
    assert type(model.layers[0].attention.wq.weight).__name__ == "DTensor"
    lr = 3e-3
    opt_ref = AdamW(ref.parameters(), lr=lr)
    opt = AdamW(model.parameters(), lr=lr)
    p0 = [p.detach().clone() for p in ref.parameters()]
    for step in range(4):
        x, y = _batch(step)
        ref_loss = _loss(ref, x, y)
        ref_loss.backward()
        loss = _loss(model, _shard(x, rank), _shard(y, rank))
        # Between forward and backward the blocks are resharded, the root is still gathered
        # (one all-gather of it a step: benchmarks/scale_out.py's count; train/head_loss.py).
        assert type(model.layers[0].attention.wq.weight).__name__ == "DTensor"
        assert type(model.output.weight).__name__ != "DTensor"
        loss.backward()
        at = _tiny_model()  # gradients at the same point
        at.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
        _loss(at, x, y).backward()
        for p_at, p in zip(at.parameters(), model.parameters(), strict=True):
            assert sqnr_db(p_at.grad, p.grad.full_tensor()) >= DDP_GRAD_SQNR_DB["fp32"], step
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for p_ref, p, start in zip(ref.parameters(), model.parameters(), p0, strict=True):
        assert sqnr_db(p_ref - start, p.full_tensor() - start) >= ADAM_UPDATE_SQNR_DB


def test_fsdp_training_matches_single_process():
    spawn(_fsdp_worker)


def _fsdp_lowp_states_worker(rank: int) -> None:
    # fp8/fp16 states on DTensor shards (small_numel=0 so every tensor uses them) and a bf16
    # reduce-scatter: the loss must fall as fast as fp32 states to within a small margin.
    model = apply_fsdp(_tiny_model(), reduce_dtype=fsdp_reduce_dtype("bf16"))
    ref = _tiny_model()
    opt = AdamW(
        model.parameters(), lr=1e-2, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp16", small_numel=0
    )
    opt_ref = AdamW(ref.parameters(), lr=1e-2)
    x, y = _batch(0)
    for _ in range(8):
        loss = _loss(model, _shard(x, rank), _shard(y, rank))
        loss.backward()
        ref_loss = _loss(ref, x, y)
        ref_loss.backward()
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    state = opt.state[model.layers[0].attention.wq.weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn
    full = torch.cat([_loss(model, _shard(x, r), _shard(y, r)).reshape(1) for r in range(WORLD)])
    final = full.mean().item()
    # fp8/fp16 states and a bf16 reduce-scatter cost little loss (measured 8e-4 from fp32 states)
    assert abs(final - _loss(ref, x, y).item()) < 0.05, final
    # convert after sharding: a 21-frame DTensor error at the first forward, before the check
    with pytest.raises(ValueError, match="already sharded .*convert it before apply_fsdp"):
        convert(model, "fp8-tensorwise")
    with pytest.warns(UserWarning, match="has no QuantLinear layer, so nothing is gathered"):
        apply_fsdp(_tiny_model(), quantized_all_gather=True)


def test_fsdp_low_precision_states_and_bf16_reduce():
    spawn(_fsdp_lowp_states_worker)


def _hf_fsdp_worker(rank: int) -> None:
    # transformers decoders have no `layers` attribute at the top (model.model.layers): the
    # repeated blocks are found anyway, one FSDP unit each plus the root, and a training step
    # of the sharded model matches the unsharded one on the full batch.
    from torch.distributed.fsdp import FSDPModule

    from test_blocks import HF_LAYERS, hf_model

    x, y = _batch(0)
    sqnr = {}
    for name in ("llama", "mistral", "qwen2"):
        torch.manual_seed(0)
        ref = hf_model(name)
        model = apply_fsdp(copy.deepcopy(ref))
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert len(units) == HF_LAYERS + 1 and units[0] is model, name
        assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"
        p0 = [p.detach().clone() for p in ref.parameters()]
        opts = [AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
        F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).backward()
        logits = model(_shard(x, rank)).logits
        F.cross_entropy(logits.flatten(0, 1), _shard(y, rank).flatten()).backward()
        pairs = list(zip(ref.parameters(), model.parameters(), p0, strict=True))
        grad_db = min(sqnr_db(a.grad, b.grad.full_tensor()) for a, b, _ in pairs)
        for opt in opts:
            opt.step()
        step_db = min(sqnr_db(a - start, b.full_tensor() - start) for a, b, start in pairs)
        assert grad_db >= DDP_GRAD_SQNR_DB["fp32"] and step_db >= ADAM_UPDATE_SQNR_DB, name
        sqnr[name] = (grad_db, step_db)
    if rank == 0:
        print("min SQNR dB (grads, AdamW step):", sqnr)  # measured >= 130 dB, >= 97 dB
    # The fused low-precision AdamW update on DTensor shards: the same bits as the unfused one.
    states = dict(exp_avg_dtype="fp8-sr", exp_avg_sq_dtype="fp16", small_numel=0)
    params = []
    for fused in (False, True):
        model = apply_fsdp(copy.deepcopy(ref))
        opt = AdamW(model.parameters(), lr=1e-2, fused=fused, **states)
        for _ in range(2):
            logits = model(_shard(x, rank)).logits
            F.cross_entropy(logits.flatten(0, 1), _shard(y, rank).flatten()).backward()
            opt.step()
            opt.zero_grad()
        params.append([p.full_tensor() for p in model.parameters()])
    assert all(bits_equal(a, b) for a, b in zip(*params, strict=True))


def test_fsdp_shards_transformers_decoders_by_their_repeated_blocks():
    spawn(_hf_fsdp_worker)


def _converted_worker(rank: int) -> None:
    # fp4 recipe (QuantLinear layers, emulated on CPU) under FSDP2 and under DDP with the fp8
    # hook: sharding and hooks must work on converted models, and the loss must fall.
    x, y = _batch(0)
    for parallel in ("fsdp", "ddp"):
        model = _tiny_model()
        report = convert(model, "fp4").minifloat_report
        assert isinstance(model.layers[0].attention.wq, QuantLinear) and report.converted
        if parallel == "fsdp":
            model = apply_fsdp(model)
            assert type(model.layers[0].attention.wq.weight).__name__ == "DTensor"
        else:
            model = DDP(model)
            register_grad_comm_hook(model, "fp8")
        opt = AdamW(model.parameters(), lr=1e-2, **OPTIM_STATE_PRESETS["fp8-fp16"])
        losses = []
        for _ in range(6):
            loss = _loss(model, _shard(x, rank), _shard(y, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss.detach_(), op=dist.ReduceOp.AVG)
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.1, (parallel, losses)  # measured drop >= 1.3


def test_fsdp_and_ddp_train_quantlinear_models():
    spawn(_converted_worker)


def _fsdp_checkpoint_worker(rank: int) -> None:
    # Full (gathered) optimizer state dict through torch.distributed.checkpoint, as the trainer
    # saves it, loaded into a fresh sharded model: training resumes where it stopped.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    x, y = _batch(0)
    kwargs = dict(lr=1e-2, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp16", small_numel=0)

    def make():
        model = apply_fsdp(_tiny_model())
        return model, AdamW(model.parameters(), **kwargs)

    def steps(model, opt, n: int) -> None:
        for _ in range(n):
            _loss(model, _shard(x, rank), _shard(y, rank)).backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    steps(model, opt, 3)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    if rank == 0:
        key = "layers.0.attention.wq.weight"
        assert optim_sd["state"][key]["exp_avg"].shape == (32, 32)  # gathered, full shape
    # Rank 0 holds the gathered dicts; every rank reads the checkpoint file when resuming.
    shared = copy.deepcopy([model_sd, optim_sd])  # detach from the live optimizer state
    dist.broadcast_object_list(shared, src=0)
    model_sd, optim_sd = shared
    steps(model, opt, 2)
    model2, opt2 = make()
    set_state_dict(
        model2, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
    )
    steps(model2, opt2, 2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        # Saved as fp32 and re-encoded: decode -> encode reproduces the fp8/fp16 payloads.
        assert sqnr_db(a.full_tensor(), b.full_tensor()) >= 100.0


def test_fsdp_full_checkpoint_round_trip():
    spawn(_fsdp_checkpoint_worker)


def test_fsdp_rejects_fp8_reduce():
    with pytest.raises(ValueError, match="DDP only"):
        fsdp_reduce_dtype("fp8")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(reduce_dtype="bf16"), TypeError, "reduce_dtype must be a floating torch.dtype"),
        (dict(param_dtype=torch.int8), TypeError, "param_dtype must be a floating torch.dtype"),
        (dict(blocks=[nn.Linear(2, 2)]), ValueError, r"blocks\[0\] \(Linear\) is not a sub"),
    ],
)
def test_apply_fsdp_refuses_bad_arguments_before_sharding(kwargs, error, match):
    """Checked before anything is sharded (no process group is needed to fail): a str dtype
    failed at the first forward, 13 frames deep; a foreign block was sharded silently."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(error, match=match):
        apply_fsdp(model, **kwargs)
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_grad_comm_hook_needs_a_ddp_model():
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got Linear"):
        register_grad_comm_hook(nn.Linear(4, 4), "bf16")


def _deferred_init_worker(rank: int, root: str) -> None:
    # The trainer under FSDP builds on the meta device and initializes each shard after
    # sharding: the weights must equal an eager, unsharded init, and training must run.
    from minifloat.train.config import TrainConfig
    from minifloat.train.model import deferred_init
    from minifloat.train.trainer import Trainer

    for recipe in ("bf16", "fp8-delayed"):
        config = TrainConfig(
            recipe=recipe, model="tiny", data="stdlib", tokenizer="byte", device="cpu",
            model_overrides={"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64},
            data_max_bytes=100_000, cache_dir=f"{root}/cache{rank}", out_dir=f"{root}/{recipe}",
            parallel="fsdp", steps=2, batch_size=2, seq_len=16, eval_every=0,
            save_checkpoints=False,
        )  # fmt: skip
        trainer = Trainer(config, progress=False)
        assert deferred_init(config, trainer.runtime)  # the meta-device path ran
        eager = Llama(trainer.model_config)
        eager.init_weights(config.seed)
        sharded = dict(trainer.raw_model.named_parameters())
        assert sharded.keys() == dict(eager.named_parameters()).keys()
        for name, p in eager.named_parameters():
            assert torch.equal(sharded[name].full_tensor(), p), (recipe, name)
        histories = [m.amax_history for m in trainer.raw_model.modules()
                     if isinstance(m, QuantLinear) and m.amax_history is not None]  # fmt: skip
        assert len(histories) == (14 if recipe == "fp8-delayed" else 0)
        assert all(not h.is_meta and bool((h == 0).all()) for h in histories)
        result = trainer.run()
        assert all(math.isfinite(v) for v in result.losses), (recipe, result.losses)


def test_trainer_fsdp_initializes_shards_like_an_eager_init(tmp_path):
    spawn(_deferred_init_worker, str(tmp_path))


# ---- one rank (torchrun --nproc-per-node 1) ---------------------------------------------------


def _one_rank_worker(rank: int) -> None:
    # Buckets of any size: the fp8 path's scales once sat at a byte offset no float32 view takes.
    for numel in (10, 7, 12, 1):
        flat = torch.randn(numel)
        for kind in ("fp32", "bf16", "fp8"):
            out = reduce_mean(flat, kind)[0].wait()
            assert out.shape == flat.shape and out.dtype == torch.float32, (kind, numel)
            assert sqnr_db(flat, out) >= ALLREDUCE_SQNR_DB[(kind, "e4m3")], (kind, numel)
    for kind in ("fp32", "bf16", "fp8"):
        out, sent = reduce_mean(torch.zeros(0), kind)
        assert out.wait().numel() == 0 and sent == 0.0, kind
        report = measure_grad_comm(torch.randn(10), kind)
        assert math.isnan(report.compression), (kind, report)  # one rank sends no bytes
    ddp = DDP(torch.nn.Linear(5, 1))  # a 6-element bucket
    register_grad_comm_hook(ddp, "fp8")
    ddp(torch.randn(3, 5)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ddp.parameters())


def test_one_rank_averages_buckets_of_any_size():
    spawn(_one_rank_worker, world=1)


@pytest.mark.parametrize(
    "bad", [torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.cfloat)]
)
def test_reduce_mean_refuses_tensors_that_are_not_real_floats(bad):
    with pytest.raises(TypeError, match="real floating-point tensor"):
        reduce_mean(bad, "fp8")


def test_grad_comm_state_checks_its_kind():
    with pytest.raises(ValueError, match="unknown grad_comm kind"):
        GradCommState(kind="fp4")
