"""QuantLinear: a drop-in `nn.Linear` whose three GEMMs run quantized per a `QuantRecipe`.

Everything numeric happens in one autograd Function, `QuantLinearFunction`, through a compute
backend (kernels/): the exact emulation on any device, FP8 tensor cores on sm_89+ GPUs. Both give
the same quantized operands bit for bit; see kernels/backend.py.

Precision choices:
- Operands are quantized from the tensors as they arrive: the input in its own dtype (bf16 under
  autocast, or fp32), the weight from the parameter itself (the fp32 master), never from an
  autocast copy, which would only add a rounding before the quantizer's.
- The output dtype is the autocast dtype when autocast is active on the input's device, else the
  input's dtype. dx has the input's dtype, dw the weight's, db the bias's. Under bf16 autocast
  the dgrad GEMM writes dx in bf16 and casts it to the input's dtype: an fp32 input (an
  fp32 norm's output) gets a bf16-precise dx, as it does through `nn.Linear` under autocast,
  and the GEMM writes half the bytes (a 1.3B profile showed the norms' backward reading fp32
  dq, dk, dv, dgate and dup).
- Activations saved for backward stay quantized (the wgrad operand, transposed) plus their row
  scales; the high-precision input is never saved. Eagerly, E2M1 operands are saved packed, two
  values a byte; under torch.compile row-scaled ones are left unpacked, and the partitioner
  recomputes them in backward instead of saving them (see `_stash`). With OCC's E4M3
  compensation the saved input is z = x_q + Δx·m_x in E4M3 (one byte an entry; occ_gemm.py),
  also recomputed in backward under torch.compile (partition_hints.py).
"""

from __future__ import annotations

import torch
from torch import nn

from minifloat import counter_rng, delayed, occ, occ_gemm, partition_hints, recipes, recompute
from minifloat.exact import to_dtype, written_once
from minifloat.fsdp_weight import GatheredWeight, gathered_amax, gathered_operand
from minifloat.kernels import BACKEND_NAMES, Backend, QOperand, get_backend
from minifloat.kernels.backend import fp32_scaled
from minifloat.kernels.operand import pack_e2m1
from minifloat.kernels.transpose import unpack_e2m1_t
from minifloat.recipes import QuantRecipe, Recipe

__all__ = ["QuantLinear", "QuantLinearFunction", "QuantizedGemmMixin"]


