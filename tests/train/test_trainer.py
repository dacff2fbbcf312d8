"""End-to-end tests of minifloat.train on a very small model (CPU)."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import weakref
from pathlib import Path

import pytest
import torch

from minifloat.train.checkpoint import CheckpointError
from minifloat.train.checkpointer import read_checkpoint_summary
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.errors import RunDirError, RunFailed
from minifloat.train.trainer import Trainer, train
from torchrun_ranks import run_torchrun

# One layer of width 32 at seq_len 32: a few milliseconds per step on a CPU.
SMALL = {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}


def _config(tmp_path: Path, **changes) -> TrainConfig:
    base = TrainConfig(
        recipe="fp32",
        model="tiny",
        model_overrides=SMALL,
        data="stdlib",
        steps=8,
        batch_size=4,
        seq_len=32,
        lr=3e-3,
        eval_every=4,
        eval_batches=2,
        log_every=2,
        out_dir=str(tmp_path / "run"),
        device="cpu",
    )
    return dataclasses.replace(base, **changes)


def test_loss_falls_and_metrics_are_written(tmp_path: Path, dataset) -> None:
    result = train(_config(tmp_path, recipe="bf16", steps=40, eval_every=20), dataset=dataset,
                   progress=False)  # fmt: skip
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 1.0, (first, last)  # measured a 1.8 drop; kernels move it by < 1e-3
    assert result.final_val_loss is not None and result.final_val_loss < math.log(257)
    assert result.steps == 40 and result.tokens == 40 * 4 * 32
    assert result.skipped_steps == 0 and result.tokens_per_s > 0
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(2, 41, 2))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "skipped"):
        assert all(key in r for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    assert result.checkpoint_path is not None and result.checkpoint_path.is_file()


def test_eval_batches_zero_skips_every_evaluation(tmp_path: Path, dataset) -> None:
    # Benchmarks that only time training skip the final validation (a compiled no-grad graph).
    config = _config(tmp_path, recipe="bf16", steps=4, eval_every=2, eval_batches=0)
    result = train(config, dataset=dataset, progress=False)
    assert result.final_val_loss is None and result.val_losses == ()
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert records and not any("val_loss" in r for r in records)


# fp8-delayed keeps an amax history (a non-persistent buffer) and fp4 quantizes every GEMM: both
# must resume exactly too.
@pytest.mark.parametrize("recipe", ["fp32", "bf16", "fp16", "fp8-delayed", "fp4"])
def test_resume_is_bit_exact(tmp_path: Path, dataset, recipe: str) -> None:
    full = train(_config(tmp_path / "a", recipe=recipe), dataset=dataset, progress=False)
    config = _config(tmp_path / "b", recipe=recipe)
    half = train(dataclasses.replace(config, stop_after=4), dataset=dataset, progress=False)
    assert half.steps == 4 and half.losses == full.losses[:4]
    rest = train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
    assert rest.losses == full.losses  # exact float equality, every step
    assert rest.val_losses == full.val_losses
    steps = [json.loads(x)["step"] for x in rest.metrics_path.read_text().splitlines()]
    assert steps == [2, 4, 6, 8]  # the resumed run appends to the log


def test_resume_with_low_precision_optimizer_states(tmp_path: Path, dataset) -> None:
    full = train(_config(tmp_path / "a", optim_states="bf16"), dataset=dataset, progress=False)
    config = _config(tmp_path / "b", optim_states="bf16")
    train(dataclasses.replace(config, stop_after=3), dataset=dataset, progress=False)
    rest = train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
    assert rest.losses == full.losses


def test_mismatched_missing_and_corrupt_checkpoints(tmp_path: Path, dataset) -> None:
    config = _config(tmp_path, stop_after=2)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
    train(config, dataset=dataset, progress=False)
    mismatches = [
        ({"recipe": "bf16"}, "recipe"),
        ({"lr": 1e-3}, "lr"),
        ({"model_overrides": {**SMALL, "dim": 64}}, "model_overrides"),
    ]
    for change, field in mismatches:
        bad = dataclasses.replace(config, resume=True, stop_after=None, **change)
        with pytest.raises(CheckpointError, match=field):
            train(bad, dataset=dataset, progress=False)
    path = Path(config.out_dir) / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt"):
        train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)


def _snapshot(trainer: Trainer) -> tuple[list[torch.Tensor], dict]:
    params = [p.detach().clone() for p in trainer.raw_model.parameters()]
    state = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)}
             for k, v in trainer.optimizer.state.items()}  # fmt: skip
    return params, state


def _assert_unchanged(trainer: Trainer, snapshot: tuple[list[torch.Tensor], dict]) -> None:
    params, state = snapshot
    for before, after in zip(params, trainer.raw_model.parameters(), strict=True):
        assert torch.equal(before, after)
    for key, tensors in state.items():
        for name, value in tensors.items():
            assert torch.equal(value, trainer.optimizer.state[key][name])


def test_guard_skips_nan_and_spike_without_touching_weights(tmp_path: Path, dataset) -> None:
    trainer = Trainer(_config(tmp_path, steps=20, spike_warmup=4), dataset=dataset, progress=False)
    try:
        for _ in range(6):
            assert trainer.train_step()["skip_reason"] == ""
        head = trainer.raw_model.output
        # Inject a NaN into the logits of one step.
        handle = head.register_forward_hook(lambda _m, _i, out: out * float("nan"))
        snapshot = _snapshot(trainer)
        metrics = trainer.train_step()
        handle.remove()
        assert "non-finite" in metrics["skip_reason"] and math.isnan(metrics["loss"])
        _assert_unchanged(trainer, snapshot)
        # Inject a loss spike: logits blown up 30x give a far larger (finite) loss.
        handle = head.register_forward_hook(lambda _m, _i, out: out * 30.0)
        snapshot = _snapshot(trainer)
        metrics = trainer.train_step()
        handle.remove()
        assert "spike" in metrics["skip_reason"] and math.isfinite(metrics["loss"])
        _assert_unchanged(trainer, snapshot)
        assert trainer.guard.skipped == 2
        assert trainer.train_step()["skip_reason"] == ""  # training carries on
        assert not torch.equal(snapshot[0][0], next(trainer.raw_model.parameters()))
    finally:
        trainer.close()


def test_accumulation_z_loss_and_embedding_shrink_run(tmp_path: Path, dataset) -> None:
    result = train(
        _config(tmp_path, grad_accum=2, z_loss=1e-4, embed_grad_shrink=0.1, steps=6),
        dataset=dataset,
        progress=False,
    )
    assert result.tokens == 6 * 2 * 4 * 32
    assert all(math.isfinite(v) for v in result.losses)
    assert result.losses[-1] < result.losses[0]


def test_quantized_recipe_trains(tmp_path: Path, dataset) -> None:
    pytest.importorskip("minifloat.convert")
    result = train(_config(tmp_path, recipe="fp8-tensorwise", steps=6), dataset=dataset,
                   progress=False)  # fmt: skip
    assert all(math.isfinite(v) for v in result.losses)
    assert result.losses[-1] < result.losses[0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": 0}, "steps must be positive"),
        ({"steps": 5, "tokens": 100}, "either steps or tokens"),
        ({"parallel": "tp"}, "parallel must be one of"),
        ({"embed_grad_shrink": 0.0}, "embed-grad-shrink"),
        ({"warmup_fraction": 1.5}, "warmup-fraction"),
        ({"eval_batches": -1}, "eval-batches must be >= 0"),
    ],
)
def test_invalid_config_values(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**changes)


def test_unknown_names_fail_before_data_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown recipe"):
        train(_config(tmp_path, recipe="fp3"), progress=False)
    with pytest.raises(ConfigError, match="unknown model"):
        train(_config(tmp_path, model="huge"), progress=False)
    assert not (tmp_path / "run").exists()


def test_tokens_convert_to_steps() -> None:
    config = TrainConfig(model="tiny", tokens=10_000, batch_size=4, seq_len=32, grad_accum=2)
    assert config.total_steps() == math.ceil(10_000 / (4 * 32 * 2))
    assert config.total_steps(world_size=2) == math.ceil(10_000 / (4 * 32 * 2 * 2))


DDP_TOML = """
model = "tiny"
tokenizer = "byte"
data_max_bytes = 200000
batch_size = 2
seq_len = 32
steps = 4
eval_every = 2
eval_batches = 1
device = "cpu"
parallel = "ddp"
grad_comm = "bf16"

