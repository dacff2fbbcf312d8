"""Does float64 division bind the compiled quantizers? (issue 13; run in session 22: it does not)

    PYTHONPATH=src python benchmarks/division_probe.py [--out-dir DIR]

Times, compiled on their own: one tensor-scaled E4M3 quantizer of a bf16 [16384, 5632] tensor,
and a SwiGLU backward like the 1.3B block's (dg_q and du_q in E5M2 with their amaxes, h_qᵀ in
E4M3 under a given scale). The division x / s runs three ways: in float64 (`exact.div_rn`, as
shipped: two float32 <-> float64 conversions an element), in float32 with two FMAs (Markstein's
correction with inductor's `prims.fma`, the scale's factors computed once per kernel; the same
bits), and as a plain multiply by 1/s (inexact: a floor for the arithmetic's cost). Also the
SwiGLU backward with h_q stored untransposed, for the strided store's share. GPU kernel time per
call (profiler) and whether each variant's FP8 bytes equal the float64 one's, written to
`division_probe_<gpu>_<date>.{md,json}`. On the CPU it runs small shapes, checks the bytes only
and writes nothing. See docs/hopper_sessions.md, sessions 21 and 22.
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
from common import RESULTS_DIR, kernel_ms, write_results  # noqa: E402
from minifloat.exact import div_rn  # noqa: E402
from minifloat.kernels.operand import scale_from_amax  # noqa: E402

FMA = torch.ops.prims.fma.default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, N = (16384, 5632) if DEVICE == "cuda" else (256, 384)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def div_f64(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return div_rn(a, s)


def div_fma(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Markstein: r = RN(1/s1), q0 = a·2^k·r, e = fma(-q0, s1, a·2^k) exact, fma(e, r, q0)."""
    s1, e = torch.frexp(s)
    k = (-e.to(torch.int32)).clamp(-250, 250)
    k_hi = torch.div(k + 1, 2, rounding_mode="floor")
    r = div_rn(torch.ones_like(s1), s1)
    x = a * _pow2(k_hi) * _pow2(k - k_hi)
    q0 = x * r
    err = FMA(-q0, s1, x)
    return torch.where(torch.isfinite(err) & (q0 != 0), FMA(err, r, q0), q0)


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


def _same_bytes(a, b) -> bool:
    a, b = (a,) if torch.is_tensor(a) else a, (b,) if torch.is_tensor(b) else b
    pairs = zip(a, b, strict=True)
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = (torch.randn(M, N, device=DEVICE) * 3).to(torch.bfloat16)
    dh, g, u = ((torch.randn(M, N, device=DEVICE) * c).to(torch.bfloat16) for c in (1e-3, 2, 2))
    s_h = torch.tensor([[0.05]], device=DEVICE)
    out: dict = {"shape": [M, N]}
    ref = None
    for label, div in (("f64", div_f64), ("fma", div_fma), ("mul", div_mul)):
        t0 = time.time()
        quant = torch.compile(make_quant(div), fullgraph=True)
        swiglu = torch.compile(make_swiglu(div), fullgraph=True)
        got = (quant(x), swiglu(dh, g, u, s_h))
        out[f"{label}_compile_s"] = round(time.time() - t0, 1)
        out[f"{label}_quant_us"] = kernel_us(quant, x)
        out[f"{label}_swiglu_us"] = kernel_us(swiglu, dh, g, u, s_h)
        ref = ref or got
        out[f"{label}_equal_to_f64"] = _same_bytes(got[0], ref[0]) and _same_bytes(got[1], ref[1])
        print(label, {k: v for k, v in out.items() if k.startswith(label)}, flush=True)
    swiglu = torch.compile(make_swiglu(div_f64, transpose=False), fullgraph=True)
    out["f64_swiglu_untransposed_us"] = kernel_us(swiglu, dh, g, u, s_h)
    print(json.dumps(out, indent=1))
    if DEVICE == "cuda":
        body = "`benchmarks/division_probe.py`\n\n```\n" + json.dumps(out, indent=1) + "\n```"
        write_results("division_probe", [out], body, out_dir=Path(args.out_dir), day=args.date)


if __name__ == "__main__":
    main()
