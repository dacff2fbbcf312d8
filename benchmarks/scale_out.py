"""Scale-out training benchmark: FSDP2 + torch.compile, one recipe per run, in resumable chunks.

Each run trains one model under one recipe with the reference trainer for ``warmup + measure``
steps, split into chunks that each fit a short job: every ``run`` (under torchrun) continues from
the run's checkpoint and stops after ``--chunk-steps`` more steps (0: the whole run at once).
``report`` reads every run directory and writes a markdown table, its JSON twin and loss curves.

    torchrun --standalone --nproc-per-node 8 benchmarks/scale_out.py run --model 7B \
        --recipe fp8-rowwise --data .carry/english.xz --seq-len 2048 --batch-size 4 \
        --warmup-steps 20 --measure-steps 200 --chunk-steps 0 --no-checkpoint --runs runs/scale_out
    torchrun --standalone --nproc-per-node 8 benchmarks/scale_out.py run --model 7B \
        --recipe fp4 ... --chunk-steps 45 --ckpt-format sharded      # repeat: one chunk per job
    python benchmarks/scale_out.py report --runs runs/scale_out      # -> benchmarks/results/

``--ckpt-format sharded`` makes every rank save and load only its own FSDP shards (a
``checkpoint.dcp`` directory; minifloat.train.sharded_checkpoint) instead of gathering the full
state to rank 0: the format that lets 7B runs be split into chunks.

Recipes: any minifloat recipe, or ``torchao-float8-tensorwise``: minifloat's ``bf16`` plus
torchao's float8 training layers swapped in through the trainer's ``model_transform`` hook (torchao
is no dependency of minifloat; it is imported for that recipe only).

``--quantized-all-gather`` has FSDP2 all-gather the QuantLinear weights already quantized
(``TrainConfig.quantized_all_gather``; minifloat.fsdp_quantized), in a run directory of its own
(``<model>_<recipe>+qag``) next to the plain run of the recipe. It is refused for the torchao
recipe (its float8 layers are no QuantLinear) and for recipes the quantized all-gather cannot
reproduce (autocast-only ones such as bf16, OCC's fp4; ``fsdp_plan.plan_for`` says why).

Measured per run: tokens/s per GPU and MFU over the steady-state steps only (after the first
``--warmup-steps``, minus the first ``--rewarm-steps`` of every resumed chunk, whose new process
compiles again); peak GPU memory (max over ranks and chunks); every step's training loss; the
bytes the FSDP2 weight all-gathers move per step (``allgather_bytes_per_step``, counted from the
parameters' shapes and what each all-gather sends; see there).
``benchmarks/scale_out.sh`` drives the runs on the GPU machine, one <= 10-minute job at a time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, environment, gpu_tag  # noqa: E402
from minifloat.models.llama import PRESETS, get_config  # noqa: E402
from minifloat.train import train  # noqa: E402
from minifloat.train.build import load_dataset  # noqa: E402
from minifloat.train.cli import parse_override  # noqa: E402
from minifloat.train.config import TrainConfig  # noqa: E402
from minifloat.train.metrics import peak_flops  # noqa: E402
from minifloat.train.runtime import join_process_group  # noqa: E402
from scale_out_report import (  # noqa: E402, F401 - re-exported: tests and callers use them here
    BASELINE_RECIPE,
    DONE_NAME,
    QAG_SUFFIX,
    RECORDS_NAME,
    TORCHAO_RECIPE,
    timed_steps,
    write_report,
)

__all__ = [
    "TORCHAO_RECIPE",
    "allgather_bytes_per_step",
    "main",
    "timed_steps",
    "torchao_float8_tensorwise",
    "write_report",
]

CHECKPOINT_NAME = "checkpoint.pt"
SHARDED_NAME = "checkpoint.dcp"  # --ckpt-format sharded: a directory, one shard file per rank
# FP8 tensor cores need both GEMM dims of a layer in multiples of 16 (torchao asserts it).
FLOAT8_ALIGN = 16
# The trainer (train/model.py) calls minifloat.distributed.apply_fsdp without
# reshard_after_forward, so its default holds: True (tests/test_scale_out.py checks it).
RESHARD_AFTER_FORWARD = True


# ---- the torchao comparison recipe -------------------------------------------------------------


def torchao_float8_tensorwise(model: nn.Module) -> list[str]:
    """Swap the model's plain nn.Linear layers for torchao float8 layers (tensorwise scaling).

    The output head stays high precision (as in every minifloat recipe), and so do layers whose
    in/out features are not multiples of 16. Returns the names of the swapped layers.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise RuntimeError(
            f"recipe {TORCHAO_RECIPE} needs torchao, which minifloat does not depend on: "
            "pip install --no-deps --target /tmp/site .whl/torchao-*.whl and add /tmp/site to "
            "PYTHONPATH (see benchmarks/scale_out.sh)"
        ) from err
    swapped: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        # type() rather than isinstance: minifloat's QuantLinear subclasses nn.Linear.
        ok = (
            type(module) is nn.Linear
            and fqn != "output"
            and module.in_features % FLOAT8_ALIGN == 0
            and module.out_features % FLOAT8_ALIGN == 0
        )
        if ok:
            swapped.append(fqn)
        return ok

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return swapped