[model_overrides]
dim = 32
n_layers = 1
n_heads = 2
ffn_dim = 64
"""


def _torchrun(tmp_path: Path, *args: str) -> None:
    run_torchrun(["-m", "minifloat", "train", "--config", "ddp.toml", "--cache-dir", "cache",
                  "--quiet", *args], cwd=tmp_path, timeout=120)  # fmt: skip


@pytest.mark.slow
def test_ddp_under_torchrun_resumes_exactly(tmp_path: Path) -> None:
    """Two CPU ranks (gloo): per-rank data and RNG state survive a checkpoint."""
    (tmp_path / "ddp.toml").write_text(DDP_TOML)
    _torchrun(tmp_path, "--out", "full")
    _torchrun(tmp_path, "--out", "split", "--stop-after", "2")
    _torchrun(tmp_path, "--out", "split", "--resume")
    full, split = (
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("full", "split")
    )
    assert [r["step"] for r in full] == [2, 4]
    assert [(r["loss"], r["val_loss"]) for r in full] == [(r["loss"], r["val_loss"]) for r in split]


def test_model_transform_runs_on_the_converted_model(tmp_path: Path, dataset) -> None:
    """The hook sees the converted model before wrapping, and its changes shape the run: a
    frozen all-zero head makes every logit 0, so every loss is exactly ln(vocab)."""
    from minifloat.linear import QuantLinear

    seen: list[str] = []

    def freeze_zero_head(model: torch.nn.Module) -> None:
        seen.extend(type(m).__name__ for m in model.modules() if isinstance(m, QuantLinear))
        with torch.no_grad():
            model.output.weight.zero_()
        model.output.weight.requires_grad_(False)

    config = _config(tmp_path, recipe="fp4-direct", steps=4, eval_every=0, eval_batches=1)
    result = train(config, dataset=dataset, progress=False, model_transform=freeze_zero_head)
    assert seen == ["QuantLinear"] * 7  # one block: wq, wk, wv, wo, w1, w2, w3
    expected = math.log(dataset.tokenizer.vocab_size)
    # Each loss is the mean of 128 equal fp32 values: <= 65 u = 3.9e-6 relative in any summation
    # order (measured 9e-8 with AVX2; summed in 16 lanes 1.7e-7, one after another 6e-7).
    assert result.losses == pytest.approx([expected] * 4, rel=1e-5)
    assert result.final_val_loss == pytest.approx(expected, rel=1e-5)
    untouched = train(dataclasses.replace(config, out_dir=str(tmp_path / "plain")),
                      dataset=dataset, progress=False)  # fmt: skip
    assert untouched.losses[-1] < expected - 0.1  # without the hook the model learns (0.30)


def test_sqnr_every_logs_records_and_may_change_on_resume(tmp_path: Path, dataset) -> None:
    full = train(_config(tmp_path / "a", recipe="fp4-direct", steps=6), dataset=dataset,
                 progress=False)  # fmt: skip
    config = _config(tmp_path / "b", recipe="fp4-direct", steps=6)
    train(dataclasses.replace(config, stop_after=3), dataset=dataset, progress=False)
    # sqnr_every is not part of the trajectory: a resumed run may turn the diagnostic on.
    rest = train(dataclasses.replace(config, resume=True, sqnr_every=2), dataset=dataset,
                 progress=False)  # fmt: skip
    assert rest.losses == full.losses
    records = [json.loads(x) for x in rest.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records if "layer_sqnr" in r] == [4, 6]
    assert not any(
        "layer_sqnr" in json.loads(x) for x in full.metrics_path.read_text().splitlines()
    )


def test_train_frees_its_model_on_return(tmp_path: Path, dataset) -> None:
    # Blocks compiled in place hold themselves in reference cycles; without a collection at the
    # end of train() the next run of a `compare` (same process) counted them in its peak memory
    # (the GPU test below failed by +8.7 %).
    weights = []
    config = _config(tmp_path, recipe="fp8-tensorwise", steps=1, eval_every=0, compile=True,
                     compile_scope="block")  # fmt: skip

    def keep_a_weakref(model: torch.nn.Module) -> None:
        weights.append(weakref.ref(model.layers[0].attention.wq.weight))

    gc.disable()  # only train()'s own collection may free it
    try:
        train(config, dataset=dataset, progress=False, model_transform=keep_a_weakref)
    finally:
        gc.enable()
    assert len(weights) == 1 and weights[0]() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sqnr_probe_stays_out_of_the_training_peak(tmp_path: Path, dataset) -> None:
    # The probe runs the compiled blocks eagerly and needed 18.7 GiB where 125M fp8-tensorwise
    # training peaks at 11.9 (issue 15's run): peak_mem_gib must be training's alone.
    wide = {"dim": 512, "n_layers": 2, "n_heads": 8, "ffn_dim": 1408}
    config = _config(tmp_path / "a", recipe="fp8-tensorwise", steps=4, device="cuda",
                     model_overrides=wide, seq_len=256, batch_size=16, eval_every=0,
                     compile=True, compile_scope="block")  # fmt: skip
    plain = train(config, dataset=dataset, progress=False)
    probed = train(dataclasses.replace(config, out_dir=str(tmp_path / "b"), sqnr_every=2),
                   dataset=dataset, progress=False)  # fmt: skip
    records = [json.loads(x) for x in probed.metrics_path.read_text().splitlines()]
    probes = [r["probe_peak_mem_gib"] for r in records if "layer_sqnr" in r]
    assert len(probes) == 2 and all(p > 0 for p in probes)
    assert probed.peak_memory_bytes == pytest.approx(plain.peak_memory_bytes, rel=0.02)


def test_sqnr_every_validation() -> None:
    assert TrainConfig().sqnr_every == 0
    with pytest.raises(ConfigError, match="sqnr-every must be >= 0"):
        TrainConfig(sqnr_every=-1)
    with pytest.raises(ConfigError, match="sqnr-every needs whole layers"):
        TrainConfig(sqnr_every=10, parallel="fsdp")
    assert "sqnr_every" not in TrainConfig(sqnr_every=5).trajectory_fields(1)


def _nan_logits(model: torch.nn.Module) -> None:
    model.output.register_forward_hook(lambda _m, _i, out: out * float("nan"))


def test_a_run_that_skips_most_steps_fails_with_the_reason(tmp_path: Path, dataset) -> None:
    """39 of 40 skipped steps used to end with status 0: now RunFailed, after the checkpoint and
    metrics are written, with the result attached; and as soon as more than max-skip-fraction
    of the planned steps were skipped (6 of 10), since the end's check could no longer pass."""
    config = _config(tmp_path, steps=10, eval_batches=0, ckpt_every=100)
    with pytest.raises(RunFailed) as info:
        train(config, dataset=dataset, progress=False, model_transform=_nan_logits)
    message = str(info.value)
    assert message.startswith(
        "6 of 6 steps were skipped (100 % > max-skip-fraction 0.5; stopped after step 6 of 10)"
    )
    assert "last reason: non-finite loss or grad norm" in message
    assert info.value.result.skipped_steps == 6 and info.value.result.steps == 6
    assert read_checkpoint_summary(Path(config.out_dir) / "checkpoint.pt")["step"] == 6
    tolerant = dataclasses.replace(config, out_dir=str(tmp_path / "tolerant"), max_skip_fraction=1)
    result = train(tolerant, dataset=dataset, progress=False, model_transform=_nan_logits)
    assert result.skipped_steps == 10


