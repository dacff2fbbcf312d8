"""benchmarks/fused_gemm_probe.py: the grouped form of a block's q/k/v and gate/up GEMMs computes
what its separate form does (same operand formats), and the CPU smoke run builds every form."""

from __future__ import annotations

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("fused_gemm_probe")


def test_groups_are_the_linears_that_share_an_input(bench):
    got = bench.groups("1.3B")
    assert got == {"qkv": [(2048, 2048)] * 3, "gate_up": [(5632, 2048)] * 2}


@pytest.mark.parametrize("recipe", ["bf16", "fp8-rowwise"])
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_fused_form_has_the_separate_forms_shape(bench, recipe, gemm):
    """The two forms are timed on their own random operands, so only shapes and dtypes can agree:
    fused outputs stack the members' (fprop along columns, wgrad along rows), dgrad's is the
    members' summed dx."""
    m, members = 32, [(48, 64), (80, 64)]
    separate, fused = bench.forms(recipe, gemm, m, members, "cpu")
    parts, whole = separate(), fused()
    if gemm == "dgrad":
        assert parts.shape == whole.shape == (m, 64) and parts.dtype == whole.dtype
        return
    dim = 1 if gemm == "fprop" else 0
    assert torch.cat(parts, dim).shape == whole.shape and parts[0].dtype == whole.dtype


def test_the_cpu_smoke_run(bench, capsys):
    bench.main(["--device", "cpu", "--recipes", "bf16,fp8-rowwise"])
    assert "every form built and run once" in capsys.readouterr().out
