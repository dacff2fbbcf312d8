"""kernels/backend.py: the QOperand record and its constructor for float32-scaled operands."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minifloat.kernels import EmulatedBackend
from minifloat.kernels.backend import QOperand, fp32_scaled
from minifloat.recipes import OperandSpec


def test_qoperand_fields_have_no_defaults():
    # A default left in place inside a compiled graph costs a Python guard a call under torch
    # 2.11 (QOperand's docstring): every construction names every field.
    for f in dataclasses.fields(QOperand):
        assert f.default is dataclasses.MISSING, f.name
        assert f.default_factory is dataclasses.MISSING, f.name


def test_fp32_scaled_fills_the_plain_fields():
    data, scale, m = torch.ones(2, 4), torch.full((2, 1), 0.5), torch.full((2, 1), 2.0)
    q = fp32_scaled(data, scale, "e4m3", "row", True, m)
    assert (q.tensor_scale, q.scale_format, q.transposed, q.multiplier) == (None, "fp32", True, m)
    assert fp32_scaled(data, scale, "e4m3", "row", False).multiplier is None
    assert torch.equal(q.dequantize(), torch.full((2, 4), 0.5))


def test_emulated_scaled_mm_refuses_a_non_float_out_dtype():
    # torch.int32 truncated the product silently; "bfloat16" failed as a device string
    backend, spec = EmulatedBackend(), OperandSpec(fmt="e4m3", granularity="row")
    a, b = backend.quantize(torch.randn(8, 32), spec), backend.quantize(torch.randn(4, 32), spec)
    for out_dtype in (torch.int32, "bfloat16", None):
        with pytest.raises(TypeError, match="out_dtype must be a floating torch.dtype"):
            backend.scaled_mm(a, b, out_dtype=out_dtype)