def _allocate_too_much(model: torch.nn.Module) -> None:
    # More than any address space holds: the allocator fails at once, whatever the machine.
    model.output.register_forward_hook(lambda _m, _i, out: torch.empty(2**50, dtype=torch.uint8))


def test_out_of_memory_in_a_step_names_what_to_lower(tmp_path: Path, dataset) -> None:
    with pytest.raises(RunFailed) as info:
        train(_config(tmp_path), dataset=dataset, progress=False,
              model_transform=_allocate_too_much)  # fmt: skip
    message = str(info.value)
    assert message.startswith("out of memory in step 1 on cpu (")
    assert "lower --batch-size (now 4; raise --grad-accum, now 1, to keep the tokens" in message
    assert "--seq-len (now 32)" in message and "\n" not in message


def test_out_of_memory_building_the_model(tmp_path: Path, dataset) -> None:
    huge = {**SMALL, "ffn_dim": 2**44}  # 32 x 2^44 fp32 weights: more than any address space
    with pytest.raises(RunFailed, match="out of memory building the model on cpu .*smaller --m"):
        train(_config(tmp_path, model_overrides=huge), dataset=dataset, progress=False)
    assert not (tmp_path / "run").exists()  # the directory it created for nothing is gone


def _fail_in_step(step: int):  # noqa: ANN202
    """A model_transform whose model raises in the forward pass of training step ``step``."""
    calls = []

    def fail(_module: torch.nn.Module, _args: tuple) -> None:
        calls.append(None)
        if len(calls) == step:
            raise RuntimeError("device fault")

    return lambda model: model.register_forward_pre_hook(fail)


