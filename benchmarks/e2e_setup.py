"""Setting up train_e2e.py's rows: compilation (per block or whole model, inductor options) and
FSDP2 (the process group, sharding, the quantized all-gathers' step hook). train_e2e.py
re-exports these; train_interleaved.py and qag_equality.py use them through it."""

from __future__ import annotations

import os

import torch
from torch import nn

from minifloat.blocks import find_repeated_blocks


def compile_model(
    net: nn.Module, scope: str, mode: str | None, options: dict | None = None
) -> nn.Module:
    """torch.compile the whole model, or each repeated block (torchtitan's way: identical blocks
    share one compiled graph, so compilation takes one block's time); `options`: inductor's."""
    if scope == "model":
        return torch.compile(net, mode=mode, options=options)
    for block in find_repeated_blocks(net):  # in place: FSDP2 then wraps the same modules
        block.compile(mode=mode, options=options)
    return net


def parse_compile_options(text: str, mode: str | None = None) -> dict | None:
    """'KEY=VALUE[,KEY=VALUE...]' -> inductor options for torch.compile (True/False and integers
    converted), e.g. 'triton.prefer_nd_tiling=True'; '' -> None. torch.compile takes options or
    a `mode`, not both: a one-line exit where both are given."""
    options = {}
    for part in filter(None, text.split(",")):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise SystemExit(f"--compile-options takes KEY=VALUE[,KEY=VALUE...], got {text!r}")
        literal = {"True": True, "False": False}.get(value, value)
        options[key] = int(value) if value.lstrip("-").isdigit() else literal
    if options and mode:
        raise SystemExit("--compile-options and --compile-mode cannot be combined (torch.compile)")
    return options or None


def init_process_group(device: str) -> tuple[int, int]:
    """(rank, world size): torchrun's process group, or one of a single rank when launched
    plainly (FSDP2 rows need one); on CUDA each rank takes its LOCAL_RANK's GPU."""
    import torch.distributed as dist

    from minifloat.train.runtime import join_process_group

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            import socket

            with socket.socket() as sock:  # a free port for the one-rank group
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port), LOCAL_RANK="0")  # fmt: skip
        join_process_group("cuda" if device == "cuda" else "cpu")
    return dist.get_rank(), dist.get_world_size()


def shard_model(net: nn.Module, args, mode: str, torchao: bool) -> nn.Module:
    """FSDP2 as the trainer does it: compile each block in place (scope block), fully_shard each
    block and the root, compile the whole model after (scope model); returns the module to
    call. mode "qag": minifloat's quantized weight all-gather (torchao rows: set in prepare)."""
    from minifloat.distributed import apply_fsdp

    if args.compile_scope == "block":
        compile_model(net, "block", args.compile_mode, args.compile_options)
    apply_fsdp(net, quantized_all_gather=mode == "qag" and not torchao)
    if args.compile_scope == "model":
        return torch.compile(net, mode=args.compile_mode, options=args.compile_options)
    return net


def after_step_fn(net: nn.Module, mode: str | None, torchao: bool):
    """What follows each optimizer step: the quantized all-gathers' amax precompute (one
    all-reduce for every tensor-scaled weight; minifloat's or torchao's), else nothing."""
    if mode != "qag":
        return None
    if torchao:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        return lambda: precompute_float8_dynamic_scale_for_fsdp(net)
    from minifloat.fsdp_quantized import precompute_quantized_weights

    return lambda: precompute_quantized_weights(net)
