"""Training metrics: JSONL log, optional TensorBoard, progress display, MFU.

Only rank 0 writes; other ranks get a disabled logger. The JSONL file (``metrics.jsonl`` in the
run directory) has one JSON object per log step with the keys ``step``, ``recipe`` (the recipe
that took the step: a final-phase switch changes it), ``loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``skipped``, on CUDA ``peak_mem_gib`` (the peak allocated memory of training
since the run, or its resumed part, started) and, on evaluation steps, ``val_loss``. With
``sqnr_every`` the diagnostic records ``{"step": ..., "layer_sqnr": {layer: {operand: dB}}}``
(see diagnostics.py; on CUDA also ``probe_peak_mem_gib``, the probe's own peak, which is kept out
of ``peak_mem_gib``) are interleaved; readers select records by their keys.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from minifloat.train.errors import RunWarning

__all__ = [
    "PEAK_FLOPS",
    "LogWindow",
    "MetricsLogger",
    "ProgressDisplay",
    "copy_records",
    "mfu",
    "peak_flops",
]

# Dense bf16 tensor-core peak (FLOP/s, no sparsity) by GPU name substring. MFU is always reported
# against this bf16 peak, also for fp8/fp4 recipes, so numbers compare across recipes.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` from :data:`PEAK_FLOPS`, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS.items():
        if key in name:
            return flops
    return None


def mfu(
    flops_per_token: float, tokens_per_s: float, peak: float | None, *, devices: int = 1
) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over the peak of `devices` devices.

    `tokens_per_s` is the rate of all `devices` together and `peak` one device's peak FLOP/s;
    None if the peak is unknown.
    """
    if peak is None or peak <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * devices)


class LogWindow:
    """The steps since the last record: a record reports their mean loss and their speed.

    ``tokens_per_step`` counts every rank's tokens; MFU is reported against ``devices`` times
    the ``peak`` of one device (None where the peak is unknown).
    """

    def __init__(
        self, *, tokens_per_step: int, flops_per_token: float, peak: float | None, devices: int
    ) -> None:
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.devices = peak, devices
        self._steps: list[tuple[float, float]] = []

    def add(self, loss: float, seconds: float) -> None:
        """Count one step of ``loss`` that took ``seconds``."""
        self._steps.append((loss, seconds))

    def __len__(self) -> int:
        return len(self._steps)

    def flush(self) -> dict[str, Any]:
        """``loss``, ``tokens_per_s`` and ``mfu`` over the steps added since the last flush."""
        losses, times = zip(*self._steps, strict=True)
        self._steps = []
        tokens_per_s = self.tokens_per_step * len(times) / max(sum(times), 1e-9)
        return {
            "loss": sum(losses) / len(losses),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak, devices=self.devices),
        }


class MetricsLogger:
    """Append metric records to ``<out_dir>/metrics.jsonl`` (and TensorBoard if installed).

    A new run starts a new file. ``resume_step`` continues an existing file instead, dropping
    records after that step (written after the checkpoint by the interrupted run, which the
    resumed run will repeat). The kept records are rewritten atomically (temporary file, fsync,
    rename) and only when something must go, so a resumed run killed before its first record
    loses nothing already recorded. A line that is not a JSON record (the torn last line of a
    killed run) is dropped with a :class:`~minifloat.train.errors.RunWarning`.
    """

    def __init__(
        self, out_dir: Path, *, enabled: bool = True, resume_step: int | None = None
    ) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self._file = self.path.open("w", encoding="utf-8")
        else:
            self._keep_until(resume_step)
            self._file = self.path.open("a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return
        self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))

    def _keep_until(self, step: int) -> None:
        """Drop the records after ``step`` and damaged lines, rewriting the file atomically."""
        if not self.path.is_file():
            return
        raw = self.path.read_bytes()
        text = _records_until(self.path, raw, step)
        if text != raw:
            _write_atomically(self.path, text)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (must contain ``step``)."""
        if not self.enabled or self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in _scalars(record).items():
                if key != "step":
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _parse_record(line: str) -> dict[str, Any] | None:
    """The JSON record on ``line``, or None if it is not one (an object with an integer step)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("step"), int)
    return record if ok else None


def _records_until(path: Path, raw: bytes, step: int) -> bytes:
    """The lines of ``raw`` (the content of ``path``) that hold records of steps up to
    ``step``; damaged lines are dropped with a :class:`RunWarning`."""
    lines = raw.decode("utf-8", errors="replace").splitlines(keepends=True)
    kept, damaged = [], []
    for number, line in enumerate(lines, start=1):
        record = _parse_record(line)
        if record is None:
            if line.strip("\x00 \t\r\n"):  # blank and NUL-padded tails are not news
                damaged.append(number)
        elif record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if damaged:
        which = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        warnings.warn(f"{path}: dropped damaged line(s) {which} (not a JSON record)",
                      RunWarning, stacklevel=4)  # fmt: skip
    return "".join(kept).encode("utf-8")


def copy_records(source: Path, dest: Path, *, until: int, extra: dict[str, Any]) -> None:
    """Write ``dest`` (a metrics file) atomically: the records of the metrics file ``source``
    up to step ``until`` (none if it does not exist), then the record ``extra``.

    A run branched from another (branch.py) starts with the records of the steps it shares
    with that run, so its curves are whole; ``source`` is only read.
    """
    raw = source.read_bytes() if source.is_file() else b""
    text = _records_until(source, raw, until) + (json.dumps(extra) + "\n").encode("utf-8")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(dest, text)


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` through a temporary file in the same directory."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a record, nested keys joined by '/' (TensorBoard tags)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + key] = value
    return out


def _fmt(fields: dict[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        if value is None:
            continue
        if key == "mfu":
            parts.append(f"mfu {100 * value:.1f}%")
        elif key == "tok/s":
            parts.append(f"tok/s {value:,.0f}")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        else:
            parts.append(f"{key} {value}")
    return "  ".join(parts)


class ProgressDisplay:
    """A rich progress bar on a terminal, plain periodic lines otherwise (or nothing).

    ``mode``: "rich", "plain" or "off"; "auto" picks rich when stdout is a TTY.
    """

    def __init__(
        self, total: int, *, mode: str = "auto", label: str = "train", print_every: int = 10
    ) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.total = total
        self.label = label
        self.print_every = max(1, print_every)
        self._progress = None
        self._task = None
        self._start = time.perf_counter()
        if mode == "rich":
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                )
            except ImportError:
                self.mode = "plain"
                return
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._progress.start()
            self._task = self._progress.add_task(label, total=total, info="")

    def update(self, step: int, fields: dict[str, Any], *, force: bool = False) -> None:
        """Show the state after ``step`` steps (1-based count of completed steps)."""
        if self.mode == "rich" and self._progress is not None:
            self._progress.update(self._task, completed=step, info=_fmt(fields))
        elif self.mode == "plain" and (force or step % self.print_every == 0 or step == self.total):
            print(f"[{self.label}] step {step}/{self.total}  {_fmt(fields)}", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
