"""Sharded training checkpoints for FSDP runs: every rank writes and reads only its own shards.

A full checkpoint (:mod:`minifloat.train.checkpoint`) gathers the whole state to rank 0 and every
rank reads the whole file back: at 7B (81 GB of fp32 weights and AdamW moments) that takes
minutes and, on resume, world-size copies of the state in host memory. A sharded checkpoint is a
directory (``<out>/checkpoint.dcp``)::

    manifest.json      format, version, step, world size, fingerprinted settings and the
                       SHA-256 of every other file (plus a digest of the manifest itself)
    .metadata          torch.distributed.checkpoint's index of the shards
    __<rank>_0.distcp  model (and torch AdamW) shards, written by each rank in parallel
    train_state.pt     step, loss scaler, step guard, losses, config (rank 0)
    rank<NNNNN>.pt     per rank: data position, RNG states, non-persistent buffers (e.g. the
                       fp8-delayed amax history) and, for minifloat's AdamW, its local state

The three properties of the full format hold:

* **Atomic**: written to ``.checkpoint.dcp.tmp``; after a barrier rank 0 moves the old directory
  aside, renames the new one into place and deletes the old one. A crash before the renames
  leaves the previous checkpoint in place (a stale temp directory is ignored and later
  replaced); a crash between them leaves ``.checkpoint.dcp.old``, which a resume falls back to.
* **Verified**: every file is hashed (the ranks share the work) and checked on load; a flipped
  bit, a missing file or a file the manifest does not list raises :class:`CheckpointError` on
  every rank.
* **Matched**: the trajectory fingerprint (:func:`minifloat.train.integrity.fingerprint`) and the
  world size must match; a mismatch names the differing fields. There is no resharding: the
  per-rank data positions, RNG states and amax histories belong to a rank.

minifloat's AdamW stores low-precision payloads with rank-local block scales, and its portable
``state_dict()`` decodes them to fp32 (re-encoding them on load is not bit-exact for scaled or
stochastic formats). Its state is therefore saved as is, per rank, next to the DCP shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minifloat.errors import first_line
from minifloat.train.errors import CheckpointMismatchError, RunFailed
from minifloat.train.integrity import (
    CheckpointError,
    check_header,
    content_digest,
    describe_mismatch,
    fingerprint,
    fsync_dir,
    read_torch_file,
)
from minifloat.train.slots import rotate

__all__ = [
    "MANIFEST_NAME",
    "SHARDED_FORMAT",
    "SHARDED_VERSION",
    "check_manifest",
    "load_sharded",
    "old_dir",
    "read_manifest",
    "read_sharded_config",
    "save_sharded",
    "verify_files",
]

SHARDED_FORMAT = "minifloat-sharded-checkpoint"
SHARDED_VERSION = 1
MANIFEST_NAME = "manifest.json"
GLOBAL_NAME = "train_state.pt"
_HASH_CHUNK = 16 << 20


def _rank_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _tmp_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp"


def old_dir(path: Path) -> Path:
    """Where a save that crashed between its two renames left the previous checkpoint."""
    return path.parent / f".{path.name}.old"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj: Any) -> Any:
    if _world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _save_file(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _data_files(directory: Path) -> list[str]:
    """Every file of a checkpoint directory except the manifest, sorted (rank-independent)."""
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    )


# ---- minifloat AdamW: its local state, byte for byte --------------------------------------------


def _is_minifloat_adamw(optimizer: torch.optim.Optimizer) -> bool:
    from minifloat.optim import AdamW

    return isinstance(optimizer, AdamW)


def _local_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """minifloat AdamW's rank-local state (payloads, scales, masters) keyed by parameter name."""
    state: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if p in optimizer.state:
            state[name] = {
                k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                for k, v in optimizer.state[p].items()
            }
    return {"state": state, "generators": optimizer.generator_states()}


def _restore_local_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> None:
    params = dict(model.named_parameters())
    unknown = sorted(set(saved["state"]) - set(params))
    if unknown:
        raise CheckpointError(f"optimizer state for unknown parameters: {', '.join(unknown[:3])}")
    optimizer.state.clear()
    for name, values in saved["state"].items():
        p = params[name]
        local = p.to_local() if hasattr(p, "to_local") else p
        optimizer.state[p] = {
            # "step" lives on the CPU, as AdamW creates it.
            k: (v if k == "step" else v.to(local.device)) if torch.is_tensor(v) else v
            for k, v in values.items()
        }
    optimizer.set_generator_states(saved["generators"])


