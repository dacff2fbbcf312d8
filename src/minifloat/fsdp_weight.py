"""Tensor subclasses that make FSDP2 all-gather `QuantLinear` weights already quantized.

FSDP2 calls two methods of a sharded parameter's local tensor when it has them (the extension
torchao's float8 training uses):

    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
        -> (tensors to all-gather, metadata)
    fsdp_post_all_gather(gathered tensors, metadata, param_dtype, *, out=None)
        -> (unsharded tensor, tensors whose storage FSDP frees after use)

`ShardedWeight` wraps the fp32 shard (the master weight the optimizer updates): every op on it
runs on the plain shard, and FSDP's own ops (padding, views, copies, `to_empty`) keep the
wrapper. Its pre-all-gather quantizes the shard per `fsdp_plan` (values 1 or 0.5 byte a
parameter, plus scales); its post-all-gather returns a `GatheredWeight`: an [N, K] tensor
without data of its own that holds the gathered payload, from which `QuantLinearFunction` takes
its weight operands (`GatheredWeight.operand`) instead of quantizing. Gradients are plain [N, K]
tensors that FSDP2 reduce-scatters onto the fp32 shard, as for any parameter.

On one rank FSDP2 copies only an extension's first all-gather input, so a shard of several
tensors (travelling scales, fp8-rowwise's two operands) is sent packed into one
(`fsdp_plan.pack_payload`) and unpacked where `QuantLinearFunction` takes its operands.

A shard is quantized once per step, not once per all-gather (`QuantizedShard`): the backward's
re-gather (reshard_after_forward) sends the bytes of the forward's all-gather, and
`fsdp_quantized.precompute_quantized_weights` quantizes every shard after the optimizer step, a
block of weights per compiled call, so that the all-gathers only send. A kept shard serves one
forward: the next forward's all-gather quantizes anew unless a precompute made a fresh one in
between. That rule, not write detection, keeps stale bytes out: compiled code (a compiled
optimizer update, fp8-delayed's history record in a compiled backward) writes tensors without
moving their version counters. The key (`_quantized_key`: plan, backend, version counters,
writes counted in `__torch_dispatch__`) guards the rest, e.g. a checkpoint load between the
precompute and the forward. Quantizing in the all-gather all-reduces the global amax that tensor
and column scales need (one all-reduce per weight). The kept bytes cost 1 byte a parameter of
the shard (0.5 for E2M1; two operands for fp8-rowwise) beside the 4 of its fp32 values.

DGE (fp4, fp4-dge) multiplies the weight gradient by f'(w / s_w), which needs the
high-precision weight. The gathered weight does not carry it, so the factor is applied where
the weight is: to the gradient shard after the reduce-scatter (`sharded_dge_hook`, a post-
accumulate-grad hook, which FSDP2 calls on the sharded parameter), with the fp32 shard and the
scales this rank computed for it. The factor is elementwise, so sum-then-multiply equals
multiply-then-sum up to fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from minifloat import fsdp_plan
from minifloat.dge import dge_scale
from minifloat.kernels import Backend, QOperand, get_backend
from minifloat.recipes import OperandSpec

__all__ = ["ShardedWeight", "GatheredWeight", "GatherMeta", "QuantizedShard", "sharded_dge_hook",
           "gathered_operand", "gathered_amax"]  # fmt: skip

_aten = torch.ops.aten
# Ops whose results stay a ShardedWeight: FSDP2's padding, views and copies of the shard and
# `to_empty`. Everything else (arithmetic, zeros_like for optimizer states) gives plain tensors.
_KEEPS_WRAPPER = {
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.clone.default,
    _aten.detach.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.view.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
}
# Those of them whose result shares the shard's values (DTensor.to_local() is an alias).
_VIEWS = {
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.detach.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.view.default,
}


class _WriteCount:
    """In-place writes to one shard's values through any of its wrappers (views share it)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


@dataclass
class GatherMeta:
    """What travels beside the gathered tensors (metadata): the plan, the replicated scales
    (tensor / column, one per operand, None where scales are gathered), the weight's global
    amax (fp8-delayed records it), the number of input features, and the compute backend."""

    plan: fsdp_plan.GatherPlan
    replicated: list[torch.Tensor | None]
    amax: torch.Tensor | None
    cols: int
    backend: str
    layout: tuple | None = None  # one rank: the tensors packed into one (fsdp_plan.pack_payload)