def test_an_error_in_a_step_names_the_newest_checkpoint(tmp_path: Path, dataset) -> None:
    """An error in step 6 leaves the step-4 checkpoint as it was, and says so (it used to be a
    bare traceback); the resumed run ends as an uninterrupted one does."""
    config = _config(tmp_path, ckpt_every=2, eval_batches=0)
    full = train(dataclasses.replace(config, out_dir=str(tmp_path / "full")), dataset=dataset,
                 progress=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="device fault") as info:
        train(config, dataset=dataset, progress=False, model_transform=_fail_in_step(6))
    newest = Path(config.out_dir) / "checkpoint.pt"
    assert info.value.__notes__ == [
        f"minifloat: the run stopped after step 5; newest checkpoint {newest} (step 4); "
        "continue with --resume once the cause is fixed"
    ]
    rest = train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
    assert rest.losses == full.losses


def test_a_new_run_does_not_replace_an_earlier_one(tmp_path: Path, dataset) -> None:
    config = _config(tmp_path, steps=2, eval_batches=0)
    first = train(config, dataset=dataset, progress=False)
    metrics = first.metrics_path.read_bytes()
    with pytest.raises(RunDirError, match="already holds a run .*--resume .*--overwrite"):
        train(config, dataset=dataset, progress=False)
    assert first.metrics_path.read_bytes() == metrics  # a resume would have found it intact
    second = train(dataclasses.replace(config, overwrite=True, seed=1), dataset=dataset,
                   progress=False)  # fmt: skip
    assert second.losses != first.losses
    steps = [json.loads(x)["step"] for x in second.metrics_path.read_text().splitlines()]
    assert steps == [2]  # the old run's records are gone, not mixed in


