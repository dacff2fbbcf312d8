"""The reference training loop: any recipe, mixed precision, step guard, exact resume.

``train(TrainConfig(...))`` builds the dataset and a LLaMA preset, converts its linear layers when
the recipe is quantized, and runs AdamW with warm-up + cosine decay, gradient accumulation and
clipping. Each step:

1. forward under the recipe's autocast; the loss (cross entropy, z-loss) in fp32 (loss.py);
2. backward of the (loss-scaled, for fp16) loss, accumulated over ``grad_accum`` micro-batches;
3. unscale, clip and measure the global gradient norm; the loss scaler and the step guard
   decide whether the update is applied (a skipped step leaves weights and optimizer untouched);
4. the update itself is refused (skipped, counted) when it makes any weight non-finite;
5. log, evaluate, measure per-layer quantization SQNR and checkpoint on schedule (rank 0 only).

With ``switch_recipe``/``switch_at`` the quantized layers change recipe in place after the switch
step (switch.py); checkpoints from either side of it resume into the right recipe. With
``branch_from`` such a run starts from its plain run's checkpoint at the switch (branch.py).

A run holds its directory exclusively (run_dir.py), replacing an earlier run only if told to
(``overwrite``); SIGINT/SIGTERM stop it after the current step with a checkpoint (signals.py);
a run that skipped over ``max_skip_fraction`` of its steps, or ran out of memory, raises
:class:`~minifloat.train.errors.RunFailed`.

Under torchrun the model is wrapped with DDP (plus a gradient-communication hook) or FSDP2; the
model knows nothing about parallelism. Parts: build.py, model.py; checkpoints: checkpointer.py.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifloat import recipes
from minifloat.amp import autocast_context, full_precision
from minifloat.convert import set_recipe
from minifloat.errors import first_line
from minifloat.fsdp_quantized import precompute_quantized_weights
from minifloat.train.branch import BranchPoint, checkpoint_steps, load_branch, plan_branch
from minifloat.train.build import build_iterator, build_optimizer, check_names, load_dataset
from minifloat.train.checkpoint import capture_rng_state, restore_rng_state
from minifloat.train.checkpointer import Checkpointer, require_checkpoint
from minifloat.train.config import TrainConfig
from minifloat.train.errors import (
    CheckpointError,
    ConfigError,
    RunDirError,
    RunFailed,
    TrainingInterrupted,
)
from minifloat.train.evaluate import eval_batch_size, evaluate
from minifloat.train.loss import training_objective
from minifloat.train.loss_scaler import LossScaler
from minifloat.train.memory import PeakMemory
from minifloat.train.metrics import LogWindow, MetricsLogger, ProgressDisplay, peak_flops
from minifloat.train.result import TrainResult, final_loss
from minifloat.train.run_dir import RunDirectory
from minifloat.train.runtime import (
    Runtime,
    any_rank,
    broadcast_object,
    is_out_of_memory,
    max_across_ranks,
    mean_across_ranks,
    seed_everything,
)
from minifloat.train.runtime import setup as setup_runtime
from minifloat.train.schedule import lr_at
from minifloat.train.signals import StopSignals
from minifloat.train.stability import StepGuard, StepGuardConfig, no_progress
from minifloat.train.state import extra_buffers, restore_buffers
from minifloat.train.stopped import stop_handling
from minifloat.train.switch import RecipeSwitch, recipe_switch, run_name
from minifloat.train.weight_guard import WeightGuard

__all__ = ["TrainResult", "Trainer", "train"]


def train(
    config: TrainConfig,
    *,
    dataset: Any = None,
    progress: bool | str = "auto",
    model_transform: Callable[[nn.Module], Any] | None = None,
) -> TrainResult:
    """Run training as configured and return its summary.

    ``dataset``: a built ``TokenDataset`` (skips ``build_dataset``; e.g. several recipes on the
    same data). ``progress``: True/"auto" (rich bar on a terminal, plain lines otherwise),
    "plain", or False/"off". ``model_transform``: called on the (converted) model before
    FSDP/compile/DDP wrap it, in place (e.g. to swap in torchao's float8 layers).
    """
    trainer = Trainer(config, dataset=dataset, progress=progress, model_transform=model_transform)
    finished = False
    try:
        result = trainer.run()
        finished = True
        return result
    finally:
        trainer.close(finished=finished)
        del trainer  # free its model now, not at some later collection: compiled blocks hold it
        gc.collect()  # in reference cycles, and a later run here (compare) would count it


def _progress_mode(progress: bool | str) -> str:
    return "auto" if progress is True else "off" if progress is False else progress


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
        check_names(self.config)
        self.recipe = recipes.get(self.config.recipe)
        self.runtime: Runtime = setup_runtime(self.config.device)
        self.logger: MetricsLogger | None = None
        self.run_dir = RunDirectory(Path(self.config.out_dir), resume=self.config.resume,
                                    overwrite=self.config.overwrite,
                                    resumable=self.config.save_checkpoints)  # fmt: skip
        try:
            # Before the run directory is touched: a branch that cannot be refuses at once.
            self.branch: BranchPoint | None = plan_branch(self.config, self.runtime)
            if self.config.resume:  # and a resume without a checkpoint, before the data
                require_checkpoint(Path(self.config.out_dir), (self.config.checkpoint_format,),
                                   "resume", "set resume=False to start a new run")  # fmt: skip
            self._open_run_dir()
            self._setup(dataset, progress, model_transform)
        except BaseException:
            self.run_dir.close()
            self.runtime.close()
            raise

    def _open_run_dir(self) -> None:
        """Rank 0 takes the run directory (lock, earlier-run check); every rank learns whether
        that worked, so all of them stop with the same error if it did not."""
        error = None
        if self.runtime.is_main:
            try:
                self.run_dir.open()
            except RunDirError as exc:
                error = str(exc)
        error = broadcast_object(error, self.runtime)
        if error is not None:
            raise RunDirError(error)

    def _setup(self, dataset: Any, progress: bool | str, model_transform: Any) -> None:
        from minifloat.train.model import build_model

        cfg, runtime = self.config, self.runtime
        self.progress_mode = _progress_mode(progress) if runtime.is_main else "off"
        self.out_dir = Path(cfg.out_dir)
        self.total_steps = cfg.total_steps(runtime.world_size)
        self.run_name = run_name(cfg.recipe, cfg.switch_recipe, cfg.switch_at)
        self.memory = PeakMemory(runtime.device)  # training's peak, probes kept out
        self.switch: RecipeSwitch | None = recipe_switch(cfg, self.total_steps)
        self.ckpt_steps = checkpoint_steps(cfg.ckpt_at, self.total_steps)
        self.branch_info: dict[str, Any] | None = None  # where the run branched (branch.py)
        if self.switch is not None:
            self.recipe = self.switch.before  # the very objects the switch compares with
        seed_everything(cfg.seed)
        self.dataset = dataset if dataset is not None else self._build_dataset()
        vocab_size = self.dataset.tokenizer.vocab_size
        with self._out_of_memory("building the model"):
            self.model_config, self.raw_model, self.model = build_model(
                cfg, self.recipe, runtime, vocab_size=vocab_size, model_transform=model_transform,
                convert_recipe=None if self.switch is None else self.switch.convert_recipe,
            )  # fmt: skip
        if self.switch is not None:
            self.switch.check_model(self.raw_model)
        self.num_params = sum(p.numel() for p in self.raw_model.parameters())
        self.optimizer = build_optimizer(cfg, self.raw_model, runtime, lr=self._lr(0))
        self.weight_guard = WeightGuard(self.raw_model, self.optimizer, enabled=cfg.weight_guard,
                                        any_rank=lambda flag: any_rank(flag, runtime))  # fmt: skip
        self.scaler = LossScaler(enabled=self.recipe.loss_scaling)
        both = (self.switch.before, self.switch.after) if self.switch else (self.recipe,)
        self.objective = training_objective(self.raw_model, cfg.z_loss, compiled=cfg.compile,
                                            chunk_tokens=cfg.loss_chunk, recipes=both)  # fmt: skip
        self.guard = StepGuard(
            StepGuardConfig(
                spike_k=cfg.spike_k,
                grad_norm_spike_k=cfg.grad_norm_spike_k,
                warmup_steps=cfg.spike_warmup,
            )
        )
        self.iterator = build_iterator(cfg, self.dataset.train_tokens, runtime)
        self.checkpointer = Checkpointer(
            self.out_dir, fmt=cfg.checkpoint_format, keep=cfg.keep_checkpoints,
            model=self.raw_model, optimizer=self.optimizer, runtime=runtime,
            fsdp=cfg.parallel == "fsdp", fields=self._fingerprint_fields(),
        )  # fmt: skip
        self.step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint
        self.last_skip_reason = ""
        self.losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * runtime.world_size

    def _build_dataset(self) -> Any:
        # Rank 0 builds (and caches) first so the other ranks only read the cache.
        distributed, main = self.runtime.distributed, self.runtime.is_main
        if distributed and not main:
            torch.distributed.barrier()
        dataset = load_dataset(self.config, progress=self.progress_mode != "off")
        if distributed and main:
            torch.distributed.barrier()
        return dataset

    def _lr(self, step: int) -> float:
        cfg = self.config
        return lr_at(
            step,
            total_steps=self.total_steps,
            peak_lr=cfg.lr,
            warmup_fraction=cfg.warmup_fraction,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    @contextlib.contextmanager
    def _out_of_memory(self, where: str) -> Any:
        """Turn running out of memory into a one-line RunFailed naming what to lower."""
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            cfg, device = self.config, self.runtime.device
            if where == "building the model":
                lower = "use a smaller --model (or --model-override dim/n_layers)"
            else:
                lower = (
                    f"lower --batch-size (now {cfg.batch_size}; raise --grad-accum, now "
                    f"{cfg.grad_accum}, to keep the tokens per step) or --seq-len (now "
                    f"{cfg.seq_len}), or use a smaller --model"
                )
            reason = first_line(exc)[:120]
            raise RunFailed(
                f"out of memory {where} on {device} ({reason}): {lower}; --optim-states lean "
                "or --parallel fsdp also save memory"
            ) from exc

    def _fingerprint_fields(self) -> dict[str, Any]:
        return {**self.config.trajectory_fields(self.runtime.world_size), **self._run_facts()}

    def _run_facts(self) -> dict[str, Any]:
        """The fingerprinted facts that settings alone do not fix: the corpus and model size."""
        return {"corpus_sha256": getattr(self.dataset, "corpus_sha256", None),
                "num_params": self.num_params}  # fmt: skip

    def _use_recipe_for(self, steps_done: int) -> None:
        """Give the quantized layers the recipe of the step after ``steps_done`` steps: the
        switch recipe from the switch step on (a no-op without a switch, or when it is set).

        Called before every step and, on resume, before a checkpoint's model state is loaded
        (`_recipe_as_saved`).
        Parameters and optimizer state are untouched (set_recipe changes layers in place).
        Under torch.compile the next call recompiles: each layer's forward reads its ``recipe``
        attribute, which dynamo guards on, so the graph traced for the old recipe no longer
        matches (one recompile at the switch; tests/train/test_switch.py checks that the
        compiled model follows). The compiled wrapper itself needs no rebuilding.
        """
        if self.switch is None:
            return
        recipe = self.switch.recipe_after(steps_done)
        if recipe is not self.recipe:
            set_recipe(self.raw_model, recipe)
            self.recipe = recipe

    def _recipe_as_saved(self, step: int) -> None:
        """Before the state of a checkpoint of ``step`` is loaded: the recipe the model had
        when it was saved, the one of step ``step`` itself (a checkpoint at the switch step is
        from before the switch), so that the fp8-delayed amax buffers match the saved ones."""
        self._use_recipe_for(step - 1)

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
                with autocast_context(self.recipe, device), self.objective.deferring():
                    logits = self.model(inputs)  # the final hidden states, when deferring
                with full_precision(device):
                    loss, objective = self.objective(logits, targets)
                self.scaler.scale(objective / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        return loss_sum / cfg.grad_accum

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (or a skipped one); returns its metrics."""
        lr = self._lr(self.step)
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
        if not decision.skip and not self.weight_guard.step():
            decision = self.guard.revoke("non-finite weights after the update (refused)")
        if self.config.quantized_all_gather:  # quantize the shards for the next all-gathers
            precompute_quantized_weights(self.raw_model)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.losses.append(loss)
        self.last_skip_reason = decision.reason or self.last_skip_reason
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "skip_reason": decision.reason}

    # ---- checkpoints --------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpointer.path

    def save(self) -> Path | None:
        """Write the training state: gathered to rank 0 ("full") or one shard per rank
        ("sharded", sharded_checkpoint.py); every rank takes part."""
        state = {
            "step": self.step,
            "scaler": self.scaler.state_dict(),
            "guard": self.guard.state_dict(),
            "losses": list(self.losses),
            "val_losses": [list(v) for v in self.val_losses],
            "config": self.config.to_dict(),
        }
        if self.branch_info is not None:
            state["branch"] = self.branch_info
        local = {
            "data": self.iterator.state_dict(),
            "rng": capture_rng_state(),
            "buffers": extra_buffers(self.raw_model),
        }
        path = self.checkpointer.save(state, local)
        self.saved_step = self.step
        return path

    def resume(self) -> None:
        """Restore the state saved in ``out_dir``; raises CheckpointError on any mismatch."""
        self._restore(lambda: self.checkpointer.load(before_model=self._recipe_as_saved),
                      where=self.checkpoint_path)  # fmt: skip
        self.saved_step = self.step

    def branch_in(self) -> None:
        """Restore the state of the checkpoint this run branches from (branch.py); the run
        then holds no checkpoint of its own yet."""
        point = self.branch
        assert point is not None
        load = functools.partial(load_branch, point, self.checkpointer, facts=self._run_facts(),
                                 before_model=self._recipe_as_saved)  # fmt: skip
        self._restore(load, where=point.run_dir)
        self.branch_info = point.info(self.step)

    def _restore(self, load: Callable[[], tuple[dict, dict]], *, where: Path) -> None:
        """Load a checkpoint's state (``load()`` loads model and optimizer) into the run."""
        try:
            state, local = load()
            self.scaler.load_state_dict(state["scaler"])
            self.guard.load_state_dict(state["guard"])
            self.iterator.load_state_dict(local["data"])
            restore_rng_state(local["rng"])
            restore_buffers(self.raw_model, local["buffers"])
        except ConfigError:
            raise
        except (KeyError, RuntimeError, ValueError, IndexError) as exc:
            raise CheckpointError(
                f"checkpoint {where} does not fit this run ({first_line(exc)})"
            ) from exc
        self.step = int(state["step"])
        self.losses = [float(v) for v in state["losses"]]
        self.val_losses = [(int(s), float(v)) for s, v in state["val_losses"]]
        self.branch_info = state.get("branch")

    # ---- the loop -----------------------------------------------------------------------------

    def _evaluate(self) -> float:
        cfg, runtime = self.config, self.runtime
        val = evaluate(self.model, self.dataset.val_tokens, recipe=self.recipe,
                       device=runtime.device, batch_size=self._eval_batch_size(),
                       seq_len=cfg.seq_len, batches=cfg.eval_batches, rank=runtime.rank,
                       world_size=runtime.world_size)  # fmt: skip
        val = float(mean_across_ranks(torch.tensor(val, device=runtime.device), runtime))
        self.val_losses.append((self.step, val))
        return val

    def _eval_batch_size(self) -> int:
        return eval_batch_size(self.dataset.val_tokens, self.config.batch_size, self.config.seq_len)

    def _log_layer_sqnr(self) -> None:
        """Per-layer quantization SQNR on a fixed validation batch (rank 0; diagnostics.py)."""
        from minifloat.diagnostics import layer_sqnr_record

        probe = (self.dataset.val_tokens, self._eval_batch_size(), self.config.seq_len)
        record, peak = self.memory.apart(  # its eager pass stays out of training's peak
            lambda: layer_sqnr_record(
                self.raw_model, *probe, self.runtime.device, step=self.step, recipe=self.recipe
            )
        )
        if record is not None:
            if peak is not None:
                record["probe_peak_mem_gib"] = peak / 2**30
            self.logger.log(record)

    def _due(self, every: int) -> bool:
        return every > 0 and (self.step % every == 0)

    def run(self) -> TrainResult:
        """Train to ``total_steps`` (or ``stop_after``), then evaluate and checkpoint."""
        cfg = self.config
        if cfg.resume:
            self.resume()
        elif self.branch is not None:
            self.branch_in()
        if self.step >= self.total_steps:
            raise ConfigError(
                f"checkpoint is already at step {self.step} of {self.total_steps}; nothing to do"
            )
        self.memory.reset()
        resume_step = self.step if cfg.resume or self.branch is not None else None
        if self.branch is not None and self.runtime.is_main:
            self.branch.write_metrics(self.out_dir, self.step)
        self.logger = MetricsLogger(
            self.out_dir, enabled=self.runtime.is_main, resume_step=resume_step
        )
        if self.branch is not None and cfg.save_checkpoints:
            self.save()  # the branch point, in this run's directory: it resumes from there
        stop = self.total_steps if cfg.stop_after is None else min(cfg.stop_after, self.total_steps)
        display = ProgressDisplay(self.total_steps, mode=self.progress_mode,
                                  label=self.run_name, print_every=cfg.log_every)  # fmt: skip
        try:
            with stop_handling(self) as signals:
                step_times = self._loop(stop, display, signals)
        finally:
            display.close()
        result = self._finish(step_times)
        # RunFailed (the checkpoint and metrics already written) when the run made no progress
        if failed := no_progress(self.guard.skipped, self.step, stop, cfg.max_skip_fraction):
            raise RunFailed(
                f"{failed}: the run made no progress (last reason: "
                f"{self.last_skip_reason}); see {result.metrics_path}",
                result=result,
            )
        return result

    def _loop(self, stop: int, display: ProgressDisplay, signals: StopSignals) -> list[float]:
        """Steps until ``stop``; returns the seconds each step took (evaluation excluded).
        A SIGINT/SIGTERM ends the loop after the current step with a checkpoint."""
        window = LogWindow(
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.model_config.flops_per_token(self.config.seq_len),
            peak=peak_flops(self.runtime.device),
            devices=self.runtime.world_size,
        )
        step_times: list[float] = []
        while self.step < stop:
            self._use_recipe_for(self.step)
            started = time.perf_counter()
            with self._out_of_memory(f"in step {self.step + 1}"):
                metrics = self.train_step()
            elapsed = time.perf_counter() - started
            step_times.append(elapsed)
            window.add(metrics["loss"], elapsed)
            # Every rank stops at the same step, whichever of them got the signal.
            signum = int(max_across_ranks(signals.received or 0, self.runtime))
            self._after_step(metrics, elapsed, stop=stop, stopping=signum > 0, window=window,
                             display=display)  # fmt: skip
            if signum:
                saved = self.checkpoint_path if self.config.save_checkpoints else None
                raise TrainingInterrupted(signum, self.step, saved)
            # The end's check would fail whatever the remaining steps do: stop, keeping the
            # weights (skipped steps never changed them) as the run's end would
            if no_progress(self.guard.skipped, self.step, stop, self.config.max_skip_fraction):
                if self.config.save_checkpoints and self.saved_step != self.step:
                    self.save()
                break
        return step_times

    def _after_step(
        self,
        metrics: dict[str, Any],
        elapsed: float,
        *,
        stop: int,
        stopping: bool,
        window: LogWindow,
        display: ProgressDisplay,
    ) -> None:
        """Evaluate, log, measure and checkpoint as the schedule (or a stop) asks."""
        cfg = self.config
        due = self._due(cfg.ckpt_every) or self.step in self.ckpt_steps
        save = cfg.save_checkpoints and (due or self.step == stop or stopping)
        record = self._record(metrics, elapsed)
        if cfg.eval_batches and (self._due(cfg.eval_every) or self.step == self.total_steps):
            record["val_loss"] = self._evaluate()
        # A record at every checkpoint: a resume from it then loses no logged step. And one at
        # the switch: no log window mixes the steps of two recipes.
        switched = self.switch is not None and self.step == self.switch.step
        must_log = "val_loss" in record or "skip_reason" in record or self.step == stop or switched
        if must_log or save or stopping or self._due(cfg.log_every):
            record.update(window.flush())
            self.logger.log({k: v for k, v in record.items() if v is not None})
        display.update(self.step, _display_fields(record), force="val_loss" in record)
        last = cfg.sqnr_every and self.step == self.total_steps
        if self.runtime.is_main and (self._due(cfg.sqnr_every) or last):
            self._log_layer_sqnr()
        if save and self.saved_step != self.step:
            self.save()

    def _record(self, metrics: dict[str, Any], elapsed: float) -> dict[str, Any]:
        """The metrics record of the step just taken (before evaluation and averaging)."""
        record = {
            "step": self.step,
            "recipe": self.recipe.name,  # the recipe that took this step (a switch changes it)
            "loss": metrics["loss"],
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            "tokens_per_s": self.tokens_per_step / elapsed if elapsed > 0 else 0.0,
            "skipped": self.guard.skipped,
        }
        if metrics["skip_reason"]:
            record["skip_reason"] = metrics["skip_reason"]
        if self.scaler.enabled:
            record["loss_scale"] = self.scaler.scale_value
        if (peak := self.memory.bytes()) is not None:  # since the run (or this chunk) started
            record["peak_mem_gib"] = peak / 2**30
        return record

    def _finish(self, step_times: list[float]) -> TrainResult:
        cfg = self.config
        # Steady-state speed from the median step: robust to compilation, warm-up and noise.
        median = statistics.median(step_times) if step_times else 0.0
        peak_mem = self.memory.bytes()
        return TrainResult(
            recipe=self.run_name,
            switch_recipe=cfg.switch_recipe,
            switch_at=cfg.switch_at,
            branched_from=None if self.branch_info is None else self.branch_info["from"],
            branch_step=None if self.branch_info is None else self.branch_info["step"],
            model=cfg.model,
            num_params=self.num_params,
            steps=self.step,
            tokens=self.step * self.tokens_per_step,
            final_loss=final_loss(self.losses),
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

    def close(self, *, finished: bool = False) -> None:
        """Close the metrics log, release the run directory and leave the process group
        (``finished``: the run ended normally on every rank, see :meth:`Runtime.close`)."""
        if self.logger is not None:
            self.logger.close()
        self.run_dir.close()
        self.runtime.close(finished=finished)


def _display_fields(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("loss", "val_loss", "grad_norm", "tokens_per_s", "mfu", "skipped")
    names = {"tokens_per_s": "tok/s", "grad_norm": "gnorm", "val_loss": "val"}
    return {names.get(k, k): record[k] for k in keys if k in record}