def _recipe_parts(name: str) -> tuple[str, bool]:
    """(minifloat recipe, whether torchao's float8 layers are swapped in) for a benchmark recipe."""
    return (BASELINE_RECIPE, True) if name == TORCHAO_RECIPE else (name, False)


# ---- run: one chunk under torchrun -------------------------------------------------------------


def run_dir(runs: Path, model: str, recipe: str, quantized_all_gather: bool = False) -> Path:
    """A run's directory: ``<model>_<recipe>``, plus ``+qag`` for a quantized all-gather run."""
    return Path(runs) / f"{model}_{recipe}{QAG_SUFFIX if quantized_all_gather else ''}"


# ---- all-gather bytes --------------------------------------------------------------------------


def allgather_bytes_per_step(model: nn.Module, blocks: Sequence[nn.Module], world_size: int, *,
                             micro_batches: int) -> tuple[int, dict[str, int]]:  # fmt: skip
    """Bytes the FSDP2 weight all-gathers of one training step move, and one all-gather of the
    whole model as ``minifloat.fsdp_quantized.all_gather_bytes`` splits it.

    ``model`` is the trained (sharded) model and ``blocks`` the modules apply_fsdp sharded one
    by one before the root. Bytes are counted as ``all_gather_bytes`` does: summed over the
    ranks' all-gather inputs (= the size of the gathered parameters), QuantLinear weights as
    they are sent ("quantized": fp32 under the plain all-gather; values + travelling scales
    under the quantized one), every other parameter at its dtype ("other": fp32 here).

    Per micro-batch, with reshard_after_forward=True (RESHARD_AFTER_FORWARD, the trainer's
    setting): a block's parameters are gathered for its forward and again for its backward; the
    root's own parameters (embedding, final norm, output head) once, because apply_fsdp does not
    reshard the root after forward (tests/test_distributed.py checks it). Parameters are
    resharded after every backward, so each of the ``micro_batches`` (grad_accum) gathers anew.
    Not counted: FSDP2's padding of shards whose dim 0 is not divisible by the world size, the
    4-byte amax all-reduces of tensor and column scales (no all-gathers), and the evaluation
    forwards at the run's last step.
    """
    from minifloat.fsdp_quantized import all_gather_bytes

    whole = all_gather_bytes(model, world_size)
    in_blocks = sum(b["quantized"] + b["other"]
                    for b in (all_gather_bytes(block, world_size) for block in blocks))  # fmt: skip
    root = whole["quantized"] + whole["other"] - in_blocks
    gathers = 2 if RESHARD_AFTER_FORWARD else 1
    return micro_batches * (gathers * in_blocks + root), whole


def _train_config(args: argparse.Namespace, out: Path, *, start: int) -> TrainConfig:
    recipe, _ = _recipe_parts(args.recipe)
    total = args.warmup_steps + args.measure_steps
    stop = start + args.chunk_steps if args.chunk_steps > 0 else total
    return TrainConfig(
        recipe=recipe,
        model=args.model,
        model_overrides=dict(args.model_overrides or []),
        data=args.data,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size or PRESETS[args.model].vocab_size,
        data_max_bytes=args.data_max_bytes,
        cache_dir=args.cache_dir,
        steps=total,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        lr=args.lr,
        seed=args.seed,
        device=args.device,
        compile=args.compile,
        parallel="fsdp",
        grad_comm=args.grad_comm,
        quantized_all_gather=args.quantized_all_gather,
        eval_every=0,  # evaluation only at the last step (the trainer always does that one)
        eval_batches=args.eval_batches,
        log_every=1,  # one metrics record per step: the report needs every step's time
        ckpt_every=args.ckpt_every,
        keep_checkpoints=1,  # 16-81 GB each: the disk holds one (a crash mid-save keeps it)
        checkpoint_format=args.ckpt_format,
        save_checkpoints=not args.no_checkpoint,
        out_dir=str(out),
        resume=start > 0,
        overwrite=start == 0,  # _chunk_start decided: a new run replaces what a failed one left
        stop_after=stop if stop < total else None,
    )


