"""Quantizer kernel bandwidth and `_scaled_mm` behaviour probes (one GPU, a few seconds).

    PYTHONPATH=src python benchmarks/kernels.py

Prints, for M=16384 tokens: each Triton quantizer's time and achieved bandwidth (bytes read once
plus bytes written, over a measured device-to-device copy's rate); which fp32 order of applying
row scales `torch._scaled_mm` uses (the emulation must use the same one for bit-exact E2M1 GEMMs);
whether fast accumulation keeps E2M1 x E2M1 GEMMs exact; and which block-scale layouts work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, time_ms  # noqa: E402
from minifloat.kernels import scaled_mm as smm  # noqa: E402
from minifloat.kernels import triton_quant as tq  # noqa: E402
from minifloat.quantize import quantize  # noqa: E402

M = 16384


def copy_bandwidth() -> float:
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # GB/s


def _cases(x: torch.Tensor, s: torch.Tensor, r: torch.Tensor) -> dict:
    """name -> (call, bytes moved per element: 2 read + 1 per written copy)."""
    return {
        "row e2m1": (lambda: tq.quantize_rows(x, "e2m1"), 3),
        "row e2m1 +T": (lambda: tq.quantize_rows(x, "e2m1", write_transposed=True), 4),
        "row e5m2 col_mult": (lambda: tq.quantize_rows(x, "e5m2", col_mult=s), 3),
        "column e5m2 row_mult (x.t())": (
            lambda: tq.quantize_rows(x.t(), "e5m2", col_mult=r), 3),
        "1x128 e4m3": (lambda: tq.quantize_rows(x, "e4m3", group=128), 3),
        "128x1 e4m3 (x.t())": (lambda: tq.quantize_rows(x.t(), "e4m3", group=128), 3),
        "128x128 e4m3 +T": (lambda: tq.quantize_blocks(x, "e4m3", write_transposed=True), 4),
        "tensor e4m3 +T": (lambda: tq.quantize_tensor(x, "e4m3", write_transposed=True), 4),
    }  # fmt: skip


# (tokens, features): the 7B layer shapes, and the 125M model's (batch 32 x 1024 tokens), whose
# column operands (x.t(): 768 rows of 32768) have few row bands and need the split amax.
TABLE_SHAPES = ((M, 4096), (M, 11008), (32768, 768), (32768, 2048))


def quantizer_table(bw: float) -> None:
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    for m, k in TABLE_SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        s = torch.rand(k, device="cuda") + 0.5
        r = torch.rand(m, device="cuda") + 0.5
        for name, (fn, bytes_per_el) in _cases(x, s, r).items():
            ms = time_ms(fn)
            gbs = bytes_per_el * x.numel() / ms / 1e6
            print(f"{m:5d}x{k:<5d} {name:32s} {ms * 1e3:8.1f} us {gbs:6.0f} GB/s ({gbs / bw:.0%})")


def row_tuning(bw: float) -> None:
    """Launch shapes of the whole-row quantizer: x [16384, 4096] bf16 (E2M1, with and without
    the transposed copy) and the column operands x.t() of [16384, 4096] and [32768, 768]."""
    x = torch.randn(M, 4096, device="cuda").bfloat16()
    x125 = torch.randn(32768, 768, device="cuda").bfloat16()
    inputs = [("row x", x, False), ("row x +T", x, True), ("x.t() 7B", x.t(), False),
              ("x.t() 125M", x125.t(), False)]  # fmt: skip
    for name, inp, wt in inputs:
        for cfg in ((16, 256, 4), (8, 512, 4), (4, 1024, 4), (8, 1024, 8), (32, 256, 8),
                    (64, 128, 8), (32, 128, 4), (64, 64, 4)):  # fmt: skip
            fn = lambda: tq.quantize_rows(inp, "e2m1", write_transposed=wt, tuning=cfg)  # noqa: E731,B023
            ms = time_ms(fn)
            gbs = (4 if wt else 3) * inp.numel() / ms / 1e6
            print(f"{name:10s} e2m1 {cfg}: {ms * 1e3:7.1f} us {gbs / bw:.0%} of copy")


def epilogue_order() -> None:
    """Which fp32 order does row-wise _scaled_mm apply scales in? (E2M1 operands: exact acc)."""
    m, k, n = 1024, 4096, 1024
    xa = quantize(torch.randn(m, k, device="cuda"), "e2m1", "row")
    xb = quantize(torch.randn(n, k, device="cuda"), "e2m1", "row")
    a, b = xa.values.to(torch.float8_e4m3fn), xb.values.to(torch.float8_e4m3fn)
    acc = xa.values @ xb.values.t()  # exact in fp32
    sa, sb = xa.scale, xb.scale.t()
    cands = {"acc*(sa*sb)": acc * (sa * sb), "(acc*sa)*sb": (acc * sa) * sb,
             "(acc*sb)*sa": (acc * sb) * sa}  # fmt: skip
    for fast in (False, True):
        out = smm.scaled_mm_rowish(a, xa.scale, b, xb.scale, out_dtype=torch.float32,
                                   use_fast_accum=fast)  # fmt: skip
        unit = smm.scaled_mm_rowish(a, torch.ones(1, 1, device="cuda"), b,
                                    torch.ones(1, 1, device="cuda"), out_dtype=torch.float32,
                                    use_fast_accum=fast)  # fmt: skip
        match = {name: int((out != c).sum()) for name, c in cands.items()}
        print(f"fast_accum={fast}: acc exact: {torch.equal(unit, acc)}; mismatches {match}")


def block_layouts() -> None:
    m, k, n = 512, 1024, 768
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    for out_dtype in (torch.bfloat16, torch.float32):
        for rhs in ((128, 128), (1, 128)):
            sa = torch.rand(m, k // 128, device="cuda")
            sb = torch.rand(*((n // 128, k // 128) if rhs == (128, 128) else (n, k // 128)),
                            device="cuda")  # fmt: skip
            try:
                out = smm.scaled_mm_blocks(a, sa, b, sb, rhs, out_dtype=out_dtype)
                ea = a.float() * sa.repeat_interleave(128, 1)
                eb = b.float() * (sb.repeat_interleave(128, 0) if rhs == (128, 128) else sb
                                  ).repeat_interleave(128, 1)[:n]  # fmt: skip
                ref = ea @ eb.t()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                print(f"blocks {rhs} out={out_dtype}: ok, rel err {err:.2e}")
            except Exception as exc:
                print(f"blocks {rhs} out={out_dtype}: FAILED {type(exc).__name__}: {exc}"[:300])


def nan_probe() -> None:
    """Where do NaNs come from in mixed E5M2 x E4M3 GEMMs with bf16 output (seen in dgrad)?"""
    from minifloat.kernels.hopper import HopperBackend
    from minifloat.recipes import OperandSpec

    be = HopperBackend()
    w = torch.randn(384, 256, device="cuda") * 0.05
    dy = torch.randn(96, 384, device="cuda").bfloat16()
    w_q = be.quantize(w, OperandSpec(fmt="e4m3"))
    g_q = be.quantize(dy, OperandSpec(fmt="e5m2"))
    t_torch = w_q.data.t().contiguous()
    w_rhs = be.transpose(w_q)
    print("nan in w_q", w_q.values().isnan().sum().item(), "torch fp8 .t().contiguous()",
          t_torch.float().isnan().sum().item(), "byte transpose",
          w_rhs.values().isnan().sum().item())  # fmt: skip
    for out_dtype in (torch.bfloat16, torch.float32):
        for b in (t_torch, w_rhs.data):
            out = smm.scaled_mm_rowish(g_q.data, g_q.scale, b, w_q.scale, out_dtype=out_dtype)
            print(f"e5m2 x e4m3 out={out_dtype}: nan {out.isnan().sum().item()}")


def dgrad_nan_probe() -> None:
    """Replay QuantLinear's backward and report NaNs at every GEMM (dgrad NaN columns seen)."""
    from minifloat import recipes
    from minifloat.kernels.emulated import EmulatedBackend
    from minifloat.kernels.hopper import HopperBackend
    from minifloat.linear import QuantLinearFunction

    class Checking(HopperBackend):
        def scaled_mm(self, a, b, *, out_dtype, bias=None):
            out = super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
            ref = EmulatedBackend().scaled_mm(a, b, out_dtype=torch.float32)
            print(f"  gemm a{tuple(a.shape)} {a.data.dtype} {a.granularity} s{tuple(a.scale.shape)}"
                  f" b{tuple(b.shape)} {b.data.dtype} {b.granularity} s{tuple(b.scale.shape)} "
                  f"b.stride {b.data.stride()} nan: a {a.values().isnan().sum().item()} "
                  f"b {b.values().isnan().sum().item()} out {out.isnan().sum().item()} "
                  f"emu {ref.isnan().sum().item()} scales {a.scale.isnan().sum().item()}/"
                  f"{b.scale.isnan().sum().item()}")  # fmt: skip
            return out

    for name in ("fp8-tensorwise", "fp4-direct"):
        print(name)
        x = torch.randn(96, 256, device="cuda").bfloat16().requires_grad_(True)
        w = (torch.randn(384, 256, device="cuda") * 0.05).requires_grad_(True)
        r = recipes.get(name)
        y = QuantLinearFunction.apply(x, w, None, r, Checking(), torch.bfloat16, None)
        y.backward(torch.randn(96, 384, device="cuda").bfloat16())
        print("  dx nan", x.grad.isnan().sum().item(), "dw nan", w.grad.isnan().sum().item())


def main() -> None:
    print(environment())
    dgrad_nan_probe()
    epilogue_order()
    block_layouts()
    bw = copy_bandwidth()
    quantizer_table(bw)
    row_tuning(bw)


if __name__ == "__main__":
    main()