def test_checkpoints_by_default_and_a_record_at_each(tmp_path: Path, dataset) -> None:
    """ckpt_every defaults to 500 (it was 0: a crash lost the whole run); a checkpoint step
    always gets a metrics record, so resuming from it loses no logged step."""
    assert TrainConfig().ckpt_every == 500
    config = _config(tmp_path, steps=9, ckpt_every=3, log_every=5, eval_batches=0, stop_after=7)
    train(config, dataset=dataset, progress=False)
    steps = [json.loads(x)["step"] for x in (Path(config.out_dir) / "metrics.jsonl").open()]
    assert steps == [3, 5, 6, 7]
    from minifloat.train.checkpoint import load_checkpoint

    out = Path(config.out_dir)
    assert [load_checkpoint(out / n)["step"] for n in ("checkpoint.pt", "checkpoint.1.pt")] == [
        7,
        6,
    ]


def test_fp8_delayed_losses_do_not_depend_on_the_eval_schedule(tmp_path: Path, dataset) -> None:
    # The amax history advances once per trained step (in backward), never in evaluation.
    often = train(_config(tmp_path / "a", recipe="fp8-delayed", eval_every=2), dataset=dataset,
                  progress=False)  # fmt: skip
    rarely = train(_config(tmp_path / "b", recipe="fp8-delayed", eval_every=8), dataset=dataset,
                   progress=False)  # fmt: skip
    assert often.losses == rarely.losses


def test_size_rule_keeps_small_layers_and_enters_the_fingerprint(tmp_path: Path, dataset) -> None:
    """--size-rule 32:32 keeps the 32 -> 32 attention projections of the one block in bf16 and
    converts the 32 -> 64 / 64 -> 32 FFN layers; a checkpoint of that run does not resume
    without the rule (it changes which layers are quantized: a different trajectory)."""
    from minifloat.linear import QuantLinear

    converted: list[str] = []

    def record(model: torch.nn.Module) -> None:
        converted.extend(n for n, m in model.named_modules() if isinstance(m, QuantLinear))

    config = _config(tmp_path, recipe="fp8-tensorwise", steps=4, size_rule="32:32")
    result = train(config, dataset=dataset, progress=False, model_transform=record)
    assert sorted(converted) == [f"layers.0.feed_forward.w{i}" for i in (1, 2, 3)]
    assert all(math.isfinite(v) for v in result.losses)
    plain = dataclasses.replace(config, size_rule="", steps=6, resume=True)
    with pytest.raises(CheckpointError, match="size_rule"):
        train(plain, dataset=dataset, progress=False)


