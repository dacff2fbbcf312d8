"""The reference training loop: any recipe, mixed precision, step guard, exact resume.

``train(TrainConfig(...))`` builds the dataset and a LLaMA preset, converts its linear layers when
the recipe is quantized, and runs AdamW with warm-up + cosine decay, gradient accumulation and
clipping. Each step:

1. forward under the recipe's autocast; the loss (cross entropy, optional z-loss) in fp32;
2. backward of the (loss-scaled, for fp16) loss, accumulated over ``grad_accum`` micro-batches;
3. unscale, clip and measure the global gradient norm; the loss scaler and the step guard
   decide whether the update is applied (a skipped step leaves weights and optimizer untouched);
4. log, evaluate, measure per-layer quantization SQNR and checkpoint on schedule (rank 0 only).

Under torchrun the model is wrapped with DDP (plus a gradient-communication hook) or FSDP2; the
model itself knows nothing about parallelism.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minifloat import recipes
from minifloat.amp import autocast_context, full_precision
from minifloat.errors import first_line
from minifloat.train import checkpoint as ckpt
from minifloat.train.checkpointer import CHECKPOINT_NAME, SHARDED_CHECKPOINT_NAME
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.loss_scaler import LossScaler
from minifloat.train.metrics import MetricsLogger, ProgressDisplay, mfu, peak_flops
from minifloat.train.runtime import Runtime, all_gather_objects, mean_across_ranks, seed_everything
from minifloat.train.runtime import setup as setup_runtime
from minifloat.train.schedule import lr_at
from minifloat.train.stability import StepGuard, StepGuardConfig, z_loss
from minifloat.train.state import extra_buffers, full_state, load_full_state, restore_buffers

__all__ = [
    "TrainResult",
    "Trainer",
    "check_names",
    "evaluate",
    "load_dataset",
    "train",
]

# Final train loss is the mean over this many last steps: one step's loss is too noisy to rank
# recipes by.
FINAL_LOSS_WINDOW = 10


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Summary of a finished (or stopped) run; ``losses`` has one entry per optimizer step.

    ``tokens_per_s`` is the steady-state speed (tokens per step over the median step time);
    ``rank`` is this process's rank (every rank returns a result under torchrun).
    """

    recipe: str
    model: str
    num_params: int
    steps: int
    tokens: int
    final_loss: float
    final_val_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int | None
    skipped_steps: int
    losses: tuple[float, ...]
    val_losses: tuple[tuple[int, float], ...]
    out_dir: Path
    metrics_path: Path
    checkpoint_path: Path | None
    rank: int = 0


def train(
    config: TrainConfig,
    *,
    dataset: Any = None,
    progress: bool | str = "auto",
    model_transform: Callable[[nn.Module], Any] | None = None,
) -> TrainResult:
    """Run training as configured and return its summary.

    ``dataset``: an already built ``TokenDataset`` (skips ``build_dataset``; e.g. to train
    several recipes on the same data). ``progress``: True/"auto" (rich bar on a terminal, plain
    lines otherwise), "plain", or False/"off". ``model_transform``: called on the (converted)
    model before FSDP/compile/DDP wrap it, to swap in another library's layers (e.g. torchao's
    float8 for a same-trainer comparison); it changes the model in place.
    """
    trainer = Trainer(config, dataset=dataset, progress=progress, model_transform=model_transform)
    try:
        return trainer.run()
    finally:
        trainer.close()


def load_dataset(config: TrainConfig, *, progress: bool = True) -> Any:
    """Build (or load from cache) the TokenDataset that ``config`` trains on."""
    from minifloat.data import build_dataset

    cfg = config.resolved()
    kwargs: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "tokenizer": cfg.tokenizer,
        "seq_len": cfg.seq_len,
        "progress": progress,
    }
    if cfg.cache_dir is not None:
        kwargs["cache_dir"] = Path(cfg.cache_dir)
    if cfg.data_max_bytes:
        kwargs["max_bytes"] = cfg.data_max_bytes
    return build_dataset(cfg.data, **kwargs)


