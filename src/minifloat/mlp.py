"""QuantSwiGLU: a SwiGLU MLP, w_down(silu(w_gate·x) ⊙ w_up·x), as one autograd Function.

Converted layer by layer, the MLP is three QuantLinears, and its backward quantizes dg and du
(each once for dgrad and once, transposed, for wgrad) and recomputes h's operand in kernels
that inductor makes around the SiLU's backward. As one unit the backward makes all five from
one read of g, u and dh (`kernels/swiglu.py`'s op: two Triton kernels on the GPU). It keeps h,
dg and du in float32 between the bf16 GEMM outputs and the casts; the composite rounds some of
them to bf16 (eagerly all; compiled, where inductor stores them), so the two agree bit for bit
in fp32 and in y and dw_down on the GPU, and otherwise to the recipe's own noise
(tests/test_mlp.py). Compiled equals eager.

Recipes: tensor-scaled FP8 without OCC, DGE, delayed scaling or random rounding, whose
backward reuses fprop's x_q and w_q (fp8-tensorwise): `unit_reason` says why another cannot.
Under any other recipe, or when a projection was kept in high precision or `set_recipe`
changed, the unit computes as the original module did (the composite), so `fuse_swiglu` is
safe to call on any converted model.

Which modules are SwiGLU MLPs (`SWIGLU_LAYOUTS`): minifloat's Llama `FeedForward` and the
`transformers` LlamaMLP, MistralMLP and Qwen2MLP with a SiLU activation. The unit keeps their
children under the same names, so state_dict keys and parameters stay the same objects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minifloat.fsdp_weight import GatheredWeight
from minifloat.kernels import Backend, QOperand, get_backend
from minifloat.kernels.swiglu import FORMATS, swiglu_backward_tensorwise, swiglu_hp
from minifloat.linear import QuantLinear, _stash, _unstash, _weight_operand
from minifloat.recipes import QuantRecipe, Recipe

__all__ = ["QuantSwiGLU", "SwiGLUFunction", "SWIGLU_LAYOUTS", "fuse_swiglu", "unit_reason"]

# module class (module.qualname) -> (gate, up, down) child names
SWIGLU_LAYOUTS: dict[str, tuple[str, str, str]] = {
    "minifloat.models.llama.FeedForward": ("w1", "w3", "w2"),
    "transformers.models.llama.modeling_llama.LlamaMLP": ("gate_proj", "up_proj", "down_proj"),
    "transformers.models.mistral.modeling_mistral.MistralMLP": (
        "gate_proj",
        "up_proj",
        "down_proj",
    ),  # fmt: skip
    "transformers.models.qwen2.modeling_qwen2.Qwen2MLP": ("gate_proj", "up_proj", "down_proj"),
}
_SILU_CLASSES = ("SiLU", "SiLUActivation")


def unit_reason(recipe: Recipe) -> str | None:
    """Why the SwiGLU unit cannot run `recipe` (None: it can)."""
    if not isinstance(recipe, QuantRecipe):
        return f"recipe {recipe.name} quantizes no GEMM"
    if recipe.occ is not None or recipe.dge is not None or recipe.delayed is not None:
        return f"recipe {recipe.name} has OCC, DGE or delayed scaling"
    if recipe.randomized:
        return f"recipe {recipe.name} rounds stochastically or rotates"
    ops = (recipe.fprop.lhs, recipe.fprop.rhs, recipe.dgrad.lhs, recipe.wgrad.lhs)
    if any(op.granularity != "tensor" or op.fmt not in FORMATS for op in ops):
        return f"recipe {recipe.name} is not tensor-scaled FP8 throughout"
    reused = recipe.dgrad.rhs.reuse and recipe.wgrad.rhs.reuse
    if recipe.dgrad.lhs != recipe.wgrad.lhs or not reused:
        return f"recipe {recipe.name} quantizes dgrad and wgrad operands differently"
    return None


class SwiGLUFunction(torch.autograd.Function):
    """y = (silu(x·w_gateᵀ) ⊙ x·w_upᵀ)·w_downᵀ with tensor-scaled quantized GEMMs.

    Shapes: x [M, K]; w_gate, w_up [F, K]; w_down [N, F]; g, u, h, dh [M, F]; y, dy [M, N].
    Every GEMM is `backend.scaled_mm(a, b)` = a·bᵀ; Q is the recipe's quantizer for that operand.

        fprop: g = Q(x)·Q(w_gate)ᵀ, u = Q(x)·Q(w_up)ᵀ   [M,K]x[K,F]   (one Q(x) for both)
               h = silu(g)·u (float32);  y = Q(h)·Q(w_down)ᵀ   [M,F]x[F,N]
        dgrad: dh = Q(dy)·Q(w_down)   [M,N]x[N,F]
               dx = Q(dg)·Q(w_gate) + Q(du)·Q(w_up)   [M,F]x[F,K]
        wgrad: dw_down = Q(dy)ᵀ·Q(h)   [N,M]x[M,F];   dw_gate = Q(dg)ᵀ·Q(x), dw_up = Q(du)ᵀ·Q(x)
               [F,M]x[M,K]

    dg = silu'(g)·u·dh and du = silu(g)·dh, with Q(h) (under h's scale from forward), Q(dg),
    Q(du) and the transposes made by one op (kernels/swiglu.py). Q(x) and the weights' Q(w)
    are fprop's, reused (transposed) by the backward GEMMs, as QuantLinear does.
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, recipe, backend, out_dtype):
        recipe: QuantRecipe
        backend: Backend
        fast = recipe.fprop_fast_accum
        with torch.autocast(x.device.type, enabled=False):
            x_q = backend.quantize(x, recipe.fprop.lhs)
            w_q = [_weight_operand(backend, w, recipe.fprop.rhs) for w in (w_gate, w_up, w_down)]
            g = backend.scaled_mm(x_q, w_q[0], out_dtype=out_dtype, fast_accum=fast)
            u = backend.scaled_mm(x_q, w_q[1], out_dtype=out_dtype, fast_accum=fast)
            # h as the backward's op recomputes it: compiled on CUDA (kernels/swiglu.py)
            h_q = backend.quantize(backend.kernel(swiglu_hp, g)(g, u), recipe.fprop.lhs)
            y = backend.scaled_mm(h_q, w_q[2], out_dtype=out_dtype, fast_accum=fast)
            stashed = [_stash(backend, backend.transpose(q)) for q in (x_q, *w_q)]
        ctx.recipe, ctx.backend, ctx.out_dtype, ctx.x_dtype = recipe, backend, out_dtype, x.dtype
        ctx.w_dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
        ctx.metas = [meta for _, meta in stashed]
        ctx.save_for_backward(
            g, u, h_q.scale, x_q.scale, *(q.scale for q in w_q), *(data for data, _ in stashed)
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        recipe: QuantRecipe = ctx.recipe
        backend: Backend = ctx.backend
        g, u, s_h, s_x, *rest = ctx.saved_tensors
        scales = (s_x, *rest[:3])
        x_rhs, wg_rhs, wu_rhs, wd_rhs = (
            _unstash(data, s, meta)
            for data, s, meta in zip(rest[3:], scales, ctx.metas, strict=True)
        )
        need_dx, *need_dw = ctx.needs_input_grad[:4]
        # QuantLinear's dx dtype: bf16 under bf16 autocast, else the input's (linear.py)
        dx_dtype = ctx.out_dtype if ctx.out_dtype == torch.bfloat16 else ctx.x_dtype
        h_fmt, grad_fmt = recipe.fprop.lhs.fmt, recipe.dgrad.lhs.fmt
        dx = None
        with torch.autocast(dy.device.type, enabled=False):
            dy_q = backend.quantize(dy, recipe.dgrad.lhs)
            dh = backend.scaled_mm(dy_q, wd_rhs, out_dtype=ctx.out_dtype)
            h_t, dg_q, dg_t, du_q, du_t, s_g, s_u = swiglu_backward_tensorwise(
                g, u, dh, s_h, h_fmt, grad_fmt
            )
            if need_dx:  # the two projections' dx, each in its dtype, summed as autograd would
                dx_gate, dx_up = (
                    backend.scaled_mm(QOperand(q, s, grad_fmt, "tensor"), w, out_dtype=dx_dtype)
                    for q, s, w in ((dg_q, s_g, wg_rhs), (du_q, s_u, wu_rhs))
                )  # fmt: skip
                dx = dx_gate.to(ctx.x_dtype) + dx_up.to(ctx.x_dtype)
            wgrads = (
                (QOperand(dg_t, s_g, grad_fmt, "tensor"), x_rhs),
                (QOperand(du_t, s_u, grad_fmt, "tensor"), x_rhs),
                (backend.transpose(dy_q), QOperand(h_t, s_h, h_fmt, "tensor")),
            )
            dws = [
                backend.scaled_mm(lhs, rhs, out_dtype=torch.float32).to(dtype) if needed else None
                for (lhs, rhs), needed, dtype in zip(wgrads, need_dw, ctx.w_dtypes, strict=True)
            ]
        return dx, *dws, None, None, None


class QuantSwiGLU(nn.Module):
    """A SwiGLU MLP whose quantized projections run as one unit (`SwiGLUFunction`).

    Holds the original module's children under their names (`names` = gate, up, down; an
    activation child such as `act_fn` too), so parameters and state_dict keys are unchanged.
    Computes as the original module did (down(silu(gate(x)) · up(x)), each a QuantLinear or a
    plain layer) whenever the unit cannot run: a projection not quantized, or with a bias,
    recipes that differ or that `unit_reason` refuses (e.g. after `set_recipe`), a weight from
    a quantized all-gather (FSDP2).
    """

    def __init__(self, mlp: nn.Module, names: tuple[str, str, str]) -> None:
        super().__init__()
        for name, child in mlp.named_children():
            self.add_module(name, child)
        self.names = names
        self.train(mlp.training)

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """(gate, up, down)."""
        return tuple(getattr(self, n) for n in self.names)

    def unit_applies(self) -> bool:
        """Whether forward runs `SwiGLUFunction` (else the composite)."""
        layers = self.projections()
        if not all(type(m) is QuantLinear and m.bias is None for m in layers):
            return False
        recipe, backend = layers[0].recipe, layers[0].backend
        if any(m.recipe != recipe or m.backend != backend for m in layers):
            return False
        if any(isinstance(m.weight, GatheredWeight) for m in layers):
            return False
        return unit_reason(recipe) is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.projections()
        if not self.unit_applies():
            act = getattr(self, "act_fn", None)
            return down((F.silu if act is None else act)(gate(x)) * up(x))
        if x.shape[-1] != gate.in_features:
            raise ValueError(f"expected last dim {gate.in_features}, got shape {tuple(x.shape)}")
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        y = SwiGLUFunction.apply(
            x.reshape(-1, x.shape[-1]), gate.weight, up.weight, down.weight, gate.recipe,
            get_backend(gate.backend, x.device), out_dtype,
        )  # fmt: skip
        return y.reshape(*x.shape[:-1], down.out_features)

    def extra_repr(self) -> str:
        return f"gate={self.names[0]}, up={self.names[1]}, down={self.names[2]}"


def _layout(module: nn.Module) -> tuple[str, str, str] | None:
    """(gate, up, down) names if `module` is a SwiGLU MLP of a known class (`SWIGLU_LAYOUTS`)."""
    names = SWIGLU_LAYOUTS.get(f"{type(module).__module__}.{type(module).__qualname__}")
    if names is None:
        return None
    act = getattr(module, "act_fn", None)
    if act is not None and type(act).__name__ not in _SILU_CLASSES:
        return None  # e.g. a LlamaMLP configured with another activation
    return names


def fuse_swiglu(model: nn.Module) -> list[str]:
    """Swap each SwiGLU MLP of `model` (`SWIGLU_LAYOUTS`) whose three projections are
    QuantLinears under a recipe the unit runs for a `QuantSwiGLU`, in place; return their
    names. Call it after `convert` (or through `convert(..., fuse_mlp=True)`)."""
    targets = []
    for fqn, module in model.named_modules():
        names = _layout(module)
        if names is None or not fqn:
            continue
        unit = QuantSwiGLU(module, names)
        if unit.unit_applies():
            targets.append((fqn, unit))
    for fqn, unit in targets:  # swap after the walk: never mutate while iterating
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, unit)
    return [fqn for fqn, _ in targets]
