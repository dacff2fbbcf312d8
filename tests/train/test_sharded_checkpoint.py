"""minifloat.train.sharded_checkpoint on CPU: the trainer under FSDP2 on 2 gloo processes.

Each test spawns the two ranks once and runs several short trainings inside them (a model of
one layer of width 32, 4 steps): exact resume for torch's and minifloat's AdamW and for the
fp4 and fp8-delayed recipes, then corrupt, incomplete, mismatched and half-saved checkpoints.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from gloo_ranks import WORLD, spawn
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.integrity import CheckpointError, content_digest
from minifloat.train.sharded_checkpoint import (
    MANIFEST_NAME,
    check_manifest,
    read_manifest,
    verify_files,
)

SMALL = {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}
# (recipe, optimizer states): torch AdamW through DCP; minifloat AdamW (bf16 master-less params
# with stochastic rounding; fp8/fp16 block-scaled moments with fp32 masters) saved per rank;
# fp4 quantizes every GEMM; fp8-delayed keeps an amax history (a non-persistent buffer).
EXACT_CASES = [
    ("fp32", "fp32"),
    ("bf16", "bf16"),
    ("fp32", "fp8-fp16"),
    ("fp4", "fp32"),
    ("fp8-delayed", "fp32"),
]
# A final-phase switch to fp8-delayed (switch.py) after step 2, where the run stops: that
# checkpoint was saved before the switch, without amax histories, and DCP loads exactly the keys
# the model holds, so the model must take the recipe it was saved with before loading.
SWITCH = {"recipe": "fp8-tensorwise", "switch_recipe": "fp8-delayed", "switch_at": 0.5}


def _config(root: str, name: str, rank: int, **changes) -> TrainConfig:
    base = TrainConfig(
        recipe="fp32", model="tiny", model_overrides=SMALL, data="stdlib", tokenizer="byte",
        data_max_bytes=100_000, cache_dir=f"{root}/cache{rank}", device="cpu", parallel="fsdp",
        checkpoint_format="sharded", steps=4, batch_size=2, seq_len=16, lr=3e-3, eval_every=0,
        eval_batches=1, log_every=1, out_dir=f"{root}/{name}",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def _dataset(config: TrainConfig):  # noqa: ANN202
    from minifloat.train.build import load_dataset

    return load_dataset(config, progress=False)


def _train(config: TrainConfig, dataset, **changes):  # noqa: ANN001, ANN202
    from minifloat.train.trainer import train

    return train(dataclasses.replace(config, **changes), dataset=dataset, progress=False)


def _exact_worker(rank: int, root: str) -> None:
    dataset = None
    cases = [(f"{r}_{s}", {"recipe": r, "optim_states": s}) for r, s in EXACT_CASES]
    for name, changes in [*cases, ("switch", SWITCH)]:
        full_cfg = _config(root, f"{name}_full", rank, **changes, save_checkpoints=False)
        dataset = dataset or _dataset(full_cfg)
        full = _train(full_cfg, dataset)
        config = _config(root, name, rank, **changes)
        half = _train(config, dataset, stop_after=2)
        assert half.losses == full.losses[:2], name
        assert half.checkpoint_path is not None and half.checkpoint_path.is_dir()
        rest = _train(config, dataset, resume=True)
        assert rest.losses == full.losses, (name, rest.losses, full.losses)  # bit for bit
        assert rest.val_losses == full.val_losses, name


@pytest.mark.slow
def test_sharded_resume_is_bit_exact(tmp_path: Path) -> None:
    spawn(_exact_worker, str(tmp_path))
    run = tmp_path / "fp32_fp32" / "checkpoint.dcp"
    names = sorted(p.name for p in run.iterdir())
    assert names == sorted(
        [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST_NAME, "train_state.pt",
         "rank00000.pt", "rank00001.pt"]
    )  # fmt: skip
    manifest = read_manifest(run)
    assert manifest["step"] == 4 and manifest["world_size"] == WORLD
    assert set(manifest["files"]) == set(names) - {MANIFEST_NAME}
    assert not list(tmp_path.glob("*/.checkpoint.dcp.*"))  # no temp or old directory left


def _branch_worker(rank: int, root: str) -> None:
    plain = _config(root, "plain", rank, recipe="fp4", ckpt_every=0, ckpt_at=(0.5,))
    dataset = _dataset(plain)
    _train(plain, dataset)
    switch = {"recipe": "fp4", "switch_recipe": "bf16", "switch_at": 0.5}
    scratch = _train(_config(root, "scratch", rank, **switch, save_checkpoints=False), dataset)
    for fmt in ("sharded", "full"):  # the branched run may write either format
        config = _config(root, fmt, rank, **switch, checkpoint_format=fmt,
                         branch_from=f"{root}/plain")  # fmt: skip
        branched = _train(config, dataset)
        assert branched.branch_step == 2 and branched.losses == scratch.losses, fmt
        assert branched.val_losses == scratch.val_losses, fmt


@pytest.mark.slow
def test_a_switched_run_branches_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    """Under FSDP the branch loads the plain run's shards (each rank its own) at the switch
    step and ends exactly as the switched run from scratch."""
    spawn(_branch_worker, str(tmp_path))
    assert (tmp_path / "sharded" / "checkpoint.dcp").is_dir()
    assert (tmp_path / "full" / "checkpoint.pt").is_file()


def _expect_error(fn, match: str) -> str:  # noqa: ANN001
    try:
        fn()
    except CheckpointError as exc:
        assert match in str(exc), (match, str(exc))
        return str(exc)
    raise AssertionError(f"no CheckpointError (expected {match!r})")


def _errors_worker(rank: int, root: str) -> None:
    # One checkpoint kept: every damage below must be an error, with no older one to fall back to.
    config = _config(root, "run", rank, steps=6, keep_checkpoints=1)
    dataset = _dataset(config)
    ckpt = Path(config.out_dir) / "checkpoint.dcp"
    stale = ckpt.parent / ".checkpoint.dcp.tmp"
    _expect_error(lambda: _train(config, dataset, resume=True), "no checkpoint")
    reference = _train(dataclasses.replace(config, out_dir=f"{root}/ref", save_checkpoints=False),
                       dataset)  # fmt: skip
    _train(config, dataset, stop_after=2)
    resume = lambda **changes: _train(config, dataset, resume=True, **changes)  # noqa: E731

    # Matched: a different setting is named.
    _expect_error(lambda: resume(lr=1e-3), "lr: checkpoint=0.003, now=0.001")
    # Atomic: a save that died after writing part of its temp directory leaves the checkpoint
    # usable, and the next save replaces the stale directory.
    if rank == 0:
        stale.mkdir()
        (stale / "__0_0.distcp").write_bytes(b"half a shard")
    dist.barrier()
    assert resume(stop_after=4).losses == reference.losses[:4]
    assert not stale.exists()
    # A crash between the two renames of a save: only the old directory is left.
    if rank == 0:
        shutil.copytree(ckpt, ckpt.parent / "backup")
        os.replace(ckpt, ckpt.parent / ".checkpoint.dcp.old")
    dist.barrier()
    assert resume().losses == reference.losses
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt)
        shutil.copytree(ckpt.parent / "backup", ckpt)  # at step 4 again
    dist.barrier()

    # Verified: a flipped bit in a shard, a missing shard, a file not in the manifest.
    shard = ckpt / "__1_0.distcp"
    data = shard.read_bytes()
    dist.barrier()
    if rank == 0:
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(flipped))
    dist.barrier()
    _expect_error(resume, "__1_0.distcp is corrupt (SHA-256 mismatch)")
    dist.barrier()
    if rank == 0:
        shard.unlink()
    dist.barrier()
    _expect_error(resume, "__1_0.distcp is missing")
    dist.barrier()
    if rank == 0:
        shard.write_bytes(data)
        text = (ckpt / MANIFEST_NAME).read_text()
        (ckpt / MANIFEST_NAME).write_text(text.replace('"step": 4', '"step": 5'))
    dist.barrier()
    _expect_error(resume, "manifest digest mismatch")
    dist.barrier()
    if rank == 0:
        # A self-consistent manifest (digest recomputed) that leaves out one rank's file.
        manifest = json.loads(text)
        del manifest["files"]["rank00001.pt"], manifest["digest"]
        manifest["digest"] = content_digest(manifest)
        (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    dist.barrier()
    _expect_error(resume, "rank00001.pt is not in the manifest")
    dist.barrier()

    # With two kept (the default), a corrupt newest checkpoint falls back to the one before
    # (every rank to the same one) and the run still ends exactly as the uninterrupted one.
    config = _config(root, "fallback", rank, steps=6, ckpt_every=2)
    _train(config, dataset, stop_after=4)
    newest = Path(config.out_dir) / "checkpoint.dcp"
    assert (newest.parent / "checkpoint.1.dcp").is_dir()
    if rank == 0:
        shard = newest / "__0_0.distcp"
        flipped = bytearray(shard.read_bytes())
        flipped[len(flipped) // 2] ^= 0x01
        shard.write_bytes(bytes(flipped))
    dist.barrier()
    assert _train(config, dataset, resume=True).losses == reference.losses


@pytest.mark.slow
def test_bad_sharded_checkpoints_raise(tmp_path: Path) -> None:
    spawn(_errors_worker, str(tmp_path))
    manifest = read_manifest(tmp_path / "run" / "backup")
    fields = dict(manifest["fields"])
    check_manifest(manifest, fields=fields, world_size=WORLD)
    with pytest.raises(CheckpointError, match="written by 2 ranks, this run has 4"):
        check_manifest(manifest, fields=fields, world_size=4)
    with pytest.raises(CheckpointError, match="recipe: checkpoint='fp32', now='fp4'"):
        check_manifest(manifest, fields={**fields, "recipe": "fp4"}, world_size=WORLD)


def _failed_save_worker(rank: int, root: str) -> None:
    import torch
    from torch import nn

    from minifloat.train.sharded_checkpoint import save_sharded

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    path, fields = Path(root) / "checkpoint.dcp", {"recipe": "fp32"}

    def save(step: int, rank_state: dict) -> Path:
        return save_sharded(path, model=model, optimizer=optimizer, global_state={"step": step},
                            rank_state=rank_state, fields=fields)  # fmt: skip

    def check_failed(step: int, rank_state: dict, reason: str) -> None:
        message = _expect_error(lambda: save(step, rank_state), f"rank 1: {reason}")
        assert "rank 0" not in message, message
        dist.barrier()  # both ranks are past the failed save before the directory is read
        assert read_manifest(path)["step"] == 1  # the earlier checkpoint, whole
        verify_files(path, read_manifest(path)["files"], rank, WORLD)
        assert not list(Path(root).glob(".checkpoint.dcp.*"))  # the incomplete save removed
        dist.barrier()

    save(1, {"rank": rank})
    # Rank 1 alone cannot write its own file (an object torch.save cannot pickle): every rank
    # must learn it, none may wait for the others.
    unpicklable = {"rank": rank, "hook": lambda: None} if rank == 1 else {"rank": rank}
    check_failed(2, unpicklable, "Can't pickle")
    # Rank 1's shard write fails inside DCP (a file-size limit, as a full disk): DCP raises a
    # BaseException on every rank whose first line names no reason; the reason must come out.
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG, not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, limit[1]))
    try:
        check_failed(3, {"rank": rank}, f"[Errno {errno.EFBIG}]")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)

    # A shard that goes bad after verification (before_model runs between the two): DCP's
    # reads of rank 1's file fail; every rank stops with the reason rather than a traceback, and no
    # rank falls back to an older checkpoint (which would delete this one).
    def truncate_rank1_shard(step: int) -> None:
        if rank == 1:
            shard = path / "__1_0.distcp"
            shard.write_bytes(shard.read_bytes()[:16])
        dist.barrier()

    from minifloat.train.errors import RunFailed
    from minifloat.train.sharded_checkpoint import load_sharded

    try:
        load_sharded(path, model=model, optimizer=optimizer, fields=fields,
                     before_model=truncate_rank1_shard)  # fmt: skip
    except RunFailed as exc:
        assert "could not read the shards of checkpoint" in str(exc), str(exc)
        assert "rank 1: EOFError" in str(exc), str(exc)  # (rank 0 reads from it too)
    else:
        raise AssertionError("no RunFailed")


def test_a_save_or_read_that_fails_on_one_rank_stops_every_rank_with_its_reason(
    tmp_path: Path,
) -> None:
    """A sharded save that failed on one rank used to raise there alone: the other rank waited
    in the save's next barrier until the process group's timeout (here 60 s, gloo's default
    30 minutes). A failed shard write raised DCP's CheckpointException, a BaseException the
    trainer's one-line stop did not catch, whose message names no reason; so did a failed read
    of verified shards."""
    spawn(_failed_save_worker, str(tmp_path), timeout_s=60)


def test_verify_files_reports_missing_unlisted_and_corrupt(tmp_path: Path) -> None:
    (tmp_path / "a.pt").write_bytes(b"a")
    (tmp_path / "b.pt").write_bytes(b"b")
    sha = {name: hashlib.sha256(name[0].encode()).hexdigest() for name in ("a.pt", "b.pt")}
    verify_files(tmp_path, sha, 0, 1)
    with pytest.raises(CheckpointError, match="b.pt is not in the manifest"):
        verify_files(tmp_path, {"a.pt": sha["a.pt"]}, 0, 1)
    with pytest.raises(CheckpointError, match="c.pt is missing"):
        verify_files(tmp_path, {**sha, "c.pt": sha["a.pt"]}, 0, 1)
    with pytest.raises(CheckpointError, match="a.pt is corrupt"):
        verify_files(tmp_path, {**sha, "a.pt": sha["b.pt"]}, 0, 1)


@pytest.mark.parametrize("parallel", ["none", "ddp"])
def test_sharded_format_needs_fsdp(parallel: str) -> None:
    with pytest.raises(ConfigError, match="checkpoint-format sharded needs parallel=fsdp"):
        TrainConfig(parallel=parallel, checkpoint_format="sharded")
    with pytest.raises(ConfigError, match="checkpoint-format must be one of full, sharded"):
        TrainConfig(parallel="fsdp", checkpoint_format="zip")
    assert TrainConfig().checkpoint_format == "full"
    fields = TrainConfig(parallel="fsdp", checkpoint_format="sharded").trajectory_fields(2)
    assert "checkpoint_format" not in fields  # the format does not change the trajectory