@dataclass(frozen=True)
class QuantizedShard:
    """A shard quantized for the all-gather (`fsdp_plan.quantize_weight`'s results), kept with
    `key`: what must not have changed for it to be sent again (`_quantized_key`)."""

    key: tuple
    tensors: tuple[torch.Tensor, ...]
    replicated: list[torch.Tensor | None]
    amax: torch.Tensor | None
    fprop_scale: torch.Tensor
    fprop_multiplier: torch.Tensor | None  # "inv" scales' multipliers (DGE), else None
    fresh: bool  # made by a precompute and not yet sent by a forward
    # one rank: (one flat uint8 tensor, its layout) from fsdp_plan.pack_payload; `tensors` are
    # then views of it
    packed: tuple[torch.Tensor, tuple] | None = None


class ShardedWeight(torch.Tensor):
    """A QuantLinear weight's fp32 shard whose FSDP2 all-gather sends it quantized."""

    _hp: torch.Tensor

    @staticmethod
    def __new__(cls, hp: torch.Tensor) -> ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, hp.size(), strides=hp.stride(), storage_offset=hp.storage_offset(),
            dtype=hp.dtype, device=hp.device, layout=hp.layout, requires_grad=hp.requires_grad,
        )  # fmt: skip

    def __init__(self, hp: torch.Tensor) -> None:
        self._hp = hp
        self._dge_scale: torch.Tensor | None = None  # the fprop scale of this shard (DGE)
        self._dge_mult: torch.Tensor | None = None  # and its "inv" multipliers, if any
        self._dge_grad: weakref.ref | None = None  # the gradient DGE last scaled
        self._writes = _WriteCount()  # `_mark_written`; replaced by the base's for views
        self._quantized: QuantizedShard | None = None  # `store_quantized`

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        """Run `func` on the plain shard(s); keep the wrapper for FSDP's own ops, return the
        wrapper itself from in-place ops on it, plain tensors from everything else."""
        plain_args, plain_kwargs = pytree.tree_map_only(
            ShardedWeight, lambda t: t._hp, (args, kwargs or {})
        )
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable:
            _mark_written(func, args, kwargs or {})
        if func in _KEEPS_WRAPPER:
            wrapped = pytree.tree_map_only(torch.Tensor, ShardedWeight, out)
            if func in _VIEWS and isinstance(args[0], ShardedWeight):
                for t in pytree.tree_leaves(wrapped):  # views count writes with their base
                    t._writes = args[0]._writes
            return wrapped
        if func._schema.is_mutable and args and isinstance(args[0], ShardedWeight):
            return args[0]
        return out

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_hp"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride) -> ShardedWeight:  # noqa: ANN001
        return ShardedWeight(inner["_hp"])

    def __repr__(self) -> str:
        return f"ShardedWeight({self._hp!r})"

    def store_quantized(
        self, module: nn.Module, plan: fsdp_plan.GatherPlan, quantized: tuple, *, fresh: bool
    ) -> None:
        """Keep `quantized` (`fsdp_plan.quantize_weight`'s results for this shard; `module` the
        QuantLinear whose weight's local tensor this is) for the all-gathers of one forward and
        its backward; `fresh`: made ahead of that forward (the precompute)."""
        tensors, replicated, amax, fprop_scale, fprop_multiplier = quantized
        key = _quantized_key(module, self, plan)
        self._quantized = QuantizedShard(
            key, tuple(tensors), list(replicated), amax, fprop_scale, fprop_multiplier, fresh
        )

    def _kept(self, module: nn.Module, plan: fsdp_plan.GatherPlan) -> QuantizedShard | None:
        """The kept quantized shard if this all-gather may send it, else None: a backward's
        re-gather sends the forward's; a forward only a fresh one (precomputed), and only if
        nothing it depends on changed since (`_quantized_key`)."""
        kept = self._quantized
        in_backward = torch._C._current_graph_task_id() != -1
        usable = (
            kept is not None
            and (kept.fresh or in_backward)
            and getattr(module.weight, "_local_tensor", None) is self
            and kept.key == _quantized_key(module, self, plan)
        )
        if not usable:
            self._quantized = None
            return None
        if kept.fresh and not in_backward:  # this forward uses it up
            self._quantized = dataclasses.replace(kept, fresh=False)
        return kept

    def fsdp_pre_all_gather(
        self,
        mesh,  # noqa: ANN001 - the shard DeviceMesh
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy,  # noqa: ANN001 - quantized weights come from the fp32 shard whatever it says
    ) -> tuple[tuple[torch.Tensor, ...], GatherMeta]:
        """Quantize this shard per the module's recipe: the tensors to all-gather + metadata."""
        plan = fsdp_plan.plan_for(module.recipe)
        if mesh.ndim != 1 or len(outer_size) != 2 or self.shape[1] != outer_size[1]:
            raise ValueError(
                f"quantized all-gather needs a [N, K] weight sharded along dim 0 on a 1-D mesh; "
                f"got shard {tuple(self.shape)} of {tuple(outer_size)} on a {mesh.ndim}-D mesh"
            )
        world = mesh.size()
        fsdp_plan.check_layout(plan, outer_size[0], outer_size[1], world)
        kept = self._kept(module, plan)
        if kept is None:  # a forward without a precompute, or the weight changed: quantize
            group = mesh.get_group() if world > 1 else None
            backend = get_backend(module.backend, self.device)
            amaxes = fsdp_plan.shard_amaxes(backend, plan, self._hp)
            amaxes = fsdp_plan.global_amaxes(amaxes, group)  # one all-reduce, none if empty
            history = module.amax_history if plan.delayed is not None else None
            quantized = fsdp_plan.quantize_weight(backend, plan, self._hp, amaxes, history)
            self.store_quantized(module, plan, quantized, fresh=False)
            kept = self._quantized
        if plan.dge is not None:
            self._dge_scale, self._dge_mult = kept.fprop_scale, kept.fprop_multiplier
            _attach_dge_hook(module, self, plan, module.backend)
        tensors, layout = kept.tensors, None
        if world == 1 and len(tensors) > 1:  # FSDP2 would copy only the first (pack_payload)
            flat, layout = self._packed()
            tensors = (flat,)
        meta = GatherMeta(plan, list(kept.replicated), kept.amax, outer_size[1], module.backend,
                          layout)  # fmt: skip
        return tensors, meta

    def _packed(self) -> tuple[torch.Tensor, tuple]:
        """The kept shard's tensors packed into one, and the layout; packed once, after which
        the kept tensors are views of it (the bytes are held once)."""
        kept = self._quantized
        if kept.packed is None:
            flat, layout = fsdp_plan.pack_payload(kept.tensors)
            tensors = fsdp_plan.unpack_payload(flat, layout)
            kept = dataclasses.replace(kept, tensors=tensors, packed=(flat, layout))
            self._quantized = kept
        return kept.packed

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        meta: GatherMeta,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[GatheredWeight, tuple[torch.Tensor, ...]] | None:
        """The unsharded weight over the gathered tensors (which FSDP frees after use); with
        `out` (later steps: the same buffers were filled again) update its metadata only."""
        if out is not None:
            target = out
            if not isinstance(target, GatheredWeight):
                raise TypeError(f"expected a GatheredWeight to update, got {type(out).__name__}")
            target.set_meta(meta)
            return None
        # One rank: the one packed tensor, unpacked where the operands are taken (inside the
        # compiled graph). Unpacked here, its views were separate graph inputs sharing one
        # storage, and the 1.3B fp8-rowwise step's host time rose from 248 to 383 ms (session 16;
        # 292 ms this way; docs/distributed.md)
        rows = outputs[0].shape[0] if meta.layout is None else meta.layout[0][2][0]
        weight = GatheredWeight(tuple(outputs), meta, (rows, meta.cols), param_dtype)
        return weight, tuple(outputs)