def _checkpoint_step(path: Path) -> int:
    """Step stored in a trainer checkpoint, read without loading its tensors (full: mmap;
    sharded: the manifest)."""
    try:
        if path.name == SHARDED_NAME:
            from minifloat.train.sharded_checkpoint import read_manifest

            return int(read_manifest(path)["step"])
        body = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(body["state"]["step"])
    except Exception as exc:
        raise SystemExit(
            f"scale_out: cannot read the step of {path} ({type(exc).__name__}: {exc}); "
            "start the run again with --fresh"
        ) from exc


def _chunk_start(out: Path, fresh: bool, ckpt_format: str = "full") -> int | None:
    """Step this chunk starts from (0: a new run), or None when the run is already complete."""
    if fresh:
        for name in (DONE_NAME, CHECKPOINT_NAME, RECORDS_NAME):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / SHARDED_NAME, ignore_errors=True)
    if (out / DONE_NAME).is_file():
        return None
    checkpoint = out / (SHARDED_NAME if ckpt_format == "sharded" else CHECKPOINT_NAME)
    # A sharded save that crashed between its two renames leaves only the .old directory.
    old = out / f".{SHARDED_NAME}.old"
    if not checkpoint.exists() and not (ckpt_format == "sharded" and old.is_dir()):
        # A new run (or one that never saved): earlier chunk records describe nothing kept.
        (out / RECORDS_NAME).unlink(missing_ok=True)
        return 0
    return _checkpoint_step(checkpoint)