def test_block_compiled_training_resumes_bit_exactly(tmp_path: Path, dataset) -> None:
    # compile_scope="block" compiles each repeated block in place: the state_dict keeps the
    # plain model's names (checkpoints interchange with eager runs) and a resumed run is exact.
    kw = {"recipe": "fp8-tensorwise", "compile": True, "compile_scope": "block", "steps": 4}
    kw |= {"eval_every": 2, "sqnr_every": 2}
    full = train(_config(tmp_path / "a", **kw), dataset=dataset, progress=False)
    config = _config(tmp_path / "b", **kw)
    half = train(dataclasses.replace(config, stop_after=2), dataset=dataset, progress=False)
    rest = train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
    assert half.losses == full.losses[:2] and rest.losses == full.losses
    body = torch.load(full.checkpoint_path, weights_only=True)
    names = set(body["state"]["model"])
    assert "layers.0.attention.wq.weight" in names and not any("_orig_mod" in n for n in names)
    # the layer-SQNR probe sees the layers inside compiled blocks (it runs them eagerly)
    records = [json.loads(x) for x in full.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records if r.get("layer_sqnr")] == [2, 4]
    assert all(math.isfinite(x) for x in full.losses)


def test_resume_without_a_checkpoint_stops_before_reading_data(tmp_path: Path) -> None:
    """From Python as from the command line: the missing checkpoint is named at once. The data
    path does not exist, so reading data first would have raised another error (it used to
    tokenize the whole corpus, then fail with a bare "no checkpoint at ...")."""
    config = TrainConfig(steps=2, out_dir=str(tmp_path / "run"), resume=True, device="cpu",
                         data=str(tmp_path / "no-such-corpus.txt"))  # fmt: skip
    with pytest.raises(CheckpointError) as info:
        train(config, progress=False)
    assert str(info.value) == (
        f"resume: no checkpoint in {tmp_path / 'run'} (looked for checkpoint.pt); "
        "set resume=False to start a new run"
    )


@pytest.mark.parametrize("scope", ["block", "model"])
def test_compiled_training_and_validation_keep_static_shapes(
    tmp_path: Path, dataset, scope: str
) -> None:
    """A compiled run makes three graphs, training's, validation's (grad mode differs) and the
    loss's, all with static shapes: a validation batch smaller than training's compiles for its
    own size, where automatic dynamic shapes had made a symbolic graph (slow to build on the GPU at
    125M), and the rope tables exist before the first call (made inside it, they recompiled
    step 2)."""
    from torch._dynamo.utils import counters

    val_rows = (len(dataset.val_tokens) - 1) // 32
    config = _config(tmp_path, steps=2, eval_every=1, eval_batches=1, batch_size=val_rows + 1,
                     compile=True, compile_scope=scope)  # fmt: skip
    symbols = []

    class _Symbols(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "create_symbol" in record.getMessage():
                symbols.append(record.getMessage())

    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    handler = _Symbols()
    torch._dynamo.reset()
    counters.clear()
    torch._logging.set_logs(dynamic=logging.INFO)
    shapes_log.addHandler(handler)
    try:
        train(config, dataset=dataset, progress=False)
    finally:
        shapes_log.removeHandler(handler)
        torch._logging.set_logs()
    assert symbols == []
    assert counters["stats"]["unique_graphs"] == 3


def test_bf16_parameters_keep_fp32_rope_tables(tmp_path: Path, dataset) -> None:
    # The "lean" optimizer preset stores bf16 parameters: the cast must not leave bf16 tables
    # for the first (compiled) forward to rebuild.
    trainer = Trainer(_config(tmp_path, optim_states="lean"), dataset=dataset, progress=False)
    assert trainer.raw_model.tok_embeddings.weight.dtype == torch.bfloat16
    assert (
        trainer.raw_model.rope_cos.dtype == torch.float32 and trainer.raw_model.rope_cos.dim() == 2
    )
