"""benchmarks/recompute_custom_op_probe.py: a MUST_RECOMPUTE selective-checkpoint policy makes
the compiled partitioner recompute an opaque custom op in backward instead of saving its FP8
output (the fact a hand-written quantizer kernel would rely on; docs/hopper_sessions.md,
session 52)."""

from __future__ import annotations

import torch

from scripts import load_benchmark


def test_policy_moves_the_opaque_cast_into_backward():
    bench = load_benchmark("recompute_custom_op_probe")
    assert torch.float8_e4m3fn in bench.saved_dtypes(with_policy=False)
    assert torch.float8_e4m3fn not in bench.saved_dtypes(with_policy=True)
