"""What a quantized FSDP2 weight all-gather sends, and how a shard is quantized for it.

Under FSDP2 (`fully_shard`, dim-0 sharding) rank r holds rows [r·N/W, (r+1)·N/W) of every
[N, K] weight (N output channels, K input features). A `QuantLinear` whose weight all-gather
is quantized (fsdp_weight.py) sends, per rank, its rows already quantized the way the recipe's
GEMMs take the weight, so that the all-gathered operand equals `backend.quantize(full weight)`
bit for bit:

- values: the FP8 byte (E4M3 / E5M2), or E2M1 packed two a byte (`pack_e2m1`): 1 or 0.5
  byte per parameter;
- scales, by where their groups lie (in the weight's own [N, K] layout):
  - "tensor": one scale from the max of the ranks' amaxes (one MAX all-reduce of 4 bytes); every
    rank then holds the same scale, so it is not all-gathered;
  - "row" (one scale per output channel, reduced along K): a row is whole on one rank, so its
    scale is the rank's own; the [rows, 1] fp32 scales are all-gathered with the values;
  - "column" (a transposed row-scaled operand: one scale per input channel, reduced along N,
    across all ranks): a MAX all-reduce of the [1, K] amaxes, then local, not all-gathered;
  - blocks (br, bc): local when every rank's rows are a multiple of br (block rows never cross
    a shard boundary); the block scales are all-gathered. Else refused (`check_layout`).

Operands: the fprop weight (`recipe.fprop.rhs`) always; the dgrad weight (`recipe.dgrad.rhs`,
wᵀ quantized along N) as well when the recipe quantizes it anew instead of reusing the fprop
values (fp8-rowwise: 2 bytes per parameter then). Non-finite weights stay non-finite: the
all-reduced amax is NaN (or inf) where any rank's is, as the amax of the whole weight would be.

The amaxes a weight all-reduces (`shard_amaxes`: tensor, column and fp8-delayed's) go through
one all-reduce per weight (`global_amaxes`), or, precomputed after the optimizer step for every
weight at once, through one per step (`fsdp_quantized.precompute_quantized_weights`, which also
quantizes every shard then: `quantize_weights`, one compiled call per block on the GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minifloat import delayed
from minifloat.exact import div_rn
from minifloat.formats import get as get_format
from minifloat.kernels import Backend, QOperand
from minifloat.kernels import operand as op
from minifloat.kernels.backend import fp32_scaled
from minifloat.quantize import Granularity
from minifloat.recipes import DelayedScaling, DGEConfig, OperandSpec, QuantRecipe

__all__ = [
    "GatheredSpec",
    "GatherPlan",
    "plan_for",
    "check_layout",
    "shard_amaxes",
    "split_amaxes",
    "global_amaxes",
    "quantize_shard",
    "quantize_weight",
    "quantize_weights",
    "shard_amaxes_many",
    "gathered_operand",
    "pack_payload",
    "unpack_payload",
    "payload_bytes",
    "global_amax",
    "delayed_weight_scale",
]


@dataclass(frozen=True)
class GatheredSpec:
    """One weight operand the all-gather carries: `spec` as the recipe names it, `transpose`
    when its GEMM takes wᵀ [K, N] (dgrad quantizing the weight anew)."""

    spec: OperandSpec
    transpose: bool = False

    @property
    def groups(self) -> Granularity | str:
        """Scale groups in the weight's [N, K] layout: "tensor", "row", "column" or a block."""
        g = self.spec.granularity
        if isinstance(g, tuple):
            return g[::-1] if self.transpose else g
        if g == "row" and self.transpose:
            return "column"
        return g

    @property
    def gathers_scale(self) -> bool:
        """Whether the scales travel with the values (else every rank computes the same)."""
        return self.groups not in ("tensor", "column")


@dataclass(frozen=True)
class GatherPlan:
    """The operands a recipe's quantized weight all-gather sends, fprop's first."""

    recipe_name: str
    operands: tuple[GatheredSpec, ...]
    delayed: DelayedScaling | None = None
    dge: DGEConfig | None = None

    def find(self, spec: OperandSpec, transpose: bool) -> int:
        """Index of the gathered operand for (spec, transpose); KeyError if not carried."""
        for i, g in enumerate(self.operands):
            if g.spec == spec and g.transpose == transpose:
                return i
        raise KeyError(f"the quantized all-gather of recipe {self.recipe_name} carries no {spec}")


def _refuse(recipe: QuantRecipe, why: str) -> ValueError:
    return ValueError(f"quantized all-gather cannot run recipe {recipe.name!r}: {why}")


