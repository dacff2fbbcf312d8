"""Does a selective-checkpoint policy make torch.compile recompute an opaque op in backward?

    PYTHONPATH=src python benchmarks/recompute_custom_op_probe.py

A quantizer written as a kernel of our own is a custom op, and AOTAutograd's partitioner never
recomputes those: a compiled layer then saves the op's FP8 output for backward (docs/hopper.md,
"The partitioner recomputes aten ops only"; fp4's z would cost 4.3 GiB at 1.3B, session 32).
recompute.py marks ops "prefer recompute" inside a `torch.utils.checkpoint` region for
fp8-delayed. This probe asks whether the same mechanism, with MUST_RECOMPUTE on a custom op,
moves the op into backward: a toy autograd Function (y = sin(x) @ w) saves a custom op's E4M3
cast of its input for its wgrad, compiled with and without the policy (CPU or GPU alike: the
partition is the same). Prints what each form saves for backward.

Session 52 (torch 2.13 CPU): without the policy the float8 cast is saved; with it, nothing
float8 is saved (the cast's float32 input is, and the op runs again in backward). So a
hand-written fused kernel need not cost its output's memory, if its region carries this policy.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)


@torch.library.custom_op("minifloat_probe::cast_e4m3", mutates_args=())
def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for a hand-written quantizer: opaque to the compiler."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


@cast_e4m3.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float8_e4m3fn)


class _Layer(torch.autograd.Function):
    """y = x @ w; backward's wgrad reads the custom op's cast of x, saved by forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cast_e4m3(x), w)
        return x @ w

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_q, w = ctx.saved_tensors
        return dy @ w.t(), x_q.float().t() @ dy


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func is torch.ops.minifloat_probe.cast_e4m3.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _policy)


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _Layer.apply(torch.sin(x), w)


def _with_policy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return checkpoint(_Layer.apply, torch.sin(x), w, use_reentrant=False, context_fn=_CONTEXT)


def saved_dtypes(with_policy: bool) -> list[torch.dtype]:
    """Dtypes of what one compiled step of the toy saves for backward."""
    torch._dynamo.reset()
    step = torch.compile(_with_policy if with_policy else _plain)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    seen: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = step(x, w)
    y.sum().backward()
    torch._dynamo.reset()
    return seen


def main() -> None:
    for with_policy in (False, True):
        dtypes = saved_dtypes(with_policy)
        label = "MUST_RECOMPUTE policy" if with_policy else "no policy"
        print(f"{label}: saves {[str(d).removeprefix('torch.') for d in dtypes]}")


if __name__ == "__main__":
    main()
