"""benchmarks/weight_blocks_probe.py: the block's weight shapes, and the CPU smoke run of the
eager forms (the Triton forms need a GPU)."""

from __future__ import annotations

import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("weight_blocks_probe")


def test_weight_shapes_of_a_block(bench):
    assert bench.weight_shapes("1.3B") == [
        ("q, k, v, o", 2048, 2048), ("gate, up", 5632, 2048), ("down", 2048, 5632)
    ]  # fmt: skip


def test_the_cpu_smoke_run(bench, capsys):
    bench.main(["--device", "cpu"])
    assert "the eager forms agree" in capsys.readouterr().out


def test_the_cpu_smoke_run_with_tensor_scales(bench, capsys):
    bench.main(["--device", "cpu", "--granularity", "tensor"])
    assert "the eager forms agree" in capsys.readouterr().out


def test_the_cpu_smoke_run_with_row_scales(bench, capsys):
    bench.main(["--device", "cpu", "--granularity", "rows"])
    assert "the eager forms agree" in capsys.readouterr().out