# What QuantLinearFunction asks of a GatheredWeight, as ops rather than Python attribute reads:
# under torch.compile, dynamo traced `weight.operand(...)` into reads of the payload tensors,
# which became the graph's inputs in place of the weight, so the compiled graph gave the weight
# no gradient (the quantized weights did not train; docs/distributed.md, session 14). Called as
# ops, the weight itself is the graph's input (GatheredWeight is a traceable subclass: dynamo
# and AOTAutograd see through it by __tensor_flatten__) and its __torch_dispatch__ answers them.
# Library-defined (a few us of host time per call; kernels/transpose.py says why).
_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define("gathered_operand(Tensor weight, bool transpose) -> (Tensor, Tensor)")
_LIB.define("gathered_amax(Tensor weight) -> Tensor")


def _needs_gathered(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise RuntimeError("minifloat::gathered_* take a GatheredWeight (FSDP2's quantized all-gather)")


for _name in ("gathered_operand", "gathered_amax"):
    _LIB.impl(_name, _needs_gathered, "CompositeExplicitAutograd")
    torch.library.register_fake(f"minifloat::{_name}", _needs_gathered, lib=_LIB)


def gathered_operand(weight: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scale) of the all-gathered weight operand: fprop's (`transpose=False`) or
    dgrad's wᵀ (`transpose=True`, for recipes whose dgrad quantizes the weight anew: values a
    transposed view, as `quantize_operand(..., transpose=True)` gives); equal to quantizing the
    full weight, bit for bit."""
    return torch.ops.minifloat.gathered_operand.default(weight, transpose)


def gathered_amax(weight: torch.Tensor) -> torch.Tensor:
    """The all-gathered weight's amax over all ranks (fp8-delayed records it)."""
    return torch.ops.minifloat.gathered_amax.default(weight)


