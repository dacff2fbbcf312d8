"""Probe: where do NaN bytes in the saved transposed FP8 operands come from? (GPU only)."""

import sys

import torch

from minifloat import recipes
from minifloat.kernels import triton_quant as tq
from minifloat.kernels.hopper import HopperBackend
from minifloat.linear import QuantLinearFunction


def nan_bytes(t):
    u = t.view(torch.uint8)
    return int(((u & 0x7F) == 0x7F).sum())


def kernel_transposed(fmt, mode, dtype, shape=(384, 256)):
    x = (torch.randn(shape, device="cuda") * 0.05).to(dtype)
    for rep in range(3):
        if mode == "row":
            o = tq.quantize_rows(x, fmt, write_transposed=True)
        else:
            o = tq.quantize_tensor(x, fmt, write_transposed=True)
        torch.cuda.synchronize()
        v, vt = o.values.view(torch.uint8), o.values_t.view(torch.uint8)
        mism = int((v.t() != vt).sum())
        print(
            f"kernel {fmt} {mode} {dtype} rep{rep}: nan v {nan_bytes(o.values)} "
            f"nan vt {nan_bytes(o.values_t)} mismatch {mism}"
        )


def qlinear(name, m=96):
    be = HopperBackend()
    orig = be.quantize

    def quantize(x, spec, **kw):
        q = orig(x, spec, **kw)
        torch.cuda.synchronize()
        dt = getattr(q, "data_t", None)
        extra = ""
        if dt is not None:
            mism = int((q.data.view(torch.uint8).t() != dt.view(torch.uint8)).sum())
            extra = f" data_t nan {nan_bytes(dt)} mism {mism}"
        desc = f"{tuple(x.shape)} {spec.fmt} {spec.granularity} kw={sorted(kw)}"
        print(f"   quantize {desc} nan {nan_bytes(q.data)}{extra}")
        return q

    be.quantize = quantize
    x = torch.randn(m, 256, device="cuda").bfloat16().requires_grad_(True)
    w = (torch.randn(384, 256, device="cuda") * 0.05).requires_grad_(True)
    print(name)
    y = QuantLinearFunction.apply(x, w, None, recipes.get(name), be, torch.bfloat16, None)
    torch.cuda.synchronize()
    print("   y nan", int(y.isnan().sum()))
    y.backward(torch.randn(m, 384, device="cuda").bfloat16())
    torch.cuda.synchronize()
    print("   dx nan", int(x.grad.isnan().sum()), "dw nan", int(w.grad.isnan().sum()))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    if "--small" not in sys.argv:
        for fmt in ("e2m1", "e4m3"):
            for mode in ("row", "tensor"):
                for dtype in (torch.float32, torch.bfloat16):
                    kernel_transposed(fmt, mode, dtype)
    for name in ("fp8-tensorwise", "fp4-direct", "fp8-rowwise"):
        qlinear(name)