def check_names(config: TrainConfig) -> None:
    """Fail fast (before any data work) on an unknown recipe, model, model override or
    optimizer-state name."""
    from minifloat.models.llama import PRESETS
    from minifloat.train.config import check_model_overrides

    recipes.get(config.recipe)
    if config.model not in PRESETS:
        raise ConfigError(f"unknown model {config.model!r}; choose one of {', '.join(PRESETS)}")
    check_model_overrides(config.model, config.model_overrides)
    if config.optim_states != "fp32":
        from minifloat.optim import OPTIM_STATE_PRESETS

        if config.optim_states not in OPTIM_STATE_PRESETS:
            raise ConfigError(
                f"unknown optimizer states {config.optim_states!r}; choose one of "
                f"{', '.join(OPTIM_STATE_PRESETS)}"
            )


def _progress_mode(progress: bool | str) -> str:
    if progress is True:
        return "auto"
    if progress is False:
        return "off"
    return progress


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear weights and the embedding), none on norms and biases."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokens: Any,
    *,
    recipe: recipes.Recipe,
    device: torch.device,
    batch_size: int,
    seq_len: int,
    batches: int,
    rank: int = 0,
    world_size: int = 1,
) -> float:
    """Mean cross-entropy over the first ``batches`` sequential batches of ``tokens``.

    Sequential windows make every evaluation see exactly the same text, so validation losses
    are comparable across steps and recipes.
    """
    from minifloat.data import BatchIterator

    iterator = BatchIterator(
        tokens, batch_size, seq_len, mode="sequential", rank=rank, world_size=world_size
    )
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for _ in range(batches):
            inputs, targets = iterator.next()
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast_context(recipe, device):
                logits = model(inputs)
            with full_precision(device):
                total += float(_cross_entropy(logits, targets))
    finally:
        model.train(was_training)
    return total / batches