class GatheredWeight(torch.Tensor):
    """The unsharded [N, K] weight as FSDP2 all-gathered it: quantized payload and scales, no
    high-precision values. `QuantLinearFunction` takes its operands through `gathered_operand`
    (and fp8-delayed its amax through `gathered_amax`); other ops on it raise (a plain layer
    cannot use a quantized weight). A traceable wrapper subclass: its inner tensors are the
    payload, the replicated scales and the amax; everything else (plan, columns, backend) is
    constant metadata that compiled graphs guard on."""

    _payload: tuple[torch.Tensor, ...]
    _meta: GatherMeta

    @staticmethod
    def __new__(cls, payload, meta, shape, dtype, requires_grad=False) -> GatheredWeight:  # noqa: ANN001
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=payload[0].device, requires_grad=requires_grad
        )

    def __init__(self, payload, meta, shape, dtype, requires_grad=False) -> None:  # noqa: ANN001
        self._payload = tuple(payload)
        self.set_meta(meta)

    def set_meta(self, meta: GatherMeta) -> None:
        """New metadata for the same payload buffers (FSDP2's later all-gathers refill them)."""
        self._meta = meta
        for i, t in enumerate(self._payload):
            setattr(self, f"_p{i}", t)
        for i, t in enumerate(meta.replicated):
            if t is not None:
                setattr(self, f"_r{i}", t)
        if meta.amax is not None:
            self._amax = meta.amax

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        meta = self._meta
        present = tuple(i for i, t in enumerate(meta.replicated) if t is not None)
        names = [f"_p{i}" for i in range(len(self._payload))] + [f"_r{i}" for i in present]
        names += ["_amax"] if meta.amax is not None else []
        ctx = (meta.plan, meta.cols, meta.backend, len(self._payload), len(meta.replicated),
               present, self.dtype, meta.layout)  # fmt: skip
        return names, ctx

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride) -> GatheredWeight:  # noqa: ANN001
        plan, cols, backend, n_payload, n_replicated, present, dtype, layout = ctx
        payload = tuple(inner[f"_p{i}"] for i in range(n_payload))
        replicated = [inner[f"_r{i}"] if i in present else None for i in range(n_replicated)]
        meta = GatherMeta(plan, replicated, inner.get("_amax"), cols, backend, layout)
        return GatheredWeight(payload, meta, outer_size, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        """The two gathered_* ops; aliases (FSDP's as_strided, nn.Parameter's detach) share the
        payload; *_like give plain tensors; anything else is an error."""
        this = args[0]
        if func is torch.ops.minifloat.gathered_operand.default:
            q = this.operand(get_backend(this._meta.backend, this.device), transpose=args[1])
            return q.data, q.scale
        if func is torch.ops.minifloat.gathered_amax.default:
            return this._meta.amax
        if func in (_aten.detach.default, _aten.alias.default, _aten.as_strided.default):
            if func is _aten.as_strided.default and tuple(args[1]) != tuple(this.shape):
                raise RuntimeError("a GatheredWeight can only be viewed whole")
            return GatheredWeight(this._payload, this._meta, this.shape, this.dtype)
        if func in (_aten.zeros_like.default, _aten.empty_like.default):
            kwargs = dict(kwargs or {})
            return func(torch.empty(this.shape, dtype=this.dtype, device=this.device), **kwargs)
        raise RuntimeError(
            f"{func} on a quantized all-gathered weight (recipe {this._meta.plan.recipe_name}): "
            "only QuantLinear's GEMMs can use it"
        )

    def __repr__(self) -> str:
        return f"GatheredWeight(shape={tuple(self.shape)}, recipe={self._meta.plan.recipe_name})"

    def operand(
        self, backend: Backend, spec: OperandSpec | None = None, *, transpose: bool = False
    ) -> QOperand:
        """The weight quantized per `spec` (of wᵀ if `transpose`; None: the plan's operand for
        that direction), as the all-gather brought it: equal to `backend.quantize(full weight,
        spec, transpose=transpose)` bit for bit. Eager code; compiled code calls
        `gathered_operand`."""
        meta = self._meta
        if spec is None:
            spec = next(g.spec for g in meta.plan.operands if g.transpose == transpose)
        index = meta.plan.find(spec, transpose)
        start = sum(1 + g.gathers_scale for g in meta.plan.operands[:index])
        g = meta.plan.operands[index]
        payload = self._payload
        if meta.layout is not None:  # one rank: one packed tensor
            payload = fsdp_plan.unpack_payload(payload[0], meta.layout)
        payload = payload[start : start + 1 + g.gathers_scale]
        return fsdp_plan.gathered_operand(backend, g, payload, meta.replicated[index], meta.cols)


def _mark_written(func, args: tuple, kwargs: dict) -> None:  # noqa: ANN001
    """Count a write on every ShardedWeight that the in-place op `func` writes (foreach lists
    and out= arguments included).

    The op ran on the plain values below autograd's in-place tracking, so no version counter
    sees it reliably: the wrapper's own moves for plain in-place ops but not for foreach ops
    (minifloat's AdamW), and not for other wrappers of the same values (`to_local()` returns
    an alias), whose plain values do not share a counter either."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in pytree.tree_leaves(value):
            if isinstance(t, ShardedWeight):
                t._writes.n += 1


def _quantized_key(module: nn.Module, shard: ShardedWeight, plan: fsdp_plan.GatherPlan) -> tuple:
    """What must not change between quantizing a shard and sending it again: the plan and the
    backend; the sharded parameter's version counter, the writes through the shard or its views
    (`_mark_written`) and the version counter of the plain values (direct writes to them);
    fp8-delayed's amax history (its weight scale comes from it; backward records into it)."""
    key = (plan, module.backend, module.weight._version, shard._writes.n, shard._hp._version)
    if plan.delayed is not None:
        history = module.amax_history
        key += (id(history), history._version)
    return key


def _attach_dge_hook(
    module: nn.Module, shard: ShardedWeight, plan: fsdp_plan.GatherPlan, backend: str
) -> None:
    """Register `sharded_dge_hook` once on the sharded parameter whose local tensor is `shard`
    (FSDP2 calls post-accumulate-grad hooks on it after each reduce-scatter)."""
    param = module.weight
    if getattr(param, "_local_tensor", None) is not shard or getattr(param, "_dge_hooked", False):
        return
    param.register_post_accumulate_grad_hook(
        lambda p: sharded_dge_hook(p, plan.dge, plan.operands[0].spec.fmt, backend)
    )
    param._dge_hooked = True


def sharded_dge_hook(param: torch.Tensor, cfg, fmt: str, backend: str) -> None:  # noqa: ANN001
    """grad_shard *= f'(w_shard / s_w) in place, on the reduce-scattered gradient shard.

    Refuses a gradient accumulated onto one it already scaled (reduce-scatters on every
    micro-batch): the earlier part would be scaled twice. Use FSDP's
    `set_requires_gradient_sync(False)` on all but the last micro-batch (the trainer does), and
    `zero_grad(set_to_none=True)` (the default).
    """
    shard = param._local_tensor
    grad = param.grad._local_tensor
    if shard._dge_grad is not None and shard._dge_grad() is grad:
        raise RuntimeError(
            "DGE with quantized all-gather needs one reduce-scatter per optimizer step: use "
            "set_requires_gradient_sync(False) on all but the last micro-batch and "
            "zero_grad(set_to_none=True)"
        )
    kernels = get_backend(backend, grad.device)
    scaled = kernels.kernel(dge_scale, grad)(
        grad, shard._hp, shard._dge_scale, fmt=fmt, cfg=cfg, w_mult=shard._dge_mult
    )
    grad.copy_(scaled)
    shard._dge_grad = weakref.ref(grad)
