"""`interpreted`: a test that runs a Triton kernel on the CPU, in Triton's interpreter.

`make interpret-test` installs Triton beside the virtual environment (CPU torch does not
bring it) and runs these with TRITON_INTERPRET=1; `make test` runs them the same way after the
suite. Elsewhere they are skipped. The interpreter computes the kernel's indexing, masks,
reductions and stores as the GPU does, but not its rounding: its FP8 casts round by a rule of
their own (ties away from zero, no subnormal rounding), so these tests use inputs whose results
need none, and the GPU tests beside them check the rest. Not covered here: RoPE's backward
(`libdevice.mul_rn` and `add_rn`, which the interpreter lacks) and the fused AdamW (its FP8
moments are rounded values), GPU-tested only."""

import os

import pytest

_skip = pytest.mark.skipif(
    not os.environ.get("TRITON_INTERPRET"), reason="needs TRITON_INTERPRET=1 and Triton"
)


def interpreted(test):
    """Mark `test` `interpret` (selected by `pytest -m interpret`) and skip it unless
    TRITON_INTERPRET is set."""
    return pytest.mark.interpret(_skip(test))
