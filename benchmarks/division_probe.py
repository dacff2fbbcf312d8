"""Does float64 division bind the compiled quantizers? (issue 13; run in session 22: it does not)

    PYTHONPATH=src python benchmarks/division_probe.py [--out-dir DIR] [--part PART]

`--part division` (the default): times, compiled on their own, one tensor-scaled E4M3
quantizer of a bf16 [16384, 5632] tensor and a SwiGLU backward like the 1.3B block's (dg_q and
du_q in E5M2 with their amaxes, h_qᵀ in E4M3 under a given scale). The division x / s runs
three ways: in float64 (`exact.div_rn`, as shipped: two float32 <-> float64 conversions an
element), in float32 with two FMAs (Markstein's correction with inductor's `prims.fma`; the
scale's factors are computed from it inside the fused kernel; the same bits), and as a plain
multiply by 1/s (inexact: a floor for the arithmetic's cost). Also the SwiGLU backward with
h_q stored untransposed, for the strided store's share.

`--part scales_given`: the SwiGLU backward's quantizing kernel alone, its three scales given
as inputs, the FMA variant's factors (1/s1 and the powers of two) precomputed and loaded, so
that only the per-element arithmetic differs. `--part amax_forms`: the SwiGLU's tensor amaxes
(forward: silu(g) * u; backward: dg and du) and a [16384, 2048] operand's, reduced as
`amax()`, rows first, or in chunks of 2,048 to 131,072 elements.

`div_table_bf16` (session 31) is a fourth exact form for bfloat16 numerators, by a table of the
128 significands' quotients; `kernel_power.py` times and samples it (`given_bf16`).

GPU kernel time per call (profiler) and whether each variant's FP8 bytes (or amaxes) equal the
float64 (`amax()`) one's, written to `division_probe[_<part>]_<gpu>_<date>.{md,json}`. On the
CPU it runs small shapes, checks the bytes only and writes nothing. See
docs/hopper_sessions.md, sessions 21 and 22.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers torch.ops.prims.fma)
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import RESULTS_DIR, kernel_ms, same_bytes, write_results  # noqa: E402
from minifloat import exact  # noqa: E402
from minifloat.exact import div_rn  # noqa: E402
from minifloat.kernels.operand import scale_from_amax  # noqa: E402

FMA = torch.ops.prims.fma.default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, N = (16384, 5632) if DEVICE == "cuda" else (256, 384)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def fma_factors(s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(s1, r, p1, p2): s = s1·2^-k with s1 in [0.5, 1), r = RN(1/s1), 2^k = p1·p2."""
    s1, e = torch.frexp(s)
    k = (-e.to(torch.int32)).clamp(-250, 250)
    k_hi = torch.div(k + 1, 2, rounding_mode="floor")
    return s1, div_rn(torch.ones_like(s1), s1), _pow2(k_hi), _pow2(k - k_hi)