# ---- the distributed (DCP) part -----------------------------------------------------------------


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state DCP saves/loads: sharded model, plus the optimizer unless it is minifloat's."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=False)
    if _is_minifloat_adamw(optimizer):
        return {"model": get_model_state_dict(model, options=options)}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def _set_dcp_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(full_state_dict=False)
    if "optim" in state:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
    else:
        set_model_state_dict(model, state["model"], options=options)


# ---- save ---------------------------------------------------------------------------------------


def save_sharded(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    global_state: Mapping[str, Any],
    rank_state: Mapping[str, Any],
    fields: Mapping[str, Any],
    keep: int = 1,
) -> Path:
    """Write a sharded checkpoint directory at ``path``; every rank must call it.

    ``global_state`` (identical on every rank; rank 0 writes it) must hold ``"step"``;
    ``rank_state`` is this rank's own state. ``fields`` are the fingerprinted run settings.
    ``keep``: how many checkpoints to keep (the older ones as ``checkpoint.1.dcp``, ...).
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    rank, world = _world()
    tmp = _tmp_dir(path)

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            tmp.mkdir(parents=True)

    def write() -> None:
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(tmp))
        local = dict(rank_state)
        if _is_minifloat_adamw(optimizer):
            local["optimizer"] = _local_optimizer_state(model, optimizer)
        _save_file(local, tmp / _rank_name(rank))
        if rank == 0:
            _save_file(dict(global_state), tmp / GLOBAL_NAME)

    def hash_share() -> dict[str, str]:
        files = _data_files(tmp)
        return {name: _file_sha256(tmp / name) for name in files[rank::world]}

    def publish(hashes: dict[str, str]) -> None:
        if rank == 0:
            manifest = {
                "format": SHARDED_FORMAT,
                "version": SHARDED_VERSION,
                "step": int(global_state["step"]),
                "world_size": world,
                "fields": json.loads(json.dumps(dict(fields), default=str)),
                "fingerprint": fingerprint(fields),
                "files": hashes,
            }
            manifest["digest"] = content_digest(manifest)
            _save_text(json.dumps(manifest, indent=1, sort_keys=True), tmp / MANIFEST_NAME)
            _swap_in(tmp, path, keep)

    try:
        _every_rank(prepare)
        _every_rank(write)  # every rank's files are complete before any is hashed
        hashes = {k: v for part in _every_rank(hash_share) for k, v in part.items()}
        _every_rank(lambda: publish(hashes))
    except CheckpointError:
        if rank == 0:  # every rank is past its writes: the incomplete directory can go
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _every_rank(part: Callable[[], Any]) -> list[Any]:
    """Run this rank's ``part`` of a save, then hear from every rank: what each returned, in
    rank order, or, when the part failed on any rank, CheckpointError on all of them, naming
    each failed rank and its reason.

    A rank that raised alone (its disk full, say) left the others waiting in the save's next
    collective, silent, until the launcher killed them or the process group timed out (30
    minutes under gloo); this exchange is that collective, and it carries the failure.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    result, failed, error = None, {}, None
    try:
        result = part()
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
        failed, error = _failed_ranks(exc), exc
    outcomes = _gather((failed, result))
    failed = {rank: why for f, _ in outcomes for rank, why in f.items()}
    if failed:
        raise CheckpointError(_reasons(failed)) from error
    return [r for _, r in outcomes]


def _failed_ranks(exc: BaseException) -> dict[int, str]:
    """{rank: the first line of its error} for an exception of this rank's part of a save.
    DCP raises one CheckpointException on every rank that lists the ranks whose writes failed
    (its own first line, "CheckpointException ranks:dict_keys([1])", names no reason)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return {int(rank): first_line(pair[0] if isinstance(pair, tuple) else pair)
                for rank, pair in failures.items()}  # fmt: skip
    return {_world()[0]: first_line(exc)}


def _reasons(failed: dict[int, str]) -> str:
    """{rank: reason} as "rank 1: reason; rank 3: reason"; the reason alone on one process."""
    if _world()[1] == 1:
        return "; ".join(failed.values())
    return "; ".join(f"rank {rank}: {why}" for rank, why in sorted(failed.items()))


def _save_text(text: str, path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _swap_in(tmp: Path, path: Path, keep: int) -> None:
    """Replace ``path`` by ``tmp``: at every moment one complete checkpoint can be found.

    With ``keep`` > 1 the old one becomes ``checkpoint.1.dcp`` (slots.py), else it is deleted.
    """
    fsync_dir(tmp)
    if keep > 1:
        rotate(path, keep)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return
    old = old_dir(path)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


# ---- load ---------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (or of its ``.old`` copy left by a crash
    between the two renames of a save), its own digest checked."""
    path = _existing(Path(path))
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has no readable manifest ({exc})") from exc
    check_header(manifest, path, fmt=SHARDED_FORMAT, version=SHARDED_VERSION, what="manifest",
                 not_this_format=f"{path} is not a minifloat sharded checkpoint")  # fmt: skip
    manifest["path"] = str(path)
    return manifest


