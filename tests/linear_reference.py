"""A float64 reference of QuantLinear's math for every recipe without random draws, written
directly against minifloat.quantize (not against the layer's code path): each output's value and
a bound on an fp32 computation's rounding error. Used by tests/test_linear.py and
tests/test_microblock_linear.py."""

from __future__ import annotations

import torch

from minifloat import formats, occ_gemm
from minifloat.dge import dge_derivative
from minifloat.occ import clamp
from minifloat.quantize import quantize, tensor_quantiles
from minifloat.recipes import OperandSpec, QuantRecipe

U = 2.0**-24  # fp32 unit roundoff


def _deq(t: torch.Tensor, spec: OperandSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, per-element scale) of quantize(t) as float64."""
    q = quantize(t, spec.fmt, spec.granularity, scale_format=spec.scale_format)
    return q.values.double(), q.expand_scale().double()


def scaled_operand(t: torch.Tensor, spec: OperandSpec) -> torch.Tensor:
    """t as quantize() scales it before rounding (row or tensor groups): t * m with "inv"
    scales, m = max / amax per group (formats.inv_scales), else t / scale, in float32."""
    m = _inv_multiplier(t, spec)
    if m is not None:
        return t * m
    q = quantize(t, spec.fmt, spec.granularity, scale_format=spec.scale_format)
    return t / q.expand_scale()


def _inv_multiplier(t: torch.Tensor, spec: OperandSpec) -> torch.Tensor | None:
    """The "inv" multipliers m = max / amax of t's row or tensor groups (formats.inv_scales),
    [rows, 1] or [1, 1] float32; None for other scale formats."""
    if spec.scale_format != "inv":
        return None
    amax = t.abs().amax(1, keepdim=True) if spec.granularity == "row" else t.abs().amax()
    return formats.inv_scales(amax, formats.get(spec.fmt).max)[0]


def gemm_with_bound(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a @ bᵀ in float64, and a bound on an fp32 computation's rounding error."""
    kc = a.shape[1]
    return a @ b.t(), (kc + 4) * U * (a.abs() @ b.abs().t())


def reference(
    recipe: QuantRecipe,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    dy: torch.Tensor,
    *,
    clip: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (float64 value, fp32 error bound)} for y, dx, dw, db.

    `clip`: OCC's (lo, hi) clamp bounds; None takes the exact quantiles of x.
    """
    out_dtype = x.dtype
    x, w, dy = x.float(), w.float(), dy.float()
    x_c, delta = x, torch.zeros_like(x)
    if recipe.occ is not None:
        lo, hi = tensor_quantiles(x, recipe.occ.alpha) if clip is None else clip
        x_c = clamp(x, lo, hi)
        if recipe.occ.compensate:
            delta = x - x_c
    xv, xs = _deq(x_c, recipe.fprop.lhs)
    wv, ws = _deq(w, recipe.fprop.rhs)
    y, y_err = gemm_with_bound(xv * xs, wv * ws)
    comp, comp_err, c, c_err = _compensation(recipe, delta, w, dy)
    occ_cfg = recipe.occ
    if occ_gemm.joins_products(recipe):  # one GEMM over both: its one rounding, the caller's
        comp, comp_err = _joint_compensation(x_c, delta, w, xs, ws)
        k = x.shape[1]  # a contraction of 2K terms: (2K + 4) u of their magnitudes' sum
        y_err, comp_err = (2 * k + 4) / (k + 4) * y_err, (2 * k + 4) / (k + 4) * comp_err
    y_err = y_err + comp_err
    e4m3 = occ_cfg is not None and occ_cfg.compensate and occ_cfg.compensation_format == "e4m3"
    e4m3 = e4m3 and not occ_gemm.joins_products(recipe)
    if e4m3 and out_dtype == torch.bfloat16:  # fprop's two products each rounded to bf16
        y_err = y_err + 2.0**-8 * (y.abs() + comp.abs() + y_err)
    y = y + comp + (0 if b is None else b.double())
    out = {"y": (y, y_err)}

    if recipe.folds("dgrad"):  # scale dy's columns by w's row scale, quantize, x unit-scaled w_q
        gv, gs = _deq(dy * ws[:, :1].float().t(), recipe.dgrad.lhs)
        out["dx"] = gemm_with_bound(gv * gs, wv.t())
    elif recipe.dgrad.rhs.reuse:
        gv, gs = _deq(dy, recipe.dgrad.lhs)
        out["dx"] = gemm_with_bound(gv * gs, (wv * ws).t())
    else:
        gv, gs = _deq(dy, recipe.dgrad.lhs)
        tv, ts = _deq(w.t().contiguous(), recipe.dgrad.rhs)
        out["dx"] = gemm_with_bound(gv * gs, tv * ts)

    if _folds_remainder(recipe):  # wgrad's x_q carries OCC's remainder: z = x_q + Δx·m_x
        m_x = _inv_multiplier(x_c, recipe.fprop.lhs)
        xv = _folded_remainder(xv, xs, delta, m_x, formats.get(recipe.fprop.lhs.fmt).max)
    if recipe.folds("wgrad"):  # scale dy's rows by x's row scale, quantize dyᵀ, x unit-scaled x_q
        hv, hs = _deq((dy * xs[:, :1].float()).t().contiguous(), recipe.wgrad.lhs)
        dw, dw_err = gemm_with_bound(hv * hs, xv.t())
    elif recipe.wgrad.rhs.reuse:
        hv, hs = _deq(dy.t().contiguous(), recipe.wgrad.lhs)
        dw, dw_err = gemm_with_bound(hv * hs, (xv * xs).t())
    else:
        hv, hs = _deq(dy.t().contiguous(), recipe.wgrad.lhs)
        tv, ts = _deq(x_c.t().contiguous(), recipe.wgrad.rhs)
        dw, dw_err = gemm_with_bound(hv * hs, tv * ts)
    dw, dw_err = dw + c, dw_err + c_err
    if recipe.dge is not None:  # f' at the scaled w that the quantizer rounded
        f = dge_derivative(scaled_operand(w, recipe.fprop.rhs), k=recipe.dge.k, cap=recipe.dge.cap)
        f = f.double()
        dw, dw_err = dw * f, dw_err * f
    out["dw"] = (dw, dw_err)
    out["db"] = (dy.double().sum(0), dy.shape[0] * U * dy.double().abs().sum(0))
    return out


def _folds_remainder(recipe: QuantRecipe) -> bool:
    """E4M3 compensation with fprop's row- or tensor-scaled input reused in wgrad."""
    occ_cfg = recipe.occ
    return (
        occ_cfg is not None
        and occ_cfg.compensate
        and occ_cfg.compensation_format == "e4m3"
        and recipe.wgrad.rhs.reuse
        and recipe.fprop.lhs.granularity in ("row", "tensor")
    )


