"""benchmarks/block_gemm_probe.py: fp8-blockwise's GEMM shapes of one block, the recipe's scale
layouts, the float64 reference the interpreter run checks against, and the report's sums. The
Triton kernel itself needs Triton (GPU machines; its interpreter on the CPU): it is run only
where Triton is installed."""

from __future__ import annotations

import pytest
import torch

from interpreter import interpreted
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("block_gemm_probe")


def test_shapes_are_the_recipes_three_gemms_once_each(bench):
    got = bench.shapes("tiny", 64)  # dim 128, kv 128, ffn 352
    keys = [(e["gemm"], tuple(e["shape"])) for e in got]
    assert len(keys) == len(set(keys))
    by_key = {k: e for k, e in zip(keys, got, strict=True)}
    qkvo = by_key[("fprop", (64, 128, 128))]
    assert qkvo["linears"] == ["q", "k", "v", "o"] and qkvo["b_block"] == (128, 128)
    assert by_key[("wgrad", (352, 128, 64))]["b_block"] == (1, 128)  # gate and up: dyᵀ·(xᵀ)ᵀ
    assert by_key[("wgrad", (352, 128, 64))]["dtype"] == torch.float32
    assert by_key[("dgrad", (64, 352, 128))]["linears"] == ["down"]
    assert sum(len(e["linears"]) for e in got) == 7 * 3


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_operand_scales_have_the_recipes_layouts(bench, b_block):
    a, sa, b, sb = bench.operands(200, 300, 260, b_block, "cpu")
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert sa.shape == (200, 3)
    assert sb.shape == ((3, 3) if b_block == (128, 128) else (300, 3))


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_reference_is_the_blockwise_dequantized_product(bench, b_block):
    a, sa, b, sb = bench.operands(130, 140, 260, b_block, "cpu")
    ref = bench.reference(a, sa, b, sb, b_block)
    want = torch.zeros(130, 140, dtype=torch.float64)
    for i in range(130):  # element by element: a[i, k] * sa[i, k // 128] * b[j, k] * s_b
        for kb in range(3):
            ks = slice(128 * kb, 128 * kb + 128)
            rows_b = torch.arange(140) // (128 if b_block == (128, 128) else 1)
            s_b = sb.double()[rows_b, kb]
            want[i] += (a[i, ks].double() * sa[i, kb].double()) @ b[:, ks].double().t() * s_b
    torch.testing.assert_close(ref, want, rtol=1e-12, atol=1e-9)


def test_configs_parse_and_reject_bad_forms(bench):
    assert bench.parse_configs("pair,64,128,4,3;ceiling,128,256,8,3") == [
        ("pair", 64, 128, 4, 3),
        ("ceiling", 128, 256, 8, 3),
    ]
    with pytest.raises(SystemExit, match="form,BLOCK_M"):
        bench.parse_configs("fast,64,128,4,3")
    with pytest.raises(SystemExit, match="form,BLOCK_M"):
        bench.parse_configs("pair,64,128")
    bench.parse_configs(bench.CONFIGS)  # the defaults parse


def test_report_sums_count_each_linear_and_skip_the_ceiling(bench):
    ms = {"cublas": 1.0, "promote,64,128,4,4": 2.0, "ceiling,128,256,8,3": 0.5}
    rec = {"gemm": "fprop", "shape": [8, 8, 8], "linears": ["q", "k"], "ms": ms,
           "tflops": {k: 1.0 for k in ms}}  # fmt: skip
    body = bench._body([rec], "tiny", 8)
    # cuBLAS 2 x 1.0; the best computing Triton form 2 x 2.0 (the ceiling, which ignores the
    # scales, is not a candidate); the faster of the two, cuBLAS
    assert "- fprop: cuBLAS 2.000; Triton, best config a shape 4.000; the faster of cuBLAS and " \
        "Triton a shape 2.000" in body  # fmt: skip
    assert "| fprop | [8, 8, 8] | q,k | 1.000 (1) | 2.000 (1) | 0.500 (1) |" in body


@interpreted
def test_interpreter_run_checks_every_form_against_float64(bench, capsys):
    pytest.importorskip("triton")
    bench.main(["--device", "cpu", "--configs", "promote,64,64,4,3;pair,64,64,4,3"])
    assert "every shape and config built, run once and checked" in capsys.readouterr().out
