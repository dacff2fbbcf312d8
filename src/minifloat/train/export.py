"""Export a trained run (its ``checkpoint.pt``) as a Hugging Face LLaMA model.

The trainer's checkpoint holds the model's state dict and the run's settings; this module
rebuilds the same ``Llama`` from those settings, loads the weights (verified by the checkpoint's
digest) and writes them with :func:`minifloat.models.export_hf`. Quantized layers store a
high-precision weight, so the export is a plain floating-point model: transformers computes the
high-precision forward, not the recipe's quantized one.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from minifloat.errors import first_line
from minifloat.train.checkpoint import load_checkpoint
from minifloat.train.config import TrainConfig, current_settings
from minifloat.train.errors import CheckpointError, ConfigError, RunWarning

__all__ = ["ExportedRun", "LoadedRun", "export_run", "load_run"]


@dataclass(frozen=True, kw_only=True)
class ExportedRun:
    """What :func:`export_run` wrote: the directory, its files and which run they came from."""

    out_dir: Path
    files: tuple[Path, ...]
    recipe: str
    model: str
    step: int


def _load_newest(run_dir: Path, action: str, stacklevel: int) -> tuple[Path, dict]:
    """(path, state) of the newest intact full checkpoint of ``run_dir``; an older one is used,
    with a warning, when the newer ones are damaged."""
    from minifloat.train.checkpointer import (
        CHECKPOINT_NAME,
        checkpoint_candidates,
    )

    if not run_dir.is_dir():
        what = "is a file, not a directory" if run_dir.exists() else "does not exist"
        raise CheckpointError(f"run directory {run_dir} {what}")
    candidates = checkpoint_candidates(run_dir, "full")
    if not candidates and checkpoint_candidates(run_dir, "sharded"):
        raise CheckpointError(
            f"{run_dir} holds a sharded checkpoint; export reads full ones ({CHECKPOINT_NAME}): "
            "sharded checkpoints (--ckpt-format sharded) cannot be exported yet"
        )
    if not candidates:
        raise CheckpointError(
            f"{run_dir} holds no {CHECKPOINT_NAME}; give the --out directory of a finished "
            "`minifloat train` run"
        )
    errors: list[CheckpointError] = []
    for path in candidates:
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            errors.append(exc)
            continue
        if errors:
            warnings.warn(f"{action} {path}: the newer checkpoint is damaged "
                          f"({first_line(errors[0])})", RunWarning,
                          stacklevel=stacklevel + 2)  # this function and load_run  # fmt: skip
        return path, state
    raise errors[0]


def _check_destination(run_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """One-line errors for an export destination that would lose or mix files."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export destination {out_dir} is a file, not a directory")
    if out_dir.exists() and run_dir.exists() and out_dir.resolve() == run_dir.resolve():
        raise ValueError(f"export destination {out_dir} is the run directory itself")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(
            f"export destination {out_dir} is not empty; choose a new directory or pass "
            "overwrite (--overwrite) to replace the export there"
        )


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = False,
    overwrite: bool = False,
) -> ExportedRun:
    """Write the model of the run in ``run_dir`` to ``out_dir`` in the HF LLaMA layout.

    ``with_tokenizer``: also write ``tokenizer.json`` (BPE runs), which re-opens the run's
    dataset (a cache hit when the data cache is still there, else a rebuild). Raises
    :class:`CheckpointError` for a missing, unreadable or unfitting checkpoint, and
    ValueError, before reading anything, for an ``out_dir`` that is a file, the run directory
    itself, or a directory holding files (unless ``overwrite``: then its files of the same
    names are replaced).
    """
    from minifloat.models import export_hf

    _check_destination(Path(run_dir), Path(out_dir), overwrite)
    run = load_run(run_dir, action="exporting", stacklevel=2)
    model, config = run.model, run.config
    if with_tokenizer and config.tokenizer == "byte":
        raise ValueError(
            f"{run_dir} was trained with the byte tokenizer, which has no tokenizer.json: "
            "export without --with-tokenizer"
        )
    tokenizer = None
    if with_tokenizer:
        from minifloat.train.build import load_dataset

        tokenizer = load_dataset(config, progress=False).tokenizer
    # the destination was checked above, against `overwrite`, before the run was read
    out = export_hf(model, out_dir, dtype=dtype, tokenizer=tokenizer, overwrite=True)
    return ExportedRun(
        out_dir=out,
        files=tuple(sorted(p for p in out.iterdir() if p.is_file())),
        recipe=config.recipe,
        model=config.model,
        step=run.step,
    )


@dataclass(frozen=True, kw_only=True)
class LoadedRun:
    """A run's trained model (a plain float32 ``Llama``, unconverted), its settings and step."""

    model: torch.nn.Module
    config: TrainConfig
    path: Path
    step: int


def load_run(run_dir: str | Path, *, action: str = "loading", stacklevel: int = 1) -> LoadedRun:
    """The model of the newest intact full checkpoint in ``run_dir``, rebuilt from the run's
    settings (the high-precision weights that a quantized run keeps); an older checkpoint, with
    a warning that begins with ``action`` and names the line ``stacklevel`` frames above this
    call (1: its caller), when the newer ones are damaged. Raises :class:`CheckpointError` for
    a missing, unreadable or unfitting checkpoint."""
    from minifloat.models import Llama
    from minifloat.train.model import model_config

    path, state = _load_newest(Path(run_dir), action, stacklevel)
    try:
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        stored = current_settings(state["config"])
        config = TrainConfig.from_dict({k: v for k, v in stored.items() if k in known})
        # The saved embedding's rows are the run's vocabulary (the tokenizer is not reopened).
        vocab_size = int(state["model"]["tok_embeddings.weight"].shape[0])
        model = Llama(model_config(config, vocab_size=vocab_size))
        # fp8-delayed amax histories and the random states of recipes that draw (nvfp4, mxfp4)
        # are the quantized layers' training state, not weights.
        training_state = (".amax_history", ".rng_state")
        weights = {k: v for k, v in state["model"].items() if not k.endswith(training_state)}
        model.load_state_dict(weights)
    except (KeyError, RuntimeError, ValueError, ConfigError) as exc:
        reason = first_line(exc)
        raise CheckpointError(f"checkpoint {path} does not describe a model ({reason})") from exc
    return LoadedRun(model=model, config=config, path=path, step=int(state.get("step", 0)))
