"""fp8-delayed under torch.compile: a checkpoint policy that recomputes FP8 operands in backward.

A compiled QuantLinear saves no FP8 operand for backward when AOTAutograd's min-cut partitioner
recomputes the casts there from bf16 tensors it saves anyway (the norm's input, the SwiGLU's
gate and up, the attention output). Under fp8-delayed it did not for the layers that read an
input another layer had cast before them with its own history's scale (k and v after q, up
after gate): the partitioner's "used above/below fusible" rule bans recomputing a use of a
value that comes after an unfusible op (here q's GEMM), so it saved those three FP8 copies,
~2.2 GiB at 1.3B (peak memory 0.86x bf16 against fp8-tensorwise's 0.81x;
docs/hopper_sessions.md, session 13).

`checkpointed` runs the layer's autograd Function inside a selective activation-checkpoint
region (`torch.utils.checkpoint`, as torchtitan uses it) whose policy marks the quantizer's
elementwise ops and narrowing casts "prefer recompute"; the partitioner honours that before its
heuristics. Reductions (the amax), GEMMs and opaque ops keep its own rules, so the scale is
saved, never recomputed by another pass over the input. Conversions to float32 / float64 are
left to it too: the layers that read one input share its conversion in the compiled graph, and
marked "recompute" in the first layer's region and used by a later region's it is saved (the
partitioner's rule at region boundaries): the input in float64, worse than the FP8 copies.
Measured on an H200: 1.3B fp8-delayed peak memory 0.86x -> 0.81x of bf16's at the same speed
(1.22x); 125M 0.87x -> 0.81x, and 0.81x -> 0.87x of bf16's speed (host-bound steps; kernel time
52.6 -> 51.9 ms, 2,072 kernels a step against 1,880).

Applied only where measured: fp8-delayed on the Hopper path (`applies`). Left out on the
emulation (the CPU, GPUs without FP8 GEMMs), where it was never measured and where torch
2.13.0's C++ code generator miscompiles one of its fused backward kernels: compiled fp8-delayed
on the CPU got 18 of 21 gradients of the tiny LLaMA up to 31 % off eager (pytorch#185702;
`benchmarks/cpu_compile_probe.py --region always` reproduces it; without the region they agree
to rounding; docs/hopper_sessions.md, sessions 81-82). Tried for every FP8-operand recipe
together with opaque transposed copies of the recomputed operands (which the partitioner
otherwise answers by saving the operands), it gave no speed (1.3B fp8-tensorwise 222.8 vs
223.3 ms a step) and cost some (fp4-dge 265.6 vs 255.9 ms; docs/hopper_sessions.md, session
18). Eagerly nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from minifloat.fsdp_weight import GatheredWeight
from minifloat.kernels.backend import Backend
from minifloat.recipes import QuantRecipe

__all__ = ["applies", "checkpointed"]

_WIDE_FLOATS = (torch.float32, torch.float64)


def applies(recipe: QuantRecipe, weight: torch.Tensor, backend: Backend) -> bool:
    """Whether a compiled layer under `recipe` runs in the recompute region: fp8-delayed (any
    recipe with delayed scaling) on the Hopper path, unless its weight arrives quantized by an
    FSDP2 all-gather (fsdp_weight.GatheredWeight). Both exclusions: not measured with the region
    (and on the emulation, see the module docstring, miscompiled by torch 2.13 on the CPU)."""
    return (
        recipe.delayed is not None
        and backend.name == "hopper"
        and not isinstance(weight, GatheredWeight)
    )


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Recompute elementwise ops and narrowing casts; leave everything else, and widening
    conversions (see the module docstring), to the partitioner."""
    if func is torch.ops.aten._to_copy.default:
        if kwargs.get("dtype") in _WIDE_FLOATS:
            return CheckpointPolicy.PREFER_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    if torch.Tag.pointwise in func.tags:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


# A module-level object: dynamo traces a checkpoint's `context_fn` only if it is no closure.
_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _policy)


def checkpointed(function: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`function(*args)` (a QuantLinearFunction.apply) inside the recompute region. For traced
    code: torch.compile issues one warning per process that the region must hold no in-place
    ops (it holds none: the amax history is written in backward)."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=_CONTEXT)
