"""benchmarks/sass_count.py: finds one kernel in an inductor code dump, applies textual variants
exactly, and (where Triton is installed; no GPU needed) counts the SASS of each: a variant
that drops an operation has fewer instructions."""

from __future__ import annotations

import json

import pytest

from scripts import load_benchmark

# An inductor code dump in miniature: one kernel as `async_compile.triton` defines it
_KERNEL = """
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 1024},
    triton_meta={'signature': {'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32',
                               'XBLOCK': 'constexpr'}},
)
@triton.jit
def triton_poi_fused_mul_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    tmp0 = tl.load(in_ptr0 + xindex)
    tmp1 = tl.sigmoid(tmp0)
    tmp2 = tmp1 * tmp0
    tl.store(out_ptr0 + xindex, tmp2)
"""
DUMP = (
    "triton_poi_fused_mul_0 = async_compile.triton('triton_poi_fused_mul_0', '''"
    + _KERNEL
    + "''', device_str='cuda')\n"
)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sass_count")


def test_kernel_source_and_variants(bench):
    name, source = bench.kernel_source(DUMP, "fused_mul")
    assert name == "triton_poi_fused_mul_0" and "tmp1 * tmp0" in source
    with pytest.raises(SystemExit, match="0 kernels match"):
        bench.kernel_source(DUMP, "fused_add")
    label, edits = bench.parse_variant("no sigmoid:tmp1 = tl.sigmoid(tmp0)=>tmp1 = tmp0")
    assert (label, edits) == ("no sigmoid", [("tmp1 = tl.sigmoid(tmp0)", "tmp1 = tmp0")])
    assert "tl.sigmoid" not in bench.edited(source, edits)
    with pytest.raises(SystemExit, match="occurs 0 times"):
        bench.edited(source, [("tmp9", "tmp8")])
    for bad in ("no name", ":a=>b", "x:a"):
        with pytest.raises(SystemExit, match="--variant takes"):
            bench.parse_variant(bad)
    # a full name is taken as itself, though a longer name contains it
    longer = DUMP.replace("fused_mul_0", "fused_mul_01")
    assert (
        bench.kernel_source(DUMP + longer, "triton_poi_fused_mul_0")[0] == "triton_poi_fused_mul_0"
    )
    with pytest.raises(SystemExit, match="2 kernels match"):
        bench.kernel_source(DUMP + longer, "fused_mul")
    assert bench.parse_blocks("XBLOCK=64,YBLOCK=32") == {"XBLOCK": 64, "YBLOCK": 32}
    with pytest.raises(SystemExit, match="--blocks takes"):
        bench.parse_blocks("XBLOCK=big")


def test_opcode_counts_leave_out_padding(bench):
    listing = "\n".join([
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        "        /*0010*/              @!P0 FSETP.GT.AND P1, PT, R2, RZ, PT ;",
        "        /*0020*/                   EXIT ;",
        "        /*0030*/                   BRA 0x30;",
        "        /*0040*/                   NOP;",
        "        /*10000*/                  NOP;",
    ])  # fmt: skip
    assert bench.opcode_counts(listing) == {"LDC": 1, "FSETP": 1, "EXIT": 1}


def test_a_variant_without_an_operation_counts_fewer_instructions(bench, tmp_path):
    pytest.importorskip("triton")
    dump = tmp_path / "dump.py"
    dump.write_text(DUMP)
    variant = "no sigmoid:tmp1 = tl.sigmoid(tmp0)=>tmp1 = tmp0"
    bench.main([str(dump), "fused_mul", "--blocks", "XBLOCK=256", "--warps", "1",
                "--variant", variant, "--out-dir", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("sass_count_*.json")
    base, no_sigmoid = json.loads(path.read_text())
    assert (base["variant"], no_sigmoid["variant"]) == ("as dumped", "no sigmoid")
    assert base["elements_per_thread"] == 8 and base["opcodes"].get("MUFU", 0) >= 2
    assert "MUFU" not in no_sigmoid["opcodes"]
    assert no_sigmoid["sass_per_thread"] < base["sass_per_thread"]