def _folded_remainder(
    xv: torch.Tensor,
    xs: torch.Tensor,
    delta: torch.Tensor,
    m_x: torch.Tensor | None,
    values_max: float,
) -> torch.Tensor:
    """z = x_q + Δx·m_x (an "inv" x_q's multipliers m_x; Δx / s_x without them: float32 product
    or quotient, then sum) on E4M3 times the least power of two t >= 1 that keeps B / t <= 448,
    B = max over rows of values_max + max|Δx·m_x| (a bound on |z|), as float64 z_q·t."""
    q = delta.float() / xs.float() if m_x is None else delta.float() * m_x.float()
    z = xv.float() + q
    bound = values_max + q.abs().max().item()
    t = 1.0
    while bound / t > 448.0:
        t *= 2.0
    return formats.get("e4m3").round(z / t).double() * t


def _compensation(
    recipe: QuantRecipe, delta: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """OCC's fprop and wgrad corrections (value, error bound) in float64, dense: exact products
    ("fp32"), or E4M3 operands quantized per row along each GEMM's contraction ("e4m3"; the
    wgrad one is zero where the remainder folds into wgrad's input)."""
    zero = torch.zeros(w.shape, dtype=torch.float64)
    if recipe.occ is None or recipe.occ.compensation_format == "fp32":
        return (
            *gemm_with_bound(delta.double(), w.double()),
            *gemm_with_bound(dy.double().t(), delta.double().t()),
        )
    e4m3 = OperandSpec(fmt="e4m3", granularity="row")
    dv, ds = _deq(delta, e4m3)
    wv, ws = _deq(w, e4m3)
    comp, comp_err = gemm_with_bound(dv * ds, wv * ws)
    if _folds_remainder(recipe):
        return comp, comp_err, zero, zero
    gv, gs = _deq(dy.t().contiguous(), e4m3)
    tv, ts = _deq(delta.t().contiguous(), e4m3)
    return comp, comp_err, *gemm_with_bound(gv * gs, tv * ts)


def _joint_compensation(
    x_c: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OCC's fprop correction of `OCCConfig.one_gemm` (value, error bound) in float64, from its
    definition: per row g = f·2^-a, for each f in {1, 1.25, 1.5} the least a in f's range with
    the row's largest |Δx·m_x| times f·2^-a within 448, and of those the f whose largest entry
    rounds to E4M3 closest (ties: the smaller f); Δx·m_x·g (float32) rounded to E4M3; w·m_w·2^6
    rounded to E4M3; the product on xs / g and ws·2^-6 (m_x, m_w: the E2M1 "inv" multipliers
    of x_c's and w's rows). The error of the largest entry is compared as float64 here, in
    float32 by the layer; two factors that round it to the same value are tied (compared
    exactly, as the layer does since session 82), and a near tie that is not one may pick the
    other f (inputs here have none)."""
    e4m3 = formats.get("e4m3")
    m_x = formats.inv_scales(x_c.abs().amax(1, keepdim=True), 6.0)[0]
    m_w = formats.inv_scales(w.abs().amax(1, keepdim=True), 6.0)[0]
    dv = delta * m_x  # float32
    reach = dv.abs().amax(1, keepdim=True)
    best_err = best_g = best_f = best_vf = None
    for f, least, most in ((1.0, -6, 8), (1.25, -5, 6), (1.5, -5, 7)):
        top = (reach * f).double()  # float32 product, as the layer rounds it
        a = torch.full_like(top, float(least))
        while bool(((top * 2.0**-a > 448.0) & (a < most)).any()):
            a = torch.where((top * 2.0**-a > 448.0) & (a < most), a + 1, a)
        v = top * 2.0**-a
        rounded = e4m3.round(v.clamp(max=448.0).float()).double()
        err = (rounded - v).abs() * 2.0**a / f
        g = f * 2.0**-a
        vf = rounded * 2.0**a  # f times the value f rounds reach to
        if best_err is None:
            best_err, best_g, best_f, best_vf = err, g, torch.full_like(g, f), vf
        else:
            closer = (err < best_err) & ~(vf * best_f == best_vf * f)
            best_g = torch.where(closer, g, best_g)
            best_f = torch.where(closer, f, best_f)
            best_vf = torch.where(closer, vf, best_vf)
            best_err = torch.where(closer, err, best_err)
    dq = e4m3.round((dv.double() * best_g).float().clamp(-448.0, 448.0)).double()
    wq = e4m3.round(w * m_w * 64.0).double()
    return gemm_with_bound(dq * xs / best_g, wq * ws / 64.0)