def _delayed_scales(
    recipe: QuantRecipe, x: torch.Tensor, weight: torch.Tensor, amax_history: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8-delayed's (s_x, s_w) from the amax history, and this step's (x_amax, w_amax), which
    backward records."""
    gathered = isinstance(weight, GatheredWeight)
    w_amax = gathered_amax(weight) if gathered else delayed.amax(weight)
    # Kept apart, stacked in backward: a `torch.stack` here (unfusible) between x's amax and its
    # cast made the partitioner save every FP8 input instead of recomputing it (+6.5 GiB at
    # 1.3B; docs/hopper_sessions.md, session 13).
    x_amax = delayed.amax(x)
    s_x, s_w = (
        delayed.history_scale(amax_history, row, amax, spec.fmt, recipe.delayed)
        for row, amax, spec in ((delayed.INPUT, x_amax, recipe.fprop.lhs),
                                (delayed.WEIGHT, w_amax, recipe.fprop.rhs))
    )  # fmt: skip
    return s_x, s_w, x_amax, w_amax


class QuantLinearFunction(torch.autograd.Function):
    """y = x·wᵀ + b with quantized fprop, dgrad and wgrad GEMMs, per a `QuantRecipe`.

    Shapes: x [M, K] (tokens x in_features), w [N, K], b [N] or None, y and dy [M, N].
    Every GEMM is `a @ bᵀ` computed by `backend.scaled_mm` as (acc * b_scaleᵀ) * a_scale.

        fprop: y  = Q(x_c)·Q(w)ᵀ            [M,K]x[K,N]  (+ Q8(Δx)·Q8(w)ᵀ with OCC; each
                                                          product bf16 under bf16 autocast)
        dgrad: dx = Q(dy·diag(s_w))·w_q      [M,N]x[N,K]  (fold: row scale s_w of w moved into dy)
        wgrad: dw = Q((diag(s_x)·dy)ᵀ)·x_q   [N,M]x[M,K]  (fold: row scale s_x of x moved into dy)
                    (OCC: x_q -> z = x_q + Δx·m_x in E4M3; then dw *= f'(w·m_w) with DGE,
                     m_w the "inv" multipliers w_q was rounded with (s_w = 1/m_w rounded),
                     else f'(w / s_w))

    Without the fold (tensor or block scales, or re-quantized operands) the backward GEMMs are
    the plain dx = Q(dy)·Q(w) and dw = Q(dy)ᵀ·Q(x), with each operand quantized along that GEMM's
    contraction dim as its `OperandSpec` says. x_c = clamp(x, q_{1-α}, q_α) under OCC, else x;
    Δx = x - x_c. Q8: E4M3 per row. Where wgrad cannot fold Δx into its input (or with the fp32
    reference compensation) it adds dyᵀ·Δx through its own GEMM (occ_gemm.py). dgrad passes
    straight through the clamp (the clamp plus compensation is the identity).
    Micro-block recipes (nvfp4, mxfp4) may round dy stochastically and rotate both wgrad
    operands along M: dw = Q(dyᵀ·R)·Q(xᵀ·R)ᵀ, R an orthogonal random Hadamard transform
    (minifloat/hadamard.py); the draws come from `rng_state` (counter_rng.py): seeds of the
    forward's step, saved for backward, which counts the step (`counter_rng.advance`).
    `grad_enabled=False` (the module passes its grad mode: no_grad, inference_mode) prepares no
    backward operands; otherwise those of the gradients autograd will ask for.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, recipe, backend, out_dtype, amax_history, rng_state=None,
        grad_enabled=True,
    ):  # fmt: skip
        recipe: QuantRecipe
        backend: Backend
        # needs_input_grad follows requires_grad alone, also under no_grad; `grad_enabled` (the
        # caller's grad mode) keeps evaluation from preparing backward operands nothing will use
        need_dx, need_dw = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        comp = occ_gemm.compensation(recipe)
        x_dtype = x.dtype  # x may become a float32 copy below
        with torch.autocast(x.device.type, enabled=False):
            clip = None
            if recipe.occ is not None:  # quantizers read a copy made before the sort
                x, x_sampled = partition_hints.own_float32(x), x
                clip = occ.thresholds(x_sampled, recipe.occ)
            s_x = s_w = x_amax = w_amax = None
            if recipe.delayed is not None:  # scales from past steps; backward records this one
                s_x, s_w, x_amax, w_amax = _delayed_scales(recipe, x, weight, amax_history)
            seeds = None  # this step's draws, different on every data-parallel rank
            if rng_state is not None:
                seeds = counter_rng.layer_seeds(rng_state, counter_rng.process_rank())
            reuse_x = need_dw and recipe.wgrad.rhs.reuse
            reuse_w = need_dx and recipe.dgrad.rhs.reuse
            x_q = backend.quantize(x, recipe.fprop.lhs, clip=clip, scale=s_x)
            x_rhs = delta_rhs = None
            # OCC's z reads x before any GEMM does, so that it may be recomputed in backward
            # rather than saved (partition_hints.py)
            if reuse_x and occ_gemm.folds_remainder(recipe):
                x_rhs = occ_gemm.folded_wgrad_operand(
                    backend, x, clip, x_q, unit_scale=recipe.folds("wgrad"),
                    recompute_values=occ_gemm.recomputes_x_values(recipe),
                )  # fmt: skip
            w_q, w_rhs = _weight_operands(backend, recipe, weight, need_dx, s_w)
            y = _fprop(
                backend, recipe, comp, x_q, w_q, bias, out_dtype, occ_input=(x, clip, weight)
            )

            # Backward operands, prepared only for the gradients autograd will ask for.
            if reuse_x and x_rhs is None:  # (OCC's folded z is made above)
                x_rhs = backend.transpose(x_q, unit_scale=recipe.folds("wgrad"))
            elif need_dw and not reuse_x:
                x_rhs = backend.quantize(
                    x, recipe.wgrad.rhs, clip=clip, transpose=True, scale=s_x,
                    seed=_seed(seeds, "wgrad"),
                )  # fmt: skip
            if need_dw and comp is not None and not occ_gemm.folds_remainder(recipe):
                delta_rhs = occ_gemm.remainder_wgrad_operand(backend, comp, x, clip)
            if reuse_w and w_rhs is None:
                w_rhs = backend.transpose(w_q, unit_scale=recipe.folds("dgrad"))

        ctx.recipe, ctx.backend, ctx.amax_history = recipe, backend, amax_history
        ctx.rng_state = rng_state
        # dx in bf16 under bf16 autocast (module docstring); an fp16 rounding has no exact
        # compiled form here (exact.to_dtype), so fp16 autocast keeps dx in x's dtype
        ctx.x_dtype = x_dtype
        ctx.dx_dtype = out_dtype if out_dtype == torch.bfloat16 else x_dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        x_rhs_data, ctx.x_rhs_meta = _stash(backend, x_rhs)
        w_rhs_data, ctx.w_rhs_meta = _stash(backend, w_rhs)
        delta_data, ctx.delta_meta = _stash(backend, delta_rhs)
        ctx.w_q_meta = (w_q.fmt, w_q.granularity)
        ctx.save_for_backward(
            weight,
            x_rhs_data,
            None if x_rhs is None else x_rhs.scale,
            x_q.scale if recipe.folds("wgrad") else None,
            w_q.scale,
            w_q.multiplier if recipe.dge is not None else None,
            w_rhs_data,
            None if w_rhs is None else w_rhs.scale,
            delta_data,
            None if delta_rhs is None else delta_rhs.scale,
            x_amax,
            w_amax,
            *_tensor_scales(x_rhs, w_rhs),
            seeds,
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        recipe: QuantRecipe = ctx.recipe
        backend: Backend = ctx.backend
        (
            weight,
            x_rhs_data,
            x_rhs_scale,
            x_scale,
            w_scale,
            w_mult,
            w_rhs_data,
            w_rhs_scale,
            delta_data,
            delta_scale,
            x_amax,
            w_amax,
            x_rhs_ts,
            w_rhs_ts,
            seeds,
        ) = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            s_g = None
            if recipe.delayed is not None:
                amaxes = torch.stack([x_amax, w_amax, delayed.amax(dy)])
                g_fmt = recipe.dgrad.lhs.fmt
                s_g = delayed.history_scale(
                    ctx.amax_history, delayed.GRAD_OUTPUT, amaxes[2], g_fmt, recipe.delayed
                )
                delayed.record(ctx.amax_history, amaxes)  # once per trained step
            if ctx.rng_state is not None:
                counter_rng.advance(ctx.rng_state)  # once per trained step, as the history
            g_q = None
            if need_dx:
                w_rhs = (
                    _unstash(w_rhs_data, w_rhs_scale, ctx.w_rhs_meta, w_rhs_ts)
                    if w_rhs_data is not None
                    else _weight_operand(backend, weight, recipe.dgrad.rhs, transpose=True)
                )
                prescale = w_scale.t() if recipe.folds("dgrad") else None
                g_q = backend.quantize(
                    dy, recipe.dgrad.lhs, prescale=prescale, scale=s_g, seed=_seed(seeds, "dgrad")
                )
                dx = backend.scaled_mm(
                    g_q, w_rhs, out_dtype=ctx.dx_dtype, fast_accum=recipe.dgrad_fast_accum
                ).to(ctx.x_dtype)
            if need_dw:
                x_rhs = _unstash(x_rhs_data, x_rhs_scale, ctx.x_rhs_meta, x_rhs_ts)
                dw = _wgrad(backend, recipe, dy, g_q, x_rhs, x_scale, s_g, _seed(seeds, "wgrad"))
                if delta_data is not None:  # OCC's correction, unless folded into x_rhs
                    delta_rhs = _unstash(delta_data, delta_scale, ctx.delta_meta)
                    comp = occ_gemm.compensation(recipe)
                    dw = dw + occ_gemm.wgrad_correction(backend, comp, dy, delta_rhs)
                # A quantized all-gather has no hp weight: DGE scales the reduce-scattered
                # gradient shard instead (fsdp_weight.sharded_dge_hook).
                if recipe.dge is not None and not isinstance(weight, GatheredWeight):
                    # (data unused by apply_dge)
                    w_q = fp32_scaled(weight, w_scale, *ctx.w_q_meta, False, w_mult)
                    dw = backend.apply_dge(dw, weight, w_q, recipe.dge)
                dw = dw.to(weight.dtype)
            if need_db and ctx.bias_dtype is not None:
                db = dy.float().sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _weight_operands(
    backend: Backend,
    recipe: QuantRecipe,
    weight: torch.Tensor,
    need_dx: bool,
    s_w: torch.Tensor | None,
) -> tuple[QOperand, QOperand | None]:
    """fprop's weight operand, and dgrad's where the backend makes it with fprop's (else None:
    made from fprop's below, or quantized in backward). Together for a plain weight with its own
    scales (not delayed ones, not FSDP2's quantized all-gather): fprop's values with their
    transpose where dgrad reuses them (Hopper: one or two kernels, kernels/weight_blocks.py,
    kernels/weight_tensor.py), or both quantized anew (Hopper: fp8-rowwise's, from two kernels,
    kernels/weight_rows.py; saved for dgrad, 1 byte a weight element)."""
    if need_dx and s_w is None and not isinstance(weight, GatheredWeight):
        if recipe.dgrad.rhs.reuse and not recipe.folds("dgrad"):
            return backend.quantize_with_transpose(weight, recipe.fprop.rhs)
        if not recipe.dgrad.rhs.reuse:
            pair = backend.quantize_weight_pair(weight, recipe.fprop.rhs, recipe.dgrad.rhs)
            if pair is not None:
                return pair
    return _weight_operand(backend, weight, recipe.fprop.rhs, scale=s_w), None


def _weight_operand(
    backend: Backend,
    weight: torch.Tensor,
    spec: recipes.OperandSpec,
    *,
    transpose: bool = False,
    scale: torch.Tensor | None = None,
) -> QOperand:
    """The weight quantized per `spec`: as FSDP2 all-gathered it already quantized
    (fsdp_weight.GatheredWeight, the same values and scales), else quantized here."""
    if isinstance(weight, GatheredWeight):  # an op, so that compiled graphs keep w's gradient
        values, w_scale = gathered_operand(weight, transpose)
        return fp32_scaled(values, w_scale, spec.fmt, spec.granularity, transpose)
    return backend.quantize(weight, spec, transpose=transpose, scale=scale)


def _stash(backend: Backend, q: QOperand | None) -> tuple[torch.Tensor | None, tuple | None]:
    """(data to save, metadata) of an operand kept for backward.

    Saved in its storage layout: a transposed operand (a transposed view of the input's layout,
    see kernels/operand.py) is saved untransposed and transposed when backward uses it, in the
    backward's own kernels. Eagerly, E2M1 values of transposed operands (every saved E2M1
    operand is one) are packed two a byte along the storage rows.

    Under torch.compile row- and tensor-scaled ones are not packed: the partitioner recomputes
    the operand in backward from tensors it saves anyway (tests/test_transpose.py checks that
    nothing quantized is saved), so packing there only added a pack and an unpack pass to the
    backward. Without them a 1.3B fp4-dge step took 253.5 ms against 262.3 ms, same memory
    (`benchmarks/results/train_e2e_1.3B_ours_nopack_h200_2026-11-24.md`).
    """
    if q is None:
        return None, None
    data, transposed = q.data, q.transposed
    if transposed:
        data = data.t()  # contiguous: the layout quantize wrote
    packed_cols = None
    packable = transposed and q.fmt == "e2m1" and data.dtype == torch.float8_e4m3fn
    # Micro-block operands (nvfp4, mxfp4) stay packed under compile too: unpacked, the
    # partitioner saves nvfp4's E4M3-byte operands rather than recomputing them, 43.8 -> 48.0
    # GiB at 1.3B for 4 % of its step (mxfp4: the same memory, 1 %; session 49,
    # `train_e2e_1.3B_ours_s49_stash_{head,new}_...`). Compiled equal to eager either way.
    if packable and (isinstance(q.granularity, tuple) or not torch.compiler.is_compiling()):
        data, packed_cols = backend.kernel(pack_e2m1, data)(data), data.shape[1]
    return data, (q.fmt, q.granularity, packed_cols, transposed, q.scale_format)


def _fprop(
    backend: Backend,
    recipe: QuantRecipe,
    comp: str | None,
    x_q: QOperand,
    w_q: QOperand,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    occ_input: tuple,
) -> torch.Tensor:
    """y = x_q w_qᵀ (+ bias) in `out_dtype`; under OCC's compensation `comp`, plus the
    remainder's product from `occ_input` = (x, clip, weight): one GEMM over both where
    `occ_gemm.joins_products`, else both partial products summed in float32."""
    fast_accum = recipe.fprop_fast_accum
    if comp is None:
        return backend.scaled_mm(x_q, w_q, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum)
    x, clip, weight = occ_input
    if occ_gemm.joins_products(recipe):  # "inv" operands: x_q's and w_q's multipliers given
        return occ_gemm.joint_fprop(
            backend, x, clip, x_q, weight, w_q,
            out_dtype=out_dtype, bias=bias, fast_accum=fast_accum,
        )  # fmt: skip
    part = occ_gemm.partial_dtype(comp, out_dtype)
    y = backend.scaled_mm(x_q, w_q, out_dtype=part, fast_accum=fast_accum)
    corr = occ_gemm.fprop_correction(backend, comp, x, clip, weight, fast_accum, out_dtype=part)
    # both upcasts beside the sum: an upcast made far before it would start a fusible chain too
    # long for the partitioner to recompute the down projection's z (partition_hints.py),
    # which it then saves
    y = y.float() + corr.float()
    return to_dtype(y + bias.float() if bias is not None else y, out_dtype)


def _unstash(
    data: torch.Tensor,
    scale: torch.Tensor,
    meta: tuple,
    tensor_scale: torch.Tensor | None = None,
) -> QOperand:
    """The operand `_stash` saved: a transposed view again where it was one, except packed E2M1
    operands (eagerly; micro-block ones also under compile), which come back unpacked straight
    into the transposed layout (contiguous)."""
    fmt, granularity, packed_cols, transposed, scale_format = meta
    if packed_cols is not None:  # transposed (`_stash` packs only those)
        # One opaque pass from the packed codes to the GEMM's layout (kernels/transpose.py).
        data = unpack_e2m1_t(data, packed_cols)
        return QOperand(data, scale, fmt, granularity, tensor_scale, scale_format, False, None)
    if transposed and torch.compiler.is_compiling():
        # Under torch.compile the transposed copy of a saved operand stays plain PyTorch: the
        # partitioner may then recompute the operand in backward from tensors it saves anyway
        # (inductor fuses the copy there). Through the backend's opaque transpose it saved the
        # operand itself instead: +5.4 GB at 1.3B under fp8-tensorwise (measured).
        if isinstance(granularity, tuple):
            # Block-scaled values are written untransposed first (`written_once`), so that
            # inductor transposes them in a kernel of its own. Fused into the SwiGLU backward,
            # the transposed byte store took fp8-blockwise's kernel there from 0.55 to 0.93 ms
            # a layer at 1.3B: 268.2 -> 262.0 ms a step, same memory. Row and tensor scales gain
            # nothing from it (docs/hopper_sessions.md, session 27).
            data = written_once(data)
        data = data.t().contiguous()
        return QOperand(data, scale, fmt, granularity, tensor_scale, scale_format, False, None)
    data = data.t() if transposed else data
    return QOperand(data, scale, fmt, granularity, tensor_scale, scale_format, transposed, None)


def _tensor_scales(*qs: QOperand | None) -> list[torch.Tensor | None]:
    """The micro-block tensor scales of saved operands (None where absent), saved beside them."""
    return [None if q is None else q.tensor_scale for q in qs]


def _seed(seeds: torch.Tensor | None, gemm: str) -> torch.Tensor | None:
    """The step's seed of `gemm` ("dgrad" / "wgrad") from `counter_rng.layer_seeds`."""
    return None if seeds is None else seeds[0 if gemm == "dgrad" else 1]


def _wgrad(
    backend: Backend,
    recipe: QuantRecipe,
    dy: torch.Tensor,
    g_q: QOperand | None,
    x_rhs: QOperand,
    x_scale: torch.Tensor | None,
    s_g: torch.Tensor | None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """dw [N, K] in fp32, before OCC and DGE corrections."""
    lhs = recipe.wgrad.lhs
    shareable = (
        g_q is not None
        and lhs == recipe.dgrad.lhs
        and lhs.granularity == "tensor"
        and not recipe.folds("dgrad")
        and not recipe.folds("wgrad")
    )
    if shareable:  # one tensor-scaled dy serves both backward GEMMs
        h_q = backend.transpose(g_q)
    else:
        prescale = x_scale if recipe.folds("wgrad") else None
        h_q = backend.quantize(dy, lhs, prescale=prescale, transpose=True, scale=s_g, seed=seed)
    return backend.scaled_mm(
        h_q, x_rhs, out_dtype=torch.float32, fast_accum=recipe.wgrad_fast_accum
    )


class QuantizedGemmMixin:
    """What QuantLinear and QuantConv1D share: the recipe, the backend choice, the fp8-delayed
    amax history, and the call of `QuantLinearFunction` on a [out, in] weight.

    The history is a persistent buffer `amax_history` [3, history_len] (rows: input, weight,
    grad_output), so checkpoints carry it and a resumed run continues bit for bit; a state_dict
    without it (an nn.Linear's) still loads and leaves it as it was.

    Recipes that draw random numbers (`recipe.randomized`: stochastic rounding, Hadamard signs)
    keep `rng_state`, int64 [2] = (salt, step), alike: a persistent buffer advanced once per
    trained backward; its seeds are `counter_rng.layer_seeds(rng_state, rank)`. `convert` gives
    each layer a salt from its name (`seed_rng`), so layers draw different numbers; the rank
    under torch.distributed is mixed in where the seeds are made (the buffer is the same on
    every rank), so data-parallel ranks draw different numbers too.

    `set_recipe` changes the recipe in place (e.g. a final training phase in bf16); after a switch
    to a recipe that quantizes nothing the layer computes as the plain layer does.
    """

    recipe: Recipe  # a QuantRecipe unless set_recipe chose an autocast-only one
    backend: str
    amax_history: torch.Tensor | None
    rng_state: torch.Tensor | None

    def _setup(self, recipe: str | QuantRecipe, backend: str, device) -> None:
        recipe = recipes.get(recipe)
        if not isinstance(recipe, QuantRecipe):
            raise ValueError(f"recipe {recipe.name!r} does not quantize linear layers")
        if backend not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKEND_NAMES)}")
        self.recipe = recipe
        self.backend = backend
        history = None
        if recipe.delayed is not None:
            history = torch.zeros(3, recipe.delayed.history_len, device=device)
        self.register_buffer("amax_history", history, persistent=True)
        self._rng_salt = 0
        rng = torch.zeros(2, dtype=torch.int64, device=device) if recipe.randomized else None
        self.register_buffer("rng_state", rng, persistent=True)

    def seed_rng(self, salt: int) -> None:
        """Start the random state at (salt, step 0); salt in [0, 2^31)."""
        if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < 2**31:
            raise ValueError(f"seed_rng takes an int salt in [0, 2^31), got {salt!r}")
        self._rng_salt = int(salt)
        if self.rng_state is not None:
            self.rng_state.copy_(torch.tensor([self._rng_salt, 0], dtype=torch.int64))

    def set_recipe(self, recipe: str | Recipe) -> None:
        """Change the recipe in place; parameters (the same objects) and their values stay.

        A recipe that quantizes nothing ("bf16", "fp32") makes the layer compute exactly as the
        plain layer (nn.Linear, Conv1D) does, in the precision of the autocast region around it.
        The fp8-delayed amax history is kept when the new recipe keeps one of the same length,
        started afresh (zeros) when it needs another, and dropped when it needs none, so the
        layer holds a history exactly when its recipe is delayed (as after `_setup`). The
        counter-based random state likewise: kept when the new recipe draws random numbers too,
        started at (salt, step 0) when only the new one does, dropped when it draws none.
        Raises ValueError (nothing changed) when the layer's dims do not suit the recipe.
        """
        recipe = recipes.get(recipe)
        delayed_cfg = recipe.delayed if isinstance(recipe, QuantRecipe) else None
        if isinstance(recipe, QuantRecipe):
            reason = recipe.unsuitable(self.in_features, self.out_features)
            if reason is not None:
                raise ValueError(reason)
        history = self.amax_history
        if delayed_cfg is None:
            history = None
        elif history is None or history.shape[1] != delayed_cfg.history_len:
            history = torch.zeros(3, delayed_cfg.history_len, device=self.weight.device)
        self.amax_history = history  # a registered buffer: Module.__setattr__ keeps it one
        randomized = isinstance(recipe, QuantRecipe) and recipe.randomized
        rng = self.rng_state if randomized else None
        if randomized and rng is None:
            rng = torch.tensor([self._rng_salt, 0], dtype=torch.int64, device=self.weight.device)
        self.rng_state = rng
        self.recipe = recipe

    def reset_buffers(self) -> None:
        """Zero the delayed-scaling amax history and restart the random state at step 0 (e.g.
        after `to_empty` materialized them)."""
        if self.amax_history is not None:
            self.amax_history.zero_()
        self.seed_rng(self._rng_salt)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, *rest):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, *rest)
        for key in ("amax_history", "rng_state"):  # a plain layer's state_dict: keep them
            if prefix + key in missing:
                missing.remove(prefix + key)

    def _check_input(self, x: torch.Tensor) -> None:
        """The one-line errors for inputs the plain layer would also refuse: no dims, an
        integer, bool or complex dtype (which the quantizers would otherwise truncate), or a
        last dim other than in_features."""
        k = self.in_features
        if x.dim() == 0:
            raise ValueError(f"expected an input with at least 1 dim (last {k}), got 0-D")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got {x.dtype}")
        if x.shape[-1] != k:
            raise ValueError(f"expected last dim {k}, got shape {tuple(x.shape)}")

    def _quantized_gemm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_out: int
    ) -> torch.Tensor:
        """y = x·weightᵀ + bias through QuantLinearFunction (weight [n_out, in]), x's batch dims.
        Compiled fp8-delayed layers on the Hopper path run it in recompute.py's checkpoint
        region (memory; `recompute.applies`)."""
        device_type = x.device.type
        if device_type == "meta":  # shapes only (FLOP counting, tracing): the plain layer's
            return nn.functional.linear(x, weight, bias)
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        if x.numel() == 0:  # no rows: the plain layer's empty result (a maximum needs an entry)
            bias = None if bias is None else bias.to(out_dtype)
            return nn.functional.linear(x.to(out_dtype), weight.to(out_dtype), bias)
        backend = get_backend(self.backend, x.device)
        args = (
            x.reshape(-1, x.shape[-1]), weight, bias, self.recipe, backend, out_dtype,
            self.amax_history, self.rng_state, torch.is_grad_enabled(),
        )  # fmt: skip
        if torch.compiler.is_compiling() and recompute.applies(self.recipe, weight, backend):
            y = recompute.checkpointed(QuantLinearFunction.apply, *args)
        else:
            y = QuantLinearFunction.apply(*args)
        return y.reshape(*x.shape[:-1], n_out)


