"""The ``minifloat`` command line: train, compare, export, recipes, data.

Settings come from three layers, later ones winning: TrainConfig defaults, a TOML file
(``--config``; keys are TrainConfig field names, '-' or '_'), then command-line flags. With
``train --resume`` the first layer is the settings stored in the run's checkpoint instead, so
``minifloat train --out DIR --resume`` continues a run without repeating its flags.
User errors (unknown recipe/model/corpus, unreadable data, bad values, a checkpoint that does not
fit) print one line ``minifloat: error: ...`` and exit with status 2; ``--traceback`` shows the
full Python traceback instead, for debugging.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import sys
import tomllib
import warnings
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, NoReturn

from minifloat.errors import first_line

__all__ = ["build_parser", "main", "parse_count", "parse_override"]

EXIT_USAGE = 2
EXIT_FAILED = 1


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"minifloat: error: {message} (see `{self.prog} --help`)\n")


def parse_count(text: str, *, minimum: int = 1) -> int:
    """A count written as an integer or in scientific notation (``2e9``, ``1.5e6``).

    Decimal arithmetic keeps large values exact; non-integral values (``2.5``) and values below
    ``minimum`` raise ``argparse.ArgumentTypeError``.
    """
    try:
        number = Decimal(text.strip().replace("_", ""))
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not number.is_finite() or number != number.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    value = int(number)
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return parse_count(text)


def _nonnegative_int(text: str) -> int:
    return parse_count(text, minimum=0)


def parse_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of a `--model-override` flag: dashes in KEY become underscores, VALUE an
    int or float where it parses as one, else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for cast in (int, float):
        try:
            return key.replace("-", "_"), cast(value)
        except ValueError:
            pass
    return key.replace("-", "_"), value


# (flag, TrainConfig field, argparse kwargs) for flags shared by `train` and `compare`.
_SHARED_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--model", "model", {"help": "model preset (tiny, 20M, 50M, 125M, 350M, 1.3B, 7B, 13B)"}),
    ("--data", "data", {"help": "corpus name (stdlib, site-packages, english) or a path"}),
    ("--steps", "steps", {"type": _positive_int, "help": "optimizer steps"}),
    ("--tokens", "tokens", {"type": _positive_int, "help": "training tokens (instead of steps)"}),
    ("--batch-size", "batch_size", {"type": int, "help": "per-rank micro-batch (sequences)"}),
    ("--seq-len", "seq_len", {"type": int, "help": "tokens per sequence"}),
    ("--grad-accum", "grad_accum", {"type": int, "help": "micro-batches per optimizer step"}),
    ("--lr", "lr", {"type": float, "help": "peak learning rate"}),
    ("--warmup-fraction", "warmup_fraction", {"type": float}),
    ("--min-lr-ratio", "min_lr_ratio", {"type": float}),
    ("--weight-decay", "weight_decay", {"type": float}),
    ("--grad-clip", "grad_clip", {"type": float, "help": "max global grad norm (0: off)"}),
    ("--vocab-size", "vocab_size", {"type": int}),
    ("--tokenizer", "tokenizer", {"choices": ["bpe", "byte"]}),
    (
        "--data-max-bytes",
        "data_max_bytes",
        {"type": _nonnegative_int, "help": "cap on corpus bytes (0: none)"},
    ),
    ("--cache-dir", "cache_dir", {"help": "dataset/tokenizer cache directory"}),
    ("--device", "device", {"help": "auto, cpu, cuda, cuda:N"}),
    ("--seed", "seed", {"type": int}),
    ("--parallel", "parallel", {"choices": ["none", "ddp", "fsdp"]}),
    ("--grad-comm", "grad_comm", {"choices": ["fp32", "bf16", "fp8"]}),
    (
        "--size-rule",
        "size_rule",
        {
            "help": "IN:OUT[,IN:OUT...]: keep linear layers with in <= IN and out <= OUT in bf16 "
            "('*': no bound), e.g. 4096:1024 (torchao's tensorwise rule)"
        },
    ),
    (
        "--compile-mode",
        "compile_mode",
        {
            "help": "torch.compile mode with --compile: default, reduce-overhead (CUDA graphs), "
            "max-autotune, max-autotune-no-cudagraphs"
        },
    ),
    (
        "--compile-scope",
        "compile_scope",
        {
            "help": "with --compile: block (the default: each repeated block, as torchtitan: "
            "identical blocks share a graph, so compiling takes one block's time) or model "
            "(one graph: slower to compile, faster steps for small models)"
        },
    ),
    ("--optim-states", "optim_states", {"help": "optimizer-state preset (fp32, bf16, ...)"}),
    ("--eval-every", "eval_every", {"type": int, "help": "steps between validations (0: end)"}),
    ("--eval-batches", "eval_batches", {"type": int}),
    ("--log-every", "log_every", {"type": int}),
    ("--z-loss", "z_loss", {"type": float, "help": "z-loss coefficient (e.g. 1e-4; 0: off)"}),
    (
        "--loss-chunk",
        "loss_chunk",
        {"type": int, "help": "the head and the loss N tokens at a time (no full logits; 0: off)"},
    ),
    ("--embed-grad-shrink", "embed_grad_shrink", {"type": float, "help": "alpha (1: off)"}),
    ("--spike-k", "spike_k", {"type": float, "help": "skip steps above mean + k*std (0: off)"}),
    (
        "--grad-norm-spike-k",
        "grad_norm_spike_k",
        {
            "type": float,
            "help": "skip steps whose grad norm is above mean + k*std (default 0: off)",
        },
    ),
    ("--sqnr-every", "sqnr_every", {"type": int, "help": "per-layer SQNR every N steps (0: off)"}),
    (
        "--max-skip-fraction",
        "max_skip_fraction",
        {"type": float, "help": "fail the run when more of its steps were skipped (default 0.5)"},
    ),
]


def _add_shared(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file of TrainConfig settings")
    for flag, dest, kwargs in _SHARED_FLAGS:
        parser.add_argument(flag, dest=dest, default=None, **kwargs)
    parser.add_argument("--compile", dest="compile", action="store_true", default=None)
    parser.add_argument(
        "--quantized-all-gather", dest="quantized_all_gather", action="store_true", default=None
    )
    parser.add_argument(
        "--no-weight-guard",
        dest="weight_guard",
        action="store_false",
        default=None,
        help="do not refuse updates that make a weight non-finite (saves a copy of the weights "
        "and optimizer state per step)",
    )
    parser.add_argument(
        "--overwrite",
        dest="overwrite",
        action="store_true",
        default=None,
        help="replace the run already in --out (its metrics and checkpoints)",
    )
    parser.add_argument(
        "--model-override",
        dest="model_overrides",
        type=parse_override,
        action="append",
        metavar="KEY=VALUE",
        help="change a model-preset field, e.g. --model-override dim=64 (repeatable)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _add_train_flags(p_train: argparse.ArgumentParser) -> None:
    """The flags of ``train``: the shared ones plus the recipe switch, checkpoints and resume."""
    p_train.add_argument("--recipe", dest="recipe", default=None, help="precision recipe")
    p_train.add_argument(
        "--switch-recipe",
        dest="switch_recipe",
        default=None,
        metavar="NAME",
        help="final-phase switch: the quantized layers change to this recipe in place after "
        "--switch-at (e.g. bf16 for the last 10 %% of an fp4 run)",
    )
    p_train.add_argument(
        "--switch-at",
        dest="switch_at",
        type=float,
        default=None,
        metavar="F",
        help="when --switch-recipe takes over: a fraction in (0, 1) of the steps (0.9: the last "
        "10 %%), or a whole step number (the switch comes after that step)",
    )
    p_train.add_argument(
        "--branch-from",
        dest="branch_from",
        default=None,
        metavar="DIR",
        help="start this switched run from the plain run in DIR (its newest checkpoint at or "
        "before the switch step; or one checkpoint file) instead of training the shared steps",
    )
    _add_shared(p_train)
    p_train.add_argument("--out", dest="out_dir", default=None, help="run directory")
    p_train.add_argument("--resume", dest="resume", action="store_true", default=None)
    p_train.add_argument(
        "--ckpt-every",
        dest="ckpt_every",
        type=int,
        default=None,
        help="steps between checkpoints (default 500; 0: only at the end)",
    )
    p_train.add_argument("--keep-checkpoints", dest="keep_checkpoints", type=int, default=None,
                         help="how many of the newest checkpoints to keep (default 2)")  # fmt: skip
    p_train.add_argument(
        "--ckpt-format",
        dest="checkpoint_format",
        default=None,
        choices=["full", "sharded"],
        help="full: one file via rank 0; sharded: one shard per rank (FSDP)",
    )
    p_train.add_argument("--stop-after", dest="stop_after", type=int, default=None,
                         help="stop (with a checkpoint) after this step")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``minifloat`` command."""
    parser = _Parser(prog="minifloat", description="Train LLMs in FP4, FP8 and mixed precision.")
    parser.add_argument("--traceback", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p_train = sub.add_parser("train", help="train a model under one recipe")
    _add_train_flags(p_train)
    p_train.set_defaults(func=_cmd_train)

    p_cmp = sub.add_parser("compare", help="train the same run under several recipes")
    p_cmp.add_argument(
        "--recipes",
        required=True,
        help="comma-separated recipes or variants, the first the reference; "
        "RECIPE+switch=SWITCH+at=F is a run with a final-phase switch (fp4+switch=bf16+at=0.9)",
    )
    _add_shared(p_cmp)
    p_cmp.add_argument("--out", dest="out_dir", default="runs/compare", help="output directory")
    p_cmp.add_argument(
        "--no-branch",
        action="store_true",
        help="train a switched run from step 0 even when its plain run is compared too (by "
        "default it branches from that run's checkpoint at the switch step)",
    )
    p_cmp.set_defaults(func=_cmd_compare)

    p_hf = sub.add_parser("export", help="write a trained run as a Hugging Face LLaMA")
    p_hf.add_argument("run_dir", type=Path, help="run directory (train --out) with checkpoint.pt")
    p_hf.add_argument("--out", dest="dest_dir", required=True, type=Path, help="output directory")
    p_hf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p_hf.add_argument(
        "--with-tokenizer",
        action="store_true",
        help="also write tokenizer.json (re-opens the run's dataset, from its cache if present)",
    )
    p_hf.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    p_hf.set_defaults(func=_cmd_export)

    p_rec = sub.add_parser("recipes", help="list precision recipes and variant keys")
    p_rec.set_defaults(func=_cmd_recipes)

    p_data = sub.add_parser("data", help="build and inspect corpora")
    data_sub = p_data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    p_build = data_sub.add_parser("build", help="build a corpus (english)")
    p_build.add_argument("name", choices=["english"])
    p_build.add_argument(
        "--out",
        dest="dest_dir",
        default=None,
        help="directory for english.xz (default data_cache/corpora, where --data english looks)",
    )
    p_build.set_defaults(func=_cmd_data_build)
    p_export = data_sub.add_parser("export", help="write a corpus to one .xz file")
    p_export.add_argument("name")
    p_export.add_argument("--out", required=True, type=Path)
    p_export.add_argument("--max-bytes", type=_positive_int, default=None)
    p_export.add_argument("--cache-dir", default=None, help="cache directory of built corpora")
    p_export.set_defaults(func=_cmd_data_export)
    p_info = data_sub.add_parser("info", help="show a corpus's size and sha256")
    p_info.add_argument("name")
    p_info.add_argument("--cache-dir", default=None, help="cache directory of built corpora")
    p_info.set_defaults(func=_cmd_data_info)
    # --traceback after the command too (`minifloat train --traceback ...`); SUPPRESS leaves
    # the top-level default in place when it is not given there
    for p in [*sub.choices.values(), *data_sub.choices.values()]:
        p.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks on errors")  # fmt: skip
    return parser


def _train_config(args: argparse.Namespace) -> Any:
    """TrainConfig from defaults (or, on resume, the checkpoint's) < TOML file < flags."""
    from minifloat.train.config import ConfigError, TrainConfig

    values = _explicit_values(args)
    if values.get("resume") is True and values.get("overwrite") is True:
        raise ConfigError("give either resume or overwrite, not both")
    if args.command == "train" and values.get("resume") is True:
        values = _with_stored_settings(values)
    return TrainConfig.from_dict(values)


def _explicit_values(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave: the TOML file's, then the flags' on top."""
    from minifloat.train.config import ConfigError, TrainConfig

    values: dict[str, Any] = {}
    if args.config is not None:
        try:
            with open(args.config, "rb") as f:
                values.update(tomllib.load(f))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"cannot parse {args.config}: {exc}") from None
        try:  # a key or type the file got wrong is named with the file
            TrainConfig.typed_values(values)
        except ConfigError as exc:
            raise ConfigError(f"{args.config}: {exc}") from None
    values = {k.replace("-", "_"): v for k, v in values.items()}
    # steps/tokens from the command line replace the file's choice instead of clashing with it.
    if args.steps is not None or args.tokens is not None:
        values.pop("steps", None)
        values.pop("tokens", None)
    flags = [dest for _, dest, _ in _SHARED_FLAGS]
    flags += ["recipe", "out_dir", "resume", "ckpt_every", "stop_after", "compile"]
    flags += ["checkpoint_format", "keep_checkpoints", "overwrite", "weight_guard"]
    flags += ["quantized_all_gather"]
    flags += ["switch_recipe", "switch_at", "branch_from"]
    for dest in flags:
        value = getattr(args, dest, None)
        if value is not None:
            values[dest] = value
    if args.model_overrides:
        values["model_overrides"] = _merged(
            values.get("model_overrides", {}), dict(args.model_overrides)
        )
    # Checked here, among the settings the user gave: resolved configs carry the model's
    # default vocab_size whatever the tokenizer, and the byte tokenizer ignores it.
    if values.get("tokenizer") == "byte" and "vocab_size" in values:
        raise ConfigError(
            f"vocab-size {values['vocab_size']} applies to the bpe tokenizer; the byte "
            "tokenizer's vocabulary is its 257 tokens (drop vocab-size)"
        )
    return values


def _merged(base: Any, extra: Any) -> Any:
    """Model overrides ``extra`` on top of ``base``; a value that is not a table is kept as is,
    for TrainConfig.from_dict to reject with a clear message."""
    if not isinstance(base, dict):
        return base
    return {**base, **extra} if isinstance(extra, dict) else extra


# Stored settings a resume does not take over: the current command decides these.
_NOT_RESUMED = ("resume", "stop_after", "overwrite", "branch_from")


def _with_stored_settings(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` on top of the settings stored in the checkpoint of the run being resumed.

    A setting given now that changes the trajectory still fails the fingerprint check on load.
    """
    from minifloat.train.checkpointer import read_run_config, require_checkpoint
    from minifloat.train.config import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    out_dir, fmt = values.get("out_dir", fields["out_dir"].default), values.get("checkpoint_format")
    if not isinstance(out_dir, str):
        return values  # from_dict reports the wrong type
    out = Path(out_dir)
    formats = (fmt,) if fmt in ("full", "sharded") else ("full", "sharded")
    require_checkpoint(out, formats, "--resume", "leave out --resume to start a new run")
    # The newest readable one: a damaged newest checkpoint is the trainer's to fall back from.
    _, stored = read_run_config(out, formats)
    base = {k: v for k, v in stored.items() if k in fields and k not in _NOT_RESUMED}
    if "steps" in values or "tokens" in values:
        base.pop("steps", None)
        base.pop("tokens", None)
    overrides = _merged(base.get("model_overrides", {}), values.get("model_overrides", {}))
    # The directory the checkpoint was found in, even if the run was moved since.
    return {**base, **values, "model_overrides": overrides, "out_dir": str(out)}


def _progress(args: argparse.Namespace) -> bool | str:
    return False if args.quiet else "auto"


def _cmd_train(args: argparse.Namespace) -> int:
    from minifloat.train.trainer import train

    config = _train_config(args)
    result = train(config, progress=_progress(args))
    if result.rank != 0:
        return 0
    val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
    print(
        f"{result.recipe} {result.model}: {result.steps} steps, train loss "
        f"{result.final_loss:.4f}, val loss {val}, {result.tokens_per_s:.0f} tokens/s, "
        f"{result.skipped_steps} skipped; metrics: {result.metrics_path}"
    )
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from minifloat.train.compare import compare

    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    config = _train_config(args)
    result = compare(names, config, out_dir=config.out_dir, progress=_progress(args),
                     branch=not args.no_branch)  # fmt: skip
    print(result.table)
    print(f"plot: {result.plot_path}")
    print(f"table: {result.markdown_path}  json: {result.json_path}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from minifloat.train.export import export_run

    dtype = getattr(torch, args.dtype)
    exported = export_run(args.run_dir, args.dest_dir, dtype=dtype,
                          with_tokenizer=args.with_tokenizer, overwrite=args.overwrite)  # fmt: skip
    files = ", ".join(sorted(p.name for p in exported.files))
    print(f"exported {args.run_dir} ({exported.recipe} {exported.model}, step {exported.step}) "
          f"to {exported.out_dir}: {files}")  # fmt: skip
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from minifloat import recipes

    rows = [("recipe", "fprop", "dgrad", "wgrad", "description")]
    for name in recipes.names():
        recipe = recipes.get(name)
        describe = getattr(recipe, "describe", None)
        gemms = describe() if callable(describe) else {}
        rows.append(
            (
                name,
                gemms.get("fprop", "high precision"),
                gemms.get("dgrad", "high precision"),
                gemms.get("wgrad", "high precision"),
                getattr(recipe, "description", ""),
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    for row in rows:
        cells = [str(cell).ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
        print("  ".join([*cells, str(row[4])]).rstrip())
    print(
        "\nOn FP8 tensor cores fprop accumulates fast (no periodic fp32 promotion) and dgrad and"
        " wgrad promote, unless a column says otherwise."
    )
    print("\nvariants: BASE:KEY=VALUE[:KEY=VALUE...] of a quantized recipe, e.g. fp4:dge.k=3")
    variant_help = recipes.variant_help()
    width = max(len(key) for key in variant_help)
    for key, meaning in variant_help.items():
        print(f"  {key.ljust(width)}  {meaning}")
    return 0


def _cache_kwargs(cache_dir: str | None) -> dict[str, Any]:
    return {} if cache_dir is None else {"cache_dir": Path(cache_dir)}


def _cmd_data_build(args: argparse.Namespace) -> int:
    from minifloat import data

    kwargs = {} if args.dest_dir is None else {"dest_dir": Path(args.dest_dir)}
    path = data.build_english(**kwargs)
    print(f"built {args.name}: {path}")
    return 0


def _cmd_data_export(args: argparse.Namespace) -> int:
    from minifloat import data

    path = data.export_corpus(
        args.name, args.out, max_bytes=args.max_bytes, **_cache_kwargs(args.cache_dir)
    )
    print(f"exported {args.name} to {path}")
    return 0


def _cmd_data_info(args: argparse.Namespace) -> int:
    from minifloat import data

    print(json.dumps(data.corpus_info(args.name, **_cache_kwargs(args.cache_dir)), indent=2))
    return 0


def _show_warning(
    message: Any, category: type[Warning], filename: str, lineno: int, *_: Any, **__: Any
) -> None:
    """Warnings about the run as ``minifloat: warning: ...``; others as Python shows them."""
    from minifloat.train.errors import RunWarning

    if issubclass(category, RunWarning):
        print(f"minifloat: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``minifloat`` console script and ``python -m minifloat``.

    Exit status: 0 done; 2 a user error (bad setting or data, run directory in use or holding
    another run, a checkpoint that does not fit); 1 a run that failed (too many skipped steps,
    out of memory); 128 + N a run stopped by signal N (130 SIGINT, 143 SIGTERM), after its
    checkpoint. Each error is one line; ``--traceback`` shows the Python traceback instead.
    """
    from minifloat.train.errors import CheckpointError, RunFailed, TrainingInterrupted

    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return args.func(args)
    except TrainingInterrupted as exc:
        resume = "; continue with --resume" if exc.checkpoint is not None else ""
        print(f"minifloat: {exc}{resume}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("minifloat: interrupted", file=sys.stderr)
        return 130
    except RunFailed as exc:
        if args.traceback:
            raise
        print(f"minifloat: error: {first_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    # EOFError, LZMAError: a truncated compressed corpus (data/ turns these into DataError).
    except (CheckpointError, ValueError, TypeError, OSError, EOFError, lzma.LZMAError) as exc:
        if args.traceback:
            raise
        # A run stopped by an error mid-loop carries a note naming its newest checkpoint.
        notes = [n.removeprefix("minifloat: ") for n in getattr(exc, "__notes__", [])]
        print(f"minifloat: error: {'; '.join([first_line(exc), *notes])}", file=sys.stderr)
        return EXIT_USAGE
