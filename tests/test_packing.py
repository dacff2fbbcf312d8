"""QTensor.pack()/unpack(): exact round trips in each format's bit width."""

import math

import pytest
import torch

from minifloat import formats
from minifloat.packing import pack_values, storage_dtype, unpack_values
from minifloat.quantize import quantize


@pytest.mark.parametrize("fmt", ["e2m1", "e1m2", "e3m0", "int4", "e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("shape", [(6, 10), (3, 7), (2, 3, 33)])
@pytest.mark.parametrize("granularity", ["row", (1, 16)])
def test_pack_unpack_exact(fmt, shape, granularity):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    x.view(-1)[0] = math.nan  # one NaN group must survive the round trip
    q = quantize(x, fmt, granularity)
    p = q.pack()
    assert p.data.dtype == storage_dtype(formats.get(fmt))
    u = p.unpack()
    assert torch.equal(torch.isnan(u.values), torch.isnan(q.values))
    ok = ~torch.isnan(q.values)
    assert torch.equal(u.values[ok], q.values[ok])
    assert torch.equal(u.scale.nan_to_num(-1), q.scale.nan_to_num(-1))
    bits = formats.get(fmt).bits
    assert p.data.numel() * p.data.element_size() == math.prod(shape[:-1]) * (
        (shape[-1] * bits + 7) // 8 if bits == 8 else (shape[-1] + 1) // 2
    )


def test_e2m1_codes_follow_mx_layout():
    q = quantize(torch.tensor([[0.5, -6.0, 1.0, -0.0]]), "e2m1", "tensor", scale_format="fp32")
    raw = q.pack().data.view(torch.uint8)
    # 0.5/1 -> 0.5 (code 1) low nibble, -6 (code 8|7) high nibble; then 1.0 (code 2) and -0 (8).
    assert raw.tolist() == [[0x1 | (0xF << 4), 0x2 | (0x8 << 4)]]


def test_pack_rejects_values_off_grid():
    from minifloat.packing import pack_values

    with pytest.raises(ValueError, match="grid"):
        pack_values(torch.tensor([0.7]), formats.get("e2m1"))


@pytest.mark.parametrize(
    ("fmt", "value"), [("int8", 200.0), ("int8", 1.5), ("e4m3", 1.03), ("e4m3", 500.0)]
)
def test_pack_refuses_8bit_values_off_the_grid(fmt, value):
    # the cast rounded or saturated them, and int8 wrapped 200 around to -56
    with pytest.raises(ValueError, match="not on the"):
        pack_values(torch.tensor([1.0, value]), formats.get(fmt))


def test_pack_keeps_8bit_nan_and_takes_format_names():
    packed = pack_values(torch.tensor([1.0, math.nan]), "e4m3")
    assert packed.dtype == storage_dtype("e4m3") and math.isnan(packed[1].float())


def test_pack_refuses_0dim_4bit_values():
    with pytest.raises(ValueError, match="at least 1-D"):
        pack_values(torch.tensor(1.5), formats.get("e2m1"))


@pytest.mark.parametrize(
    ("data", "shape"),
    [
        (torch.zeros(2, 2, dtype=torch.uint8), (2, 2)),  # rows of 4 values read as rows of 2
        (torch.zeros(2, 2, dtype=torch.uint8), (4, 2)),
        (torch.zeros(2, dtype=torch.float32), (8,)),  # float32 bytes read as codes
    ],
)
def test_unpack_refuses_data_not_of_shape(data, shape):
    with pytest.raises(ValueError, match="e2m1 data"):
        unpack_values(data, formats.get("e2m1"), shape)


def test_unpack_refuses_8bit_data_of_another_dtype():
    with pytest.raises(ValueError, match="e4m3 data must be"):
        unpack_values(torch.ones(4), formats.get("e4m3"), (4,))