class QuantLinear(QuantizedGemmMixin, nn.Linear):
    """`nn.Linear` with quantized GEMMs: same parameters and call signature.

    Args:
        in_features, out_features, bias, device, dtype: as for `nn.Linear`.
        recipe: a quantized recipe or its name (e.g. "fp4", "fp8-rowwise").
        backend: "auto" (by the input's device), "emulated" or "hopper" (forced, for tests).
    state_dict keys are those of `nn.Linear`, plus `amax_history` under fp8-delayed and
    `rng_state` under recipes that draw random numbers (see `QuantizedGemmMixin`).

    Unlike `convert` and `set_recipe`, the constructor does not apply the recipe's dims rule
    (`QuantRecipe.unsuitable`: multiples of the tensor cores' tile or of the recipe's block):
    the emulation computes any shape, padding the last blocks, which tests and experiments on
    small layers use. A layer much smaller than the recipe's block pays for whole blocks.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: str | QuantRecipe,
        backend: str = "auto",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(recipe, backend, device)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: str | QuantRecipe, *, backend: str = "auto"
    ) -> QuantLinear:
        """A QuantLinear sharing `linear`'s parameter objects (optimizers stay valid)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias  # None registers an absent bias, as nn.Linear does
        new._setup(recipe, backend, linear.weight.device)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if not self.recipe.quantized:  # set_recipe("bf16"): nn.Linear's own computation
            return nn.functional.linear(x, self.weight, self.bias)
        return self._quantized_gemm(x, self.weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}"