def plan_for(recipe: object) -> GatherPlan:
    """The operands `recipe`'s weight all-gather sends; ValueError (one line) where the
    quantized all-gather cannot reproduce the recipe exactly.

    Refused: OCC (its fprop compensation GEMM multiplies by the weight quantized once more, to
    E4M3 or fp32, which the gathered operand does not carry), operand specs without the fast
    quantizer (micro-block scale formats, stochastic rounding), power-of-two scales, and DGE on
    block-scaled weights.
    """
    if not isinstance(recipe, QuantRecipe):
        raise ValueError(f"quantized all-gather needs a quantized recipe, not {recipe!r}")
    if recipe.occ is not None:
        raise _refuse(
            recipe,
            "OCC's compensation GEMM needs the weight quantized a second time (E4M3 rows or "
            "fp32), which is not all-gathered; use fp4-dge or fp4-direct, or the plain all-gather",
        )
    operands = [GatheredSpec(recipe.fprop.rhs)]
    if not recipe.dgrad.rhs.reuse:
        operands.append(GatheredSpec(recipe.dgrad.rhs, transpose=True))
    for g in operands:
        s = g.spec
        if not op.supports(s.fmt, s.granularity, s.scale_format, s.rounding):
            raise _refuse(recipe, f"weight operand {s.words()} has no fast quantizer")
        if s.scale_format == "pow2":  # quantize_shard forms scales from global maxima
            raise _refuse(recipe, f"weight operand {s.words()}: {s.scale_format} scales")
    if recipe.dge is not None and operands[0].groups not in ("tensor", "row"):
        raise _refuse(recipe, "DGE is applied to the gradient shard only for tensor or row scales")
    return GatherPlan(recipe.name, tuple(operands), recipe.delayed, recipe.dge)


def check_layout(plan: GatherPlan, rows: int, cols: int, world: int) -> None:
    """ValueError (one line) unless a [rows, cols] weight sharded over `world` ranks along dim 0
    keeps every scale group of `plan` whole on one rank (or all-reducible, tensor/column)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world_size must be a positive int, got {world!r}")
    if rows % world:
        raise ValueError(
            f"quantized all-gather needs out_features divisible by the {world} ranks (got "
            f"{rows}): FSDP2 pads uneven shards, and the padded rows would change the scales"
        )
    for g in plan.operands:
        if isinstance(g.groups, tuple) and (rows // world) % g.groups[0]:
            raise ValueError(
                f"quantized all-gather of {g.spec.words()} needs {rows // world} rows per rank "
                f"to be a multiple of the {g.groups[0]}-row blocks (weight [{rows}, {cols}], "
                f"{world} ranks): a block would be split across ranks"
            )


def global_amax(amax: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The elementwise max of every rank's `amax` (one MAX all-reduce), NaN if any rank's is NaN
    and else +inf if any is: what `amax()` of the whole weight gives, whatever the order."""
    finite = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    flags = torch.stack([finite, torch.isnan(amax).float(), torch.isinf(amax).float()])
    if group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    nan, inf = torch.full_like(amax, float("nan")), torch.full_like(amax, float("inf"))
    return torch.where(flags[1] > 0, nan, torch.where(flags[2] > 0, inf, flags[0]))