def _join_process_group(device: str) -> torch.device:
    """Join torchrun's process group ourselves, so it outlives train() for the gathers below."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("scale_out run: launch it with torchrun --nproc-per-node N, N >= 2")
    cuda = device != "cpu" and torch.cuda.is_available()
    # Rank 0 alone writes a full checkpoint while the others wait: allow slow saves.
    return join_process_group("cuda" if cuda else "cpu", timeout=datetime.timedelta(minutes=30))


def _load_dataset_rank0_first(config: TrainConfig, progress: bool) -> Any:
    # Rank 0 builds and caches the tokenized corpus; the others then read the cache.
    main = dist.get_rank() == 0
    if not main:
        dist.barrier()
    dataset = load_dataset(config, progress=progress and main)
    if main:
        dist.barrier()
    return dataset


def _command_line() -> str:
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    script = os.path.relpath(Path(__file__).resolve(), Path.cwd())
    return shlex.join(
        ["torchrun", "--standalone", "--nproc-per-node", nproc, script, *sys.argv[1:]]
    )


def _append_record(out: Path, record: dict[str, Any]) -> None:
    with (out / RECORDS_NAME).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _start_record(args: argparse.Namespace, config: TrainConfig, dataset: Any, start: int,
                  device: torch.device, started: float) -> dict[str, Any]:  # fmt: skip
    cfg = config.resolved()
    overrides = {"vocab_size": dataset.tokenizer.vocab_size, **cfg.model_overrides}
    model_config = get_config(cfg.model, **overrides)
    world = dist.get_world_size()
    return {
        "event": "start",
        "time": time.time(),
        "model": args.model,
        "recipe": args.recipe,
        "minifloat_recipe": cfg.recipe,
        "gpus": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpu_tag": gpu_tag() if device.type == "cuda" else "cpu",
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "grad_accum": cfg.grad_accum,
        "vocab_size": model_config.vocab_size,
        "num_params": model_config.num_params(),
        "tokens_per_step_per_gpu": cfg.batch_size * cfg.seq_len * cfg.grad_accum,
        "flops_per_token": model_config.flops_per_token(cfg.seq_len),
        "peak_flops": peak_flops(device),
        "warmup_steps": args.warmup_steps,
        "measure_steps": args.measure_steps,
        "total_steps": cfg.steps,
        "chunk_steps": args.chunk_steps,
        "compile": cfg.compile,
        "compile_scope": cfg.compiled_scope,
        "grad_comm": cfg.grad_comm,
        "quantized_allgather": cfg.quantized_all_gather,
        "start_step": start,
        "stop_step": cfg.stop_after or cfg.steps,
        "setup_s": time.time() - started,
        "command": _command_line(),
        "env": environment(),
    }


def cmd_run(args: argparse.Namespace) -> int:
    """One chunk of one run (every rank runs this under torchrun)."""
    started = time.time()
    device = _join_process_group(args.device)
    try:
        code = _run_chunk(args, device, started)
    except BaseException:
        dist.destroy_process_group()  # no barrier: a failed peer never reaches it
        raise
    gc.collect()  # release finished async work before the group goes (gloo teardown)
    dist.barrier()  # ranks leave together
    dist.destroy_process_group()
    return code


def _model_transform(
    use_torchao: bool,
) -> tuple[Callable[[nn.Module], None], list[str], list[nn.Module]]:
    """The trainer's model_transform hook for a run: swaps torchao's float8 layers in (the
    torchao recipe) and keeps the model and its FSDP blocks for the all-gather count.

    Returns (hook, the swapped layers' names, [model, *blocks] once the hook has run). The hook
    sees the converted model before FSDP, so `find_repeated_blocks` finds the very blocks
    apply_fsdp then shards one by one.
    """
    swapped: list[str] = []
    built: list[nn.Module] = []

    def transform(model: nn.Module) -> None:
        from minifloat.blocks import find_repeated_blocks

        if use_torchao:
            swapped.extend(torchao_float8_tensorwise(model))
        built[:] = [model, *find_repeated_blocks(model)]

    return transform, swapped, built


def _run_chunk(args: argparse.Namespace, device: torch.device, started: float) -> int:
    main = dist.get_rank() == 0
    out = run_dir(args.runs, args.model, args.recipe, args.quantized_all_gather)
    box: list[Any] = [None]
    if main:
        out.mkdir(parents=True, exist_ok=True)
        box[0] = _chunk_start(out, args.fresh, args.ckpt_format)
    dist.broadcast_object_list(box, src=0)
    start = box[0]
    if start is None:
        if main:
            print(f"scale_out: {out} is complete; nothing to do (--fresh starts it again)")
        return 0
    config = _train_config(args, out, start=start)
    if start >= config.steps:  # the last chunk saved but was stopped before it marked the run
        if main:
            (out / DONE_NAME).write_text(f"{start}\n")
        return 0
    dataset = _load_dataset_rank0_first(config, args.progress != "off")
    if main:
        _append_record(out, _start_record(args, config, dataset, start, device, started))
    _, use_torchao = _recipe_parts(args.recipe)
    transform, swapped, built = _model_transform(use_torchao)
    result = train(config, dataset=dataset, progress=args.progress, model_transform=transform)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, result.peak_memory_bytes)
    if not main:
        return 0
    per_step, whole = allgather_bytes_per_step(
        built[0], built[1:], dist.get_world_size(), micro_batches=config.resolved().grad_accum
    )
    built.clear()
    known = [p for p in peaks if p is not None]
    end = {
        "event": "end",
        "time": time.time(),
        "start_step": start,
        "end_step": result.steps,
        "wall_s": time.time() - started,
        "peak_mem_bytes": max(known) if known else None,
        "final_loss": result.final_loss,
        "final_val_loss": result.final_val_loss,
        "skipped_steps": result.skipped_steps,
        "float8_layers": len(swapped) if use_torchao else None,
        # The torchao recipe's weights are fp32 Float8Linear parameters, all-gathered in fp32
        # (its tensorwise config leaves enable_fsdp_float8_all_gather off): "other" bytes.
        "allgather_bytes_per_step": per_step,
        "allgather_model_bytes": whole,
    }
    _append_record(out, end)
    if result.steps >= config.steps:
        (out / DONE_NAME).write_text(f"{result.steps}\n")
    name = args.recipe + (QAG_SUFFIX if args.quantized_all_gather else "")
    print(
        f"scale_out: {args.model} {name} steps {start}->{result.steps} of {config.steps} "
        f"in {end['wall_s']:.0f} s; {'complete' if result.steps >= config.steps else 'continues'}"
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    md, js, png = write_report(args.runs, args.results_dir, rewarm=args.rewarm_steps, day=args.day)
    print(md.read_text())
    print(f"wrote {md}, {js}, {png}")
    return 0


# ---- command line ------------------------------------------------------------------------------


def _add_run_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--model", required=True, choices=sorted(PRESETS))
    add("--recipe", required=True, help=f"a minifloat recipe, or {TORCHAO_RECIPE}")
    add("--data", default="english", help="corpus name or path (e.g. .carry/english.xz)")
    add("--seq-len", type=int, default=2048)
    add("--batch-size", type=int, required=True, help="sequences per GPU per micro-batch")
    add("--grad-accum", type=int, default=1)
    add("--warmup-steps", type=int, default=20, help="untimed steps at the start of the run")
    add("--measure-steps", type=int, default=200, help="steps after the warm-up")
    add("--chunk-steps", type=int, default=0,
        help="steps per invocation, each resuming the checkpoint (0: all at once)")  # fmt: skip
    add("--ckpt-every", type=int, default=0, help="extra checkpoints inside a chunk (0: none)")
    add("--ckpt-format", default="full", choices=("full", "sharded"),
        help="full: one file via rank 0; sharded: one shard per rank, no gather (7B)")  # fmt: skip
    add("--no-checkpoint", action="store_true",
        help="write no checkpoint (only with --chunk-steps 0)")  # fmt: skip
    add("--fresh", action="store_true", help="discard the run's checkpoint and records first")
    add("--runs", type=Path, default=Path("runs/scale_out"), help="root of the run directories")
    add("--no-compile", dest="compile", action="store_false", help="eager mode (CPU tests)")
    add("--device", default="auto", help="auto, cuda or cpu")
    add("--vocab-size", type=int, default=None, help="BPE vocabulary (default: the preset's)")
    add("--tokenizer", default="bpe", choices=("bpe", "byte"))
    add("--data-max-bytes", type=int, default=None)
    add("--cache-dir", default=None, help="tokenized-dataset cache (default: data_cache)")
    add("--lr", type=float, default=None)
    add("--seed", type=int, default=0)
    add("--grad-comm", default="fp32", choices=("fp32", "bf16"), help="FSDP reduce dtype")
    add("--quantized-all-gather", action="store_true",
        help="all-gather QuantLinear weights quantized (run dir <model>_<recipe>+qag)")  # fmt: skip
    add("--eval-batches", type=int, default=2, help="validation batches at the last step (0: none)")
    add("--model-override", dest="model_overrides", type=parse_override, action="append",
        metavar="KEY=VALUE", help="change a preset field, e.g. dim=64 (repeatable)")  # fmt: skip
    add("--progress", default="plain", choices=("plain", "off"))


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``run`` (under torchrun) and ``report``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="train one chunk of one run (launch with torchrun)")
    _add_run_args(p_run)
    p_run.set_defaults(func=cmd_run)
    p_rep = sub.add_parser("report", help="write the results tables, JSON and loss curves")
    p_rep.add_argument("--runs", type=Path, default=Path("runs/scale_out"))
    p_rep.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p_rep.add_argument("--rewarm-steps", type=int, default=5,
                       help="steps not timed at the start of every resumed chunk")  # fmt: skip
    p_rep.add_argument("--day", default=None, help="date in the file names (default: today)")
    p_rep.set_defaults(func=cmd_report)
    return parser


def _check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.no_checkpoint and args.chunk_steps:
        parser.error("--no-checkpoint needs --chunk-steps 0: a later chunk resumes a checkpoint")
    if min(args.warmup_steps, args.chunk_steps, args.ckpt_every) < 0 or args.measure_steps < 1:
        parser.error("step counts must be >= 0 (--measure-steps >= 1)")
    if args.recipe != TORCHAO_RECIPE:
        from minifloat import recipes

        try:
            recipes.get(args.recipe)
        except (KeyError, ValueError) as exc:
            parser.error(str(exc))
    if args.quantized_all_gather:
        _check_quantized_all_gather(parser, args.recipe)


def _check_quantized_all_gather(parser: argparse.ArgumentParser, recipe: str) -> None:
    """Refuse, before torchrun's ranks build anything, a recipe the quantized all-gather cannot
    run: the library's own check (fsdp_plan.plan_for) with the run's recipe."""
    from minifloat import fsdp_plan, recipes
    from minifloat.recipes import QuantRecipe

    if recipe == TORCHAO_RECIPE:
        parser.error(
            f"--quantized-all-gather does not apply to {TORCHAO_RECIPE}: its float8 layers are "
            "torchao's Float8Linear, not minifloat's QuantLinear"
        )
    resolved = recipes.get(recipe)
    if not isinstance(resolved, QuantRecipe):
        parser.error(
            f"--quantized-all-gather needs a quantized recipe: {recipe} has no QuantLinear "
            "layers, so every weight is all-gathered at its own dtype either way"
        )
    try:
        fsdp_plan.plan_for(resolved)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        _check_run_args(parser, args)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