def div_fma_by_factors(a: torch.Tensor, factors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Markstein: q0 = a·2^k·r, e = fma(-q0, s1, a·2^k) exact, fma(e, r, q0) = RN(a / s)."""
    s1, r, p1, p2 = factors
    x = a * p1 * p2
    q0 = x * r
    err = FMA(-q0, s1, x)
    return torch.where(torch.isfinite(err) & (q0 != 0), FMA(err, r, q0), q0)


def div_table_bf16(a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`div_rn(a.float(), scale)` for a bfloat16 `a` and one float32 `scale`, in float32 and
    integer arithmetic: no float64 per element.

    A bfloat16 number is ±(1 + j/128)·2^e, so a / s = ((1 + j/128) / s1)·2^(e - k) with
    s = s1·2^k, s1 in [1, 2). Rounding commutes with the power of two wherever the result is a
    normal float32, so the quotient is an entry of a 128-entry table T[j] = RN((1 + j/128) / s1)
    (made once by `div_rn`) with 2^(e - k) added to its exponent bits. The same bits as
    `div_rn` for every quotient of magnitude above 2^-126 (inf where it overflows); smaller
    ones give a signed zero, where `div_rn` may give a subnormal (every grid rounds both to
    zero). Zero, inf and NaN numerators and zero, inf and NaN scales as `div_rn` treats them.

    Tried in session 31 (docs/hopper_sessions.md) as the tensor-scaled quantizers' quotient of
    bfloat16 inputs, because the float64 product draws ~75 W more than a float32 multiply at
    the same speed and a step runs at the GPU's power limit. Compiled on an H200 the gather and
    integer work took 2.7x the float64 cast's time, and for a subnormal scale (2^-149) it gave
    zeros where the CPU does not (not diagnosed); kept as `kernel_power.py`'s `given_bf16`.
    """
    xf = a.float()
    s = scale.float().reshape(())
    s1, e_s = torch.frexp(s)  # s = s1·2^e_s, |s1| in [0.5, 1)
    j = torch.arange(_BF16_FRACTIONS, device=a.device, dtype=torch.float32)
    table = div_rn(1 + j / _BF16_FRACTIONS, 2 * s1).view(torch.int32)  # normal, signed as s
    if torch.compiler.is_compiling():
        table = exact.written_once(table)  # one small buffer; inline, every element would divide
    bits = xf.view(torch.int32)
    # Subnormal numerators are read after an exact scaling by 2^64, which makes them normal.
    sub = (((bits >> 23) & 255) == 0).to(torch.int32)
    bits = (xf * _pow2(sub * 64)).view(torch.int32)
    t = table[(bits >> 16) & (_BF16_FRACTIONS - 1)]
    exponent = ((t >> 23) & 255) + ((bits >> 23) & 255) - 64 * sub - 127 - (e_s - 1)
    clamped = exponent.clamp(0, 255)
    normal = ((clamped > 0) & (clamped < 255)).to(torch.int32)  # else zero or inf
    q = (clamped << 23) | ((t & 0x7FFFFF) * normal) | ((t ^ bits) & -(2**31))
    ordinary = torch.isfinite(xf) & (xf != 0) & torch.isfinite(s) & (s != 0)
    special = xf * torch.where(torch.isfinite(s) & (s != 0), torch.sign(s), s.reciprocal())
    return torch.where(ordinary, q.view(torch.float32), special)


_BF16_FRACTIONS = 128  # the significands 1 + j/128 of bfloat16 numbers


def div_fma(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return div_fma_by_factors(a, fma_factors(s))


def div_mul(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return a * (1.0 / s)


def _quant(v, fmt_max, dtype, div, s=None):
    if s is None:
        s = scale_from_amax(v.abs().amax().float().reshape(1, 1), fmt_max)
    return div(v.float(), s).clamp(-fmt_max, fmt_max).to(dtype)


def make_quant(div):
    return lambda x: _quant(x, 448.0, torch.float8_e4m3fn, div)


def make_swiglu(div, transpose: bool = True):
    def swiglu_backward(dh, g, u, s_h):
        sg = F.silu(g)
        h_q = _quant(sg * u, 448.0, torch.float8_e4m3fn, div, s_h)
        h_q = h_q.t().contiguous() if transpose else h_q
        dg = torch.ops.aten.silu_backward(dh * u, g)
        dg_q = _quant(dg, 57344.0, torch.float8_e5m2, div)
        du_q = _quant(dh * sg, 57344.0, torch.float8_e5m2, div)
        return h_q, dg_q, du_q

    return swiglu_backward


def kernel_us(fn, *args) -> float:
    """GPU kernel time per call (common.kernel_ms), after three warm-up calls; NaN on the CPU."""
    for _ in range(3):
        fn(*args)
    if DEVICE != "cuda":
        return float("nan")
    return 1e3 * (kernel_ms(lambda: fn(*args)) or float("nan"))


def swiglu_scales_given(div):
    """The SwiGLU backward's quantizing kernel with its scales (or their factors) as inputs."""

    def quantize(dh, g, u, fh, fg, fu):
        sg = F.silu(g)
        h_q = div((sg * u).float(), fh).clamp(-448, 448).to(torch.float8_e4m3fn).t().contiguous()
        dg = torch.ops.aten.silu_backward(dh * u, g)
        dg_q = div(dg.float(), fg).clamp(-57344, 57344).to(torch.float8_e5m2)
        du_q = div((dh * sg).float(), fu).clamp(-57344, 57344).to(torch.float8_e5m2)
        return h_q, dg_q, du_q

    return quantize


def part_scales_given(dh, g, u) -> dict:
    scales = [torch.tensor([[v]], device=DEVICE) for v in (0.05, 3.1e-7, 2.9e-7)]
    variants = {
        "f64": (lambda a, f: div_rn(a, f[0]), [(s,) for s in scales]),
        "fma": (div_fma_by_factors, [fma_factors(s) for s in scales]),
        "mul": (lambda a, f: a * f[1], [(s, 1.0 / s) for s in scales]),
    }
    out, ref = {}, None
    for name, (div, factors) in variants.items():
        fn = torch.compile(swiglu_scales_given(div), fullgraph=True)
        args = (dh, g, u, *factors)
        got = fn(*args)
        ref = ref or got
        differing = [
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
            for a, b in zip(got, ref, strict=True)
        ]
        out[name] = {"bytes_differing_from_f64": differing, "us": round(kernel_us(fn, *args), 1)}
        print(name, out[name], flush=True)
    return out


def _amax(v: torch.Tensor, form: str) -> torch.Tensor:
    a = v.abs()
    if form == "full":
        return a.amax()
    if form == "rows":
        return a.amax(dim=-1).amax()
    return a.reshape(-1, int(form[1:])).amax(dim=-1).amax()


def part_amax_forms(dh, g, u) -> dict:
    x = torch.randn(M, 2048 if DEVICE == "cuda" else 128, device=DEVICE).to(torch.bfloat16)
    cases = {
        "fwd": (lambda form: lambda g, u: _amax(F.silu(g) * u, form), (g, u)),
        "bwd": (lambda form: lambda dh, g, u: (
            _amax(torch.ops.aten.silu_backward(dh * u, g), form), _amax(dh * F.silu(g), form)
        ), (dh, g, u)),
        "x": (lambda form: lambda x: _amax(x, form), (x,)),
    }  # fmt: skip
    forms = ["full", "rows", "c2048", "c8192", "c32768"] + (["c131072"] if DEVICE == "cuda" else [])
    out: dict = {}
    for form in forms:
        res = {}
        for name, (make, args) in cases.items():
            fn = torch.compile(make(form), fullgraph=True)
            got = fn(*args)
            res[name + "_val"] = [float(t) for t in (got if isinstance(got, tuple) else (got,))]
            res[name + "_us"] = round(kernel_us(fn, *args), 1)
        out[form] = res
        print(form, res, flush=True)
    vals = [[r[k] for k in r if k.endswith("_val")] for r in out.values()]
    out["all_equal"] = all(v == vals[0] for v in vals)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    ap.add_argument(
        "--part", default="division", choices=("division", "scales_given", "amax_forms")
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.part != "division":
        dh, g, u = ((torch.randn(M, N, device=DEVICE) * c).to(torch.bfloat16) for c in (1e-3, 2, 2))
        part = {"scales_given": part_scales_given, "amax_forms": part_amax_forms}[args.part]
        out = {"shape": [M, N]} | part(dh, g, u)
        if DEVICE == "cuda":
            body = f"`benchmarks/division_probe.py --part {args.part}`\n\n```\n"
            body += json.dumps(out, indent=1) + "\n```"
            name = f"division_probe_{args.part}"
            write_results(name, [out], body, out_dir=Path(args.out_dir), day=args.date)
        return
    x = (torch.randn(M, N, device=DEVICE) * 3).to(torch.bfloat16)
    dh, g, u = ((torch.randn(M, N, device=DEVICE) * c).to(torch.bfloat16) for c in (1e-3, 2, 2))
    s_h = torch.tensor([[0.05]], device=DEVICE)
    out: dict = {"shape": [M, N]}
    ref = None
    for label, div in (("f64", div_rn), ("fma", div_fma), ("mul", div_mul)):
        t0 = time.time()
        quant = torch.compile(make_quant(div), fullgraph=True)
        swiglu = torch.compile(make_swiglu(div), fullgraph=True)
        got = (quant(x), swiglu(dh, g, u, s_h))
        out[f"{label}_compile_s"] = round(time.time() - t0, 1)
        out[f"{label}_quant_us"] = kernel_us(quant, x)
        out[f"{label}_swiglu_us"] = kernel_us(swiglu, dh, g, u, s_h)
        ref = ref or got
        out[f"{label}_equal_to_f64"] = same_bytes(got[0], ref[0]) and same_bytes(got[1], ref[1])
        print(label, {k: v for k, v in out.items() if k.startswith(label)}, flush=True)
    swiglu = torch.compile(make_swiglu(div_rn, transpose=False), fullgraph=True)
    out["f64_swiglu_untransposed_us"] = kernel_us(swiglu, dh, g, u, s_h)
    print(json.dumps(out, indent=1))
    if DEVICE == "cuda":
        body = "`benchmarks/division_probe.py`\n\n```\n" + json.dumps(out, indent=1) + "\n```"
        write_results("division_probe", [out], body, out_dir=Path(args.out_dir), day=args.date)


if __name__ == "__main__":
    main()