def _with_scale(w: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Grid values of w / scale (scale broadcast against w), as `quantize_operand` rounds."""
    return op.round_to_storage(div_rn(w.float(), scale), fmt)


def _with_amax(
    w: torch.Tensor, amax: torch.Tensor, fmt: str, scale_format: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grid values, scales, "inv" multipliers or None) of w for given group maxima (the
    global [1, 1] or [1, K] amax, broadcast against w), as `quantize_operand` forms them from
    its own maxima."""
    fmt_max = get_format(fmt).max
    if scale_format == "inv":
        q, m, scale = op.times_multiplier(w.float(), amax, fmt_max)
        # amax is the whole weight's (all-reduced), at least this shard's maximum: no clamp
        return op.round_to_storage(q, fmt, saturate=False), scale, m
    scale = op.scale_from_amax(amax, fmt_max)
    return _with_scale(w, scale, fmt), scale, None


def _column_amax(w: torch.Tensor) -> torch.Tensor:
    return op.abs_amax(w.detach(), dim=0, keepdim=True)


def _reduces_amax(plan: GatherPlan, index: int) -> bool:
    """Whether operand `index` of `plan` takes its scale from an all-reduced amax: tensor and
    column scales, except fp8-delayed's fprop operand (its scale comes from the history)."""
    if index == 0 and plan.delayed is not None:
        return False
    return plan.operands[index].groups in ("tensor", "column")


def shard_amaxes(backend: Backend, plan: GatherPlan, w: torch.Tensor) -> list[torch.Tensor]:
    """This rank's amaxes of the shard `w` that `plan`'s all-gather takes the global maximum
    of, in a fixed order: fp8-delayed's weight amax (0-d) first, then the [1, 1] (tensor) or
    [1, K] (column) amax of each operand with such scales. Empty for row and block scales."""
    w = w.detach()
    amaxes = [delayed.amax(w)] if plan.delayed is not None else []
    for i, g in enumerate(plan.operands):
        if _reduces_amax(plan, i):
            if g.groups == "tensor":
                amaxes.append(op.abs_amax(w).reshape(1, 1))
            else:
                amaxes.append(backend.kernel(_column_amax, w)(w))
    return amaxes


def split_amaxes(
    plan: GatherPlan, amaxes: list[torch.Tensor]
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """`shard_amaxes`' order undone: (fp8-delayed's weight amax or None, each operand's amax
    or None), for the global amaxes `global_amaxes` returns."""
    it = iter(amaxes)
    weight = next(it) if plan.delayed is not None else None
    per_operand = [next(it) if _reduces_amax(plan, i) else None for i in range(len(plan.operands))]
    return weight, per_operand


def global_amaxes(
    amaxes: list[torch.Tensor], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """`global_amax` of each of `amaxes` (any shapes) with one all-reduce for all of them:
    flattened and concatenated, reduced, split back. Elementwise, so the same values as one
    all-reduce each. Collective unless `amaxes` is empty (then nothing is sent)."""
    if not amaxes:
        return []
    flat = global_amax(torch.cat([a.reshape(-1) for a in amaxes]), group)
    parts = flat.split([a.numel() for a in amaxes])
    return [p.reshape(a.shape) for p, a in zip(parts, amaxes, strict=True)]


def quantize_shard(
    backend: Backend,
    w: torch.Tensor,
    g: GatheredSpec,
    *,
    amax: torch.Tensor | None = None,
    delayed_scale: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Quantize this rank's rows `w` [rows, K] for the all-gather.

    Returns (payload, replicated scale, scale in the weight's layout, "inv" multipliers in that
    layout or None: what DGE scales w by, `QOperand.multiplier`): payload is the values
    as uint8 ([rows, K], or [rows, ceil(K/2)] packed E2M1) plus the [rows, 1] or block scales
    where they travel; the replicated scale (tensor [1, 1] or column [1, K], the same on every
    rank) is None where scales travel. Tensor and column scales come from `amax`, the global
    amax (`shard_amaxes` reduced by `global_amaxes`), or from `delayed_scale` (fp8-delayed).
    """
    fmt, groups, scale_format = g.spec.fmt, g.groups, g.spec.scale_format
    quantize = backend.kernel(op.quantize_operand, w)
    w = w.detach()
    replicated = m = None
    if groups in ("tensor", "column") and delayed_scale is None and amax is None:
        raise ValueError(f"{groups} scales of {g.spec.words()} need the global amax")
    if groups == "tensor" and delayed_scale is not None:
        values, scale = quantize(w, fmt, "tensor", scale=delayed_scale)
        replicated = scale
    elif groups in ("tensor", "column"):
        values, scale, m = backend.kernel(_with_amax, w)(w, amax, fmt, scale_format)
        replicated = scale
    else:
        values, scale, m = quantize(w, fmt, groups, scale_format=scale_format, with_multiplier=True)
    if fmt == "e2m1":
        payload = [backend.kernel(op.pack_e2m1, values)(values)]
    else:
        payload = [values.view(torch.uint8)]
    if replicated is None:
        payload.append(scale)
    return payload, replicated, scale, m


def quantize_weight(
    backend: Backend,
    plan: GatherPlan,
    w: torch.Tensor,
    amaxes: list[torch.Tensor],
    history: torch.Tensor | None,
) -> tuple[
    list[torch.Tensor], list[torch.Tensor | None], torch.Tensor | None, torch.Tensor,
    torch.Tensor | None,
]:  # fmt: skip
    """Every operand `plan` sends of the shard `w`, quantized: (tensors to all-gather, each
    operand's replicated scale or None, fp8-delayed's global weight amax or None, the fprop
    operand's scale and its "inv" multipliers or None, both in the weight's layout: DGE needs
    them). `amaxes`: `shard_amaxes` reduced by `global_amaxes`; `history`: the layer's amax
    history (fp8-delayed, else None). Plain PyTorch (no collectives), so that
    `quantize_weights` can compile many at once."""
    amax, operand_amaxes = split_amaxes(plan, amaxes)
    delayed_scale = None
    if plan.delayed is not None:
        delayed_scale = delayed_weight_scale(history, amax, plan.operands[0].spec.fmt, plan.delayed)
    tensors: list[torch.Tensor] = []
    replicated: list[torch.Tensor | None] = []
    fprop_scale = fprop_multiplier = None
    for i, g in enumerate(plan.operands):
        payload, rep, scale, m = quantize_shard(
            backend, w, g, amax=operand_amaxes[i], delayed_scale=delayed_scale if i == 0 else None
        )
        tensors += payload
        replicated.append(rep)
        if i == 0:
            fprop_scale, fprop_multiplier = scale, m
    return tensors, replicated, amax, fprop_scale, fprop_multiplier


def shard_amaxes_many(
    backend: Backend, plans: list[GatherPlan], ws: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """`shard_amaxes` of several shards (one compiled call for a block's weights on the GPU)."""
    return [shard_amaxes(backend, plan, w) for plan, w in zip(plans, ws, strict=True)]


def quantize_weights(
    backend: Backend,
    plans: list[GatherPlan],
    ws: list[torch.Tensor],
    amaxes: list[list[torch.Tensor]],
    histories: list[torch.Tensor | None],
) -> list[tuple]:
    """`quantize_weight` of several shards. Compiled as one function (a block's weights), the
    quantizers are the same plain PyTorch as one by one, so the results are the same bits
    (elementwise maps and max reductions; tests/test_fsdp_quantized.py compares them)."""
    return [
        quantize_weight(backend, plan, w, a, h)
        for plan, w, a, h in zip(plans, ws, amaxes, histories, strict=True)
    ]


def gathered_operand(
    backend: Backend,
    g: GatheredSpec,
    payload: tuple[torch.Tensor, ...],
    replicated: torch.Tensor | None,
    cols: int,
) -> QOperand:
    """The GEMM operand from the all-gathered payload: equal, values and scales, to
    `backend.quantize(full weight, g.spec, transpose=g.transpose)`."""
    fmt = g.spec.fmt
    data = payload[0]
    if fmt == "e2m1":
        values = backend.kernel(op.unpack_e2m1, data)(data, cols)
    else:
        values = data.view(op.FP8_STORAGE[fmt])
    scale = replicated if replicated is not None else payload[1]
    if g.transpose:
        values, scale = values.t(), scale.t().contiguous()
    return fp32_scaled(values, scale, fmt, g.spec.granularity, g.transpose)


# Where each packed tensor starts, in bytes: FP8 GEMM operands and fp32 scales need 16-byte
# aligned addresses (cuBLASLt), and a slice of a uint8 tensor viewed as fp32 needs a multiple of 4.
PACK_ALIGN = 16


def pack_payload(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple]:
    """`tensors` as one flat uint8 tensor, each starting on a `PACK_ALIGN` boundary, and the
    layout (byte offset, dtype, shape of each) that `unpack_payload` takes.

    For one rank: FSDP2's world-size-1 shortcut copies only an extension's first all-gather
    input (torch 2.11-2.13, `_fsdp_param_group.py`), so a shard whose scales travel beside its
    values (row and block scales, two operands) is sent as one tensor there."""
    parts: list[torch.Tensor] = []
    layout = []
    offset = 0
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % PACK_ALIGN
        parts += [raw, raw.new_zeros(pad)] if pad else [raw]
        layout.append((offset, t.dtype, tuple(t.shape)))
        offset += raw.numel() + pad
    return torch.cat(parts), tuple(layout)


def unpack_payload(flat: torch.Tensor, layout: tuple) -> tuple[torch.Tensor, ...]:
    """The tensors `pack_payload` packed, as views of `flat` (no copies)."""
    out = []
    for offset, dtype, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        out.append(flat[offset : offset + size].view(dtype).view(shape))
    return tuple(out)


def payload_bytes(plan: GatherPlan, rows: int, cols: int) -> int:
    """Bytes one rank's all-gather input holds for a [rows, cols] shard (values + travelling
    scales; the 4-byte-per-scale all-reduces of tensor and column scales are not counted)."""
    total = 0
    for g in plan.operands:
        total += rows * ((cols + 1) // 2 if g.spec.fmt == "e2m1" else cols)
        if isinstance(g.groups, tuple):
            br, bc = g.groups
            total += 4 * (rows // br) * -(-cols // bc)
        elif g.groups == "row":
            total += 4 * rows
    return total


def delayed_weight_scale(
    history: torch.Tensor, amax: torch.Tensor, fmt: str, cfg: DelayedScaling
) -> torch.Tensor:
    """The fp8-delayed weight scale the forward computes from `history` and the weight's amax."""
    return delayed.history_scale(history, delayed.WEIGHT, amax, fmt, cfg)