def read_sharded_config(path: str | os.PathLike) -> Any:
    """The ``config`` saved in the global state of the sharded checkpoint at ``path`` (None if
    absent); only the manifest's digest is checked, the tensors stay memory-mapped."""
    directory = Path(read_manifest(path)["path"])
    state = read_torch_file(directory / GLOBAL_NAME, mmap=True)
    return state.get("config") if isinstance(state, dict) else None


def _existing(path: Path) -> Path:
    if path.is_dir():
        return path
    if old_dir(path).is_dir():
        return old_dir(path)
    raise CheckpointError(f"no checkpoint at {path}")


def check_manifest(
    manifest: Mapping[str, Any], *, fields: Mapping[str, Any], world_size: int
) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint fits this run."""
    where = manifest.get("path", "")
    if manifest["world_size"] != world_size:
        raise CheckpointMismatchError(
            f"sharded checkpoint {where} was written by {manifest['world_size']} ranks, this run "
            f"has {world_size}; resume on the same number of ranks (per-rank data positions, "
            "RNG states and amax histories are not resharded)"
        )
    if manifest["fingerprint"] != fingerprint(fields):
        raise CheckpointMismatchError(
            f"checkpoint {where} was written by a different run "
            f"({describe_mismatch(manifest['fields'], fields)})"
        )


def verify_files(directory: Path, listed: Mapping[str, str], rank: int, world: int) -> None:
    """Check that ``directory`` holds exactly the ``listed`` files (name -> SHA-256), hashing
    this rank's share of them; raise the first problem any rank found, on every rank."""
    present = _data_files(directory)
    problems = [f"file {n} is missing" for n in sorted(set(listed) - set(present))]
    problems += [f"file {n} is not in the manifest" for n in sorted(set(present) - set(listed))]
    for name in sorted(set(listed) & set(present))[rank::world]:
        if _file_sha256(directory / name) != listed[name]:
            problems.append(f"file {name} is corrupt (SHA-256 mismatch)")
    found = [p for part in _gather(problems) for p in part]
    if found:
        raise CheckpointError(f"checkpoint {directory}: {found[0]}")


def _load_file(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({exc})") from exc


def load_sharded(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    fields: Mapping[str, Any],
    before_model: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify the checkpoint at ``path``, load this rank's shards into ``model`` and
    ``optimizer``, and return (global state, this rank's state); every rank must call it.
    ``before_model(step)`` runs before the model state is loaded (see Checkpointer.load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    rank, world = _world()
    # Rank 0 picks the directory: all ranks must read the same one.
    found = _from_rank0(_safe(lambda: read_manifest(path)) if rank == 0 else None)
    if isinstance(found, str):
        raise CheckpointError(found)
    manifest = found
    directory = Path(manifest["path"])
    check_manifest(manifest, fields=fields, world_size=world)
    verify_files(directory, manifest["files"], rank, world)
    if before_model is not None:
        before_model(int(manifest["step"]))
    state = _dcp_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(directory))
    except CheckpointException as exc:  # a BaseException, raised on every rank
        # The files were verified: what failed is the reading (I/O, memory), not the
        # checkpoint, so this stops the run rather than falling back (which deletes it).
        reasons = _reasons(_failed_ranks(exc))
        raise RunFailed(f"could not read the shards of checkpoint {directory} ({reasons})") from exc
    _set_dcp_state(model, optimizer, state)
    local = _load_file(directory / _rank_name(rank))
    if "optimizer" in local:
        _restore_local_optimizer_state(model, optimizer, local.pop("optimizer"))
    return _load_file(directory / GLOBAL_NAME), local


def _safe(read: Any) -> Any:
    """``read()``, or its CheckpointError's message (sent to every rank instead of raising)."""
    try:
        return read()
    except CheckpointError as exc:
        return str(exc)