class Trainer:
    """One training run; :func:`train` is the usual entry point."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        dataset: Any = None,
        progress: bool | str = "auto",
        model_transform: Callable[[nn.Module], Any] | None = None,
    ) -> None:
        self.config = config.resolved()
        self.model_transform = model_transform
        check_names(self.config)
        self.recipe = recipes.get(self.config.recipe)
        self.runtime: Runtime = setup_runtime(self.config.device)
        self.logger: MetricsLogger | None = None
        try:
            self._setup(dataset, progress)
        except BaseException:
            self.runtime.close()
            raise

    def _setup(self, dataset: Any, progress: bool | str) -> None:
        self.progress_mode = _progress_mode(progress) if self.runtime.is_main else "off"
        self.out_dir = Path(self.config.out_dir)
        self.total_steps = self.config.total_steps(self.runtime.world_size)
        seed_everything(self.config.seed)
        self.dataset = dataset if dataset is not None else self._build_dataset()
        self._build_model()
        self._build_optimizer()
        self.scaler = LossScaler(enabled=self.recipe.loss_scaling)
        self.guard = StepGuard(
            StepGuardConfig(
                spike_k=self.config.spike_k,
                grad_norm_spike_k=self.config.grad_norm_spike_k,
                warmup_steps=self.config.spike_warmup,
            )
        )
        self._build_iterator()
        self.step = 0
        self.losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self.tokens_per_step = (
            self.config.batch_size
            * self.config.seq_len
            * self.config.grad_accum
            * self.runtime.world_size
        )

    # ---- setup --------------------------------------------------------------------------------

    def _build_dataset(self) -> Any:
        # Rank 0 builds (and caches) first so the other ranks only read the cache.
        distributed, main = self.runtime.distributed, self.runtime.is_main
        if distributed and not main:
            torch.distributed.barrier()
        dataset = load_dataset(self.config, progress=self.progress_mode != "off")
        if distributed and main:
            torch.distributed.barrier()
        return dataset

    def _build_model(self) -> None:
        from minifloat.train.model import build_model

        built = build_model(
            self.config,
            self.recipe,
            self.runtime,
            vocab_size=self.dataset.tokenizer.vocab_size,
            model_transform=self.model_transform,
        )
        self.model_config, self.raw_model, self.model = built
        self.num_params = sum(p.numel() for p in self.raw_model.parameters())

    def _build_optimizer(self) -> None:
        cfg = self.config
        groups = _param_groups(self.raw_model, cfg.weight_decay)
        kwargs = {"lr": lr_at(0, **self._lr_kwargs()), "betas": cfg.betas, "eps": cfg.eps}
        if cfg.optim_states == "fp32":
            fast = {"fused": True} if self.runtime.device.type == "cuda" else {"foreach": True}
            if cfg.parallel == "fsdp":
                fast = {"foreach": True}
            self.optimizer = torch.optim.AdamW(groups, **kwargs, **fast)
            return
        from minifloat.optim import OPTIM_STATE_PRESETS, AdamW

        preset = dict(OPTIM_STATE_PRESETS[cfg.optim_states])
        self.optimizer = AdamW(groups, **kwargs, **preset, seed=cfg.seed)

    def _build_iterator(self) -> None:
        from minifloat.data import BatchIterator

        cfg = self.config
        # Batch k is a pure function of (seed, k, rank): exact resume, distinct data per rank.
        self.iterator = BatchIterator(
            self.dataset.train_tokens,
            cfg.batch_size,
            cfg.seq_len,
            seed=cfg.seed,
            rank=self.runtime.rank,
            world_size=self.runtime.world_size,
        )

    def _lr_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "total_steps": self.total_steps,
            "peak_lr": cfg.lr,
            "warmup_fraction": cfg.warmup_fraction,
            "min_lr_ratio": cfg.min_lr_ratio,
        }

    # ---- one optimizer step -------------------------------------------------------------------

    def _sync_context(self, micro: int) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce on all but the last micro-batch."""
        last = micro == self.config.grad_accum - 1
        no_sync = getattr(self.model, "no_sync", None)
        if no_sync is not None and not last:
            return no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _forward_backward(self) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; return the mean loss (detached)."""
        cfg, device = self.config, self.runtime.device
        loss_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            inputs, targets = self.iterator.next()
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with self._sync_context(micro):
                with autocast_context(self.recipe, device):
                    logits = self.model(inputs)
                with full_precision(device):
                    loss = _cross_entropy(logits, targets)
                    objective = loss + z_loss(logits, cfg.z_loss) if cfg.z_loss > 0 else loss
                self.scaler.scale(objective / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        return loss_sum / cfg.grad_accum

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (or a skipped one); returns its metrics."""
        lr = lr_at(self.step, **self._lr_kwargs())
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_t = mean_across_ranks(self._forward_backward(), self.runtime)
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        self.scaler.unscale_(params)
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        loss = float(loss_t)
        self.scaler.update(found_inf=not math.isfinite(grad_norm))
        decision = self.guard.check(loss, grad_norm)
        if not decision.skip:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.losses.append(loss)
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "skip_reason": decision.reason}

    # ---- checkpoints --------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        sharded = self.config.checkpoint_format == "sharded"
        return self.out_dir / (SHARDED_CHECKPOINT_NAME if sharded else CHECKPOINT_NAME)

    def save(self) -> Path | None:
        """Write the training state: gathered to rank 0 ("full") or one shard per rank
        ("sharded", sharded_checkpoint.py); every rank takes part."""
        local = {
            "data": self.iterator.state_dict(),
            "rng": ckpt.capture_rng_state(),
            "buffers": extra_buffers(self.raw_model),
        }
        state = {
            "step": self.step,
            "scaler": self.scaler.state_dict(),
            "guard": self.guard.state_dict(),
            "losses": list(self.losses),
            "val_losses": [list(v) for v in self.val_losses],
            "config": self.config.to_dict(),
        }
        fields = self._fingerprint_fields()
        if self.config.checkpoint_format == "sharded":
            from minifloat.train.sharded_checkpoint import save_sharded

            model, optimizer = self.raw_model, self.optimizer
            return save_sharded(self.checkpoint_path, model=model, optimizer=optimizer,
                                global_state=state, rank_state=local, fields=fields)  # fmt: skip
        fsdp = self.config.parallel == "fsdp"
        state["model"], state["optimizer"] = full_state(self.raw_model, self.optimizer, fsdp=fsdp)
        state["ranks"] = all_gather_objects(local, self.runtime)
        if not self.runtime.is_main:
            return None
        return ckpt.save_checkpoint(self.checkpoint_path, state, fields=fields)

    def _fingerprint_fields(self) -> dict[str, Any]:
        fields = self.config.trajectory_fields(self.runtime.world_size)
        fields["corpus_sha256"] = getattr(self.dataset, "corpus_sha256", None)
        fields["num_params"] = self.num_params
        return fields

    def _load(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(global state, this rank's state) of the checkpoint; model and optimizer loaded."""
        fields, model, optimizer = self._fingerprint_fields(), self.raw_model, self.optimizer
        if self.config.checkpoint_format == "sharded":
            from minifloat.train.sharded_checkpoint import load_sharded

            return load_sharded(self.checkpoint_path, model=model, optimizer=optimizer,
                                fields=fields)  # fmt: skip
        state = ckpt.load_checkpoint(self.checkpoint_path, fields=fields)
        fsdp = self.config.parallel == "fsdp"
        load_full_state(model, optimizer, state["model"], state["optimizer"], fsdp=fsdp)
        return state, state["ranks"][self.runtime.rank]

    def resume(self) -> None:
        """Restore the state saved in ``out_dir``; raises CheckpointError on any mismatch."""
        try:
            state, local = self._load()
            self.scaler.load_state_dict(state["scaler"])
            self.guard.load_state_dict(state["guard"])
            self.iterator.load_state_dict(local["data"])
            ckpt.restore_rng_state(local["rng"])
            restore_buffers(self.raw_model, local["buffers"])
        except (KeyError, RuntimeError, ValueError, IndexError) as exc:
            raise ckpt.CheckpointError(
                f"checkpoint {self.checkpoint_path} does not fit this run ({first_line(exc)})"
            ) from exc
        self.step = int(state["step"])
        self.losses = [float(v) for v in state["losses"]]
        self.val_losses = [(int(s), float(v)) for s, v in state["val_losses"]]

    # ---- the loop -----------------------------------------------------------------------------

    def _evaluate(self) -> float:
        cfg = self.config
        val = evaluate(
            self.model,
            self.dataset.val_tokens,
            recipe=self.recipe,
            device=self.runtime.device,
            batch_size=self._eval_batch_size(),
            seq_len=cfg.seq_len,
            batches=cfg.eval_batches,
            rank=self.runtime.rank,
            world_size=self.runtime.world_size,
        )
        val = float(mean_across_ranks(torch.tensor(val, device=self.runtime.device), self.runtime))
        self.val_losses.append((self.step, val))
        return val

    def _eval_batch_size(self) -> int:
        """The training batch size, or fewer rows when the validation split is small."""
        cfg = self.config
        fits = (len(self.dataset.val_tokens) - 1) // cfg.seq_len
        if fits < 1:  # build_dataset checks this too; kept for datasets passed in directly
            raise ConfigError(
                f"validation split has {len(self.dataset.val_tokens)} tokens, fewer than one "
                f"sequence of {cfg.seq_len}; use more data or a shorter seq-len"
            )
        return min(cfg.batch_size, fits)

    def _log_layer_sqnr(self) -> None:
        """Per-layer quantization SQNR on a fixed validation batch (rank 0; diagnostics.py)."""
        from minifloat.diagnostics import layer_sqnr_record

        probe = (self.dataset.val_tokens, self._eval_batch_size(), self.config.seq_len)
        record = layer_sqnr_record(self.raw_model, *probe, self.runtime.device, step=self.step,
                                   recipe=self.recipe)  # fmt: skip
        if record is not None:
            self.logger.log(record)

    def _due(self, every: int) -> bool:
        return every > 0 and (self.step % every == 0)

    def run(self) -> TrainResult:
        """Train to ``total_steps`` (or ``stop_after``), then evaluate and checkpoint."""
        cfg = self.config
        if cfg.resume:
            self.resume()
        if self.step >= self.total_steps:
            raise ConfigError(
                f"checkpoint is already at step {self.step} of {self.total_steps}; nothing to do"
            )
        if self.runtime.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.runtime.device)
        resume_step = self.step if cfg.resume else None
        self.logger = MetricsLogger(
            self.out_dir, enabled=self.runtime.is_main, resume_step=resume_step
        )
        stop = self.total_steps if cfg.stop_after is None else min(cfg.stop_after, self.total_steps)
        display = ProgressDisplay(
            self.total_steps,
            mode=self.progress_mode,
            label=self.recipe.name,
            print_every=cfg.log_every,
        )
        try:
            step_times = self._loop(stop, display)
        finally:
            display.close()
        return self._finish(step_times)

    def _loop(self, stop: int, display: ProgressDisplay) -> list[float]:
        """Steps until ``stop``; returns the seconds each step took (evaluation excluded)."""
        cfg = self.config
        peak = peak_flops(self.runtime.device)
        flops_per_token = self.model_config.flops_per_token(cfg.seq_len)
        step_times: list[float] = []
        window: list[tuple[float, float]] = []
        while self.step < stop:
            started = time.perf_counter()
            metrics = self.train_step()
            elapsed = time.perf_counter() - started
            step_times.append(elapsed)
            window.append((metrics["loss"], elapsed))
            tokens_per_s = self.tokens_per_step / elapsed if elapsed > 0 else 0.0
            record = {
                "step": self.step,
                "loss": metrics["loss"],
                "lr": metrics["lr"],
                "grad_norm": metrics["grad_norm"],
                "tokens_per_s": tokens_per_s,
                "skipped": self.guard.skipped,
            }
            if metrics["skip_reason"]:
                record["skip_reason"] = metrics["skip_reason"]
            if cfg.eval_batches and (self._due(cfg.eval_every) or self.step == self.total_steps):
                record["val_loss"] = self._evaluate()
            if self.scaler.enabled:
                record["loss_scale"] = self.scaler.scale_value
            must_log = "val_loss" in record or "skip_reason" in record or self.step == stop
            if must_log or self._due(cfg.log_every):
                record["loss"] = sum(v for v, _ in window) / len(window)
                span = sum(t for _, t in window)
                record["tokens_per_s"] = self.tokens_per_step * len(window) / max(span, 1e-9)
                record["mfu"] = mfu(
                    flops_per_token, record["tokens_per_s"], peak, devices=self.runtime.world_size
                )
                self.logger.log({k: v for k, v in record.items() if v is not None})
                window = []
            display.update(self.step, _display_fields(record), force="val_loss" in record)
            last = cfg.sqnr_every and self.step == self.total_steps
            if self.runtime.is_main and (self._due(cfg.sqnr_every) or last):
                self._log_layer_sqnr()
            if cfg.save_checkpoints and (self._due(cfg.ckpt_every) or self.step == stop):
                self.save()
        return step_times

    def _finish(self, step_times: list[float]) -> TrainResult:
        cfg = self.config
        # Skipped steps may have non-finite losses; they did not change the weights.
        tail = [v for v in self.losses if math.isfinite(v)][-FINAL_LOSS_WINDOW:] or [math.nan]
        # Steady-state speed from the median step: robust to compilation, warm-up and noise.
        median = statistics.median(step_times) if step_times else 0.0
        device = self.runtime.device
        peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return TrainResult(
            recipe=self.recipe.name,
            model=cfg.model,
            num_params=self.num_params,
            steps=self.step,
            tokens=self.step * self.tokens_per_step,
            final_loss=sum(tail) / len(tail),
            final_val_loss=self.val_losses[-1][1] if self.val_losses else None,
            tokens_per_s=self.tokens_per_step / median if median > 0 else 0.0,
            peak_memory_bytes=peak_mem,
            skipped_steps=self.guard.skipped,
            losses=tuple(self.losses),
            val_losses=tuple(self.val_losses),
            out_dir=self.out_dir,
            metrics_path=self.out_dir / "metrics.jsonl",
            checkpoint_path=self.checkpoint_path if cfg.save_checkpoints else None,
            rank=self.runtime.rank,
        )

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        self.runtime.close()


def _display_fields(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("loss", "val_loss", "grad_norm", "tokens_per_s", "mfu", "skipped")
    names = {"tokens_per_s": "tok/s", "grad_norm": "gnorm", "val_loss": "val"}
    return {names.get(k, k): record[k] for k in keys if k in record}
