"""benchmarks/blockwise_swiglu_probe.py on the CPU: the reference makes the five operands the
MLP's backward GEMMs take under fp8-blockwise, in the library's quantizers (the one-pass Triton
kernel it times against runs on CUDA only)."""

from __future__ import annotations

import torch

from minifloat.kernels.operand import quantize_operand
from scripts import load_benchmark


def test_reference_outputs_are_the_recipes_operands():
    bench = load_benchmark("blockwise_swiglu_probe")
    g, u, dh = bench.inputs(256, 384, "cpu", seed=3)
    out = dict(zip(bench.OUTPUTS, bench.reference(g, u, dh), strict=True))
    assert out["dg_q"].shape == (256, 384) and out["dg_s"].shape == (256, 3)
    assert out["dgt_q"].shape == (384, 256) and out["dgt_s"].shape == (384, 2)
    assert out["ht_q"].shape == (384, 256) and out["ht_q"].is_contiguous()
    # du = dh·g·sigmoid(g): its transposed operand is the 128 x 1 quantizer of that product
    gf, dhf = g.float(), dh.float()
    q, s = quantize_operand(dhf * gf * torch.sigmoid(gf), "e4m3", (1, 128), transpose=True,
                            scale_format="inv")  # fmt: skip
    assert torch.equal(out["dut_q"].view(torch.uint8), q.contiguous().view(torch.uint8))
    assert torch.equal(out["dut_s"], s)
    # the dequantized dg is its product to E4M3's precision (2^-4 relative for normal values)
    dg = dhf * u.float() * torch.sigmoid(gf) * (1 + gf * (1 - torch.sigmoid(gf)))
    back = out["dg_q"].float() * out["dg_s"].repeat_interleave(128, dim=1)
    assert 0 < ((back - dg).norm() / dg.norm()).item() < 2**-4


def test_the_cpu_smoke_run(capsys):
    load_benchmark("blockwise_swiglu_probe").main(["--device", "cpu"])
    assert "cpu smoke run" in capsys.readouterr().out
