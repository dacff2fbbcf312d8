"""What the weight ops share (kernels/weight_blocks.py, weight_tensor.py, weight_rows.py): the
weights they take, and their registration as one opaque op with a Triton body.

Each op quantizes a 2-D weight whose dims are multiples of 128 to E4M3 and returns two FP8
operands ([R, C] and [C, R]) and float32 scales or multipliers. `define` registers it twice:
`minifloat::<name>`, a Library op for eager calls (a cheaper host wrapper than a custom op, as
kernels/transpose.py says), running the Triton kernels on CUDA and the module's reference
(kernels/operand.py) elsewhere; and `minifloat::<name>_traced`, a `triton_op` that inductor
launches from its own code under torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minifloat import formats

__all__ = ["BLOCK", "check_shape", "define", "fits"]

BLOCK = 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LIB = torch.library.Library("minifloat", "FRAGMENT")

Outputs = tuple[torch.Tensor, ...]


def fits(w: torch.Tensor) -> bool:
    """Whether `w` is a 2-D CUDA float tensor whose dims are non-zero multiples of 128, the
    weights the ops' kernels take."""
    return (
        w.is_cuda
        and w.dim() == 2
        and w.dtype in _DTYPES
        and w.numel() > 0
        and w.shape[0] % BLOCK == 0
        and w.shape[1] % BLOCK == 0
    )


def check_shape(w: torch.Tensor, op: str) -> None:
    """A one-line ValueError unless `w` is 2-D with dims non-zero multiples of 128."""
    if w.dim() != 2 or w.numel() == 0 or w.shape[0] % BLOCK or w.shape[1] % BLOCK:
        raise ValueError(f"{op} takes a 2-D tensor with dims non-zero multiples of {BLOCK}, "
                         f"got shape {tuple(w.shape)}")  # fmt: skip


def define(
    name: str,
    kernel: Callable[..., Outputs] | None,
    reference: Callable[[torch.Tensor, bool], Outputs],
    scale_shapes: Callable[[int, int], list[tuple[int, int]]],
) -> Callable[[torch.Tensor, bool], Outputs]:
    """Register the weight op `name(Tensor w, bool inv)`, returning the function that calls it:
    (E4M3 values [R, C], E4M3 values [C, R], then float32 tensors of `scale_shapes(R, C)`), by
    `kernel(w, fmt_max, inv, traced=...)` (None without Triton) on CUDA and `reference(w, inv)`
    elsewhere. The function checks the shape, detaches `w` (no gradient flows through
    quantization) and takes the traced op under torch.compile on CUDA."""
    n_out = 2 + len(scale_shapes(BLOCK, BLOCK))
    _LIB.define(f"{name}(Tensor w, bool inv) -> ({', '.join(['Tensor'] * n_out)})")
    fmt_max = formats.get("e4m3").max

    def eager(w: torch.Tensor, inv: bool) -> Outputs:
        if w.is_cuda and kernel is not None:
            return kernel(w.contiguous(), fmt_max, inv)
        return reference(w, inv)

    def fake(w: torch.Tensor, inv: bool) -> Outputs:
        rows, cols = w.shape
        fp8 = torch.float8_e4m3fn
        values = [w.new_empty((rows, cols), dtype=fp8), w.new_empty((cols, rows), dtype=fp8)]
        scales = [w.new_empty(s, dtype=torch.float32) for s in scale_shapes(rows, cols)]
        return (*values, *scales)

    _LIB.impl(name, eager, "CompositeExplicitAutograd")
    torch.library.register_fake(f"minifloat::{name}")(fake)
    op = getattr(torch.ops.minifloat, name).default
    traced_op = None
    if kernel is not None:

        def traced(w, inv):  # pragma: no cover - runs on the GPU
            return kernel(w.contiguous(), fmt_max, inv, traced=True)

        # the schema comes from the annotations: n_out tensors
        traced.__annotations__ = {"w": torch.Tensor, "inv": bool,
                                  "return": tuple[(torch.Tensor,) * n_out]}  # fmt: skip
        torch.library.triton_op(f"minifloat::{name}_traced", traced, mutates_args=())
        traced_op = getattr(torch.ops.minifloat, f"{name}_traced").default

    def call(w: torch.Tensor, inv: bool) -> Outputs:
        check_shape(w, name)
        w = w.detach()
        if traced_op is not None and w.is_cuda and torch.compiler.is_compiling():
            return traced_op(w, inv)  # pragma: no cover - runs on the GPU
        return op(w, inv)

    return call
