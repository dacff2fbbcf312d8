"""Bit-level storage of quantized values: 4-bit formats two per byte, 8-bit formats one per byte.

E2M1's 4-bit codes are sign | 3-bit index into its grid, the layout of OCP MX FP4 and of
`torch.float4_e2m1fn_x2`; the first element of each pair sits in the low nibble. Packing is a
storage concern only: values go in and come out exactly.
"""

from __future__ import annotations

import torch

from minifloat import formats
from minifloat.formats import ElementFormat

__all__ = ["pack_values", "unpack_values", "storage_dtype"]

_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


def storage_dtype(fmt: str | ElementFormat) -> torch.dtype:
    """The dtype `pack_values` produces for `fmt`."""
    fmt = formats.get(fmt)
    if fmt.name in _FLOAT8:
        return _FLOAT8[fmt.name]
    if fmt.name == "int8":
        return torch.int8
    if fmt.bits == 4:
        return _FP4_X2 if (fmt.name == "e2m1" and _FP4_X2 is not None) else torch.uint8
    raise ValueError(f"no packed storage for format {fmt.name!r}")


def _check_on_grid(values: torch.Tensor, fmt: ElementFormat) -> None:
    """ValueError unless every value is on `fmt`'s grid or NaN (one pass: packing is storage,
    not a hot path; an 8-bit cast would round, saturate or, for int8, wrap around silently)."""
    on_grid = fmt.is_on_grid(values) | torch.isnan(values)
    if not bool(on_grid.all()):
        raise ValueError(f"values are not on the {fmt.name} grid")


def _codes(values: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """4-bit codes: bit 3 the sign, bits 0-2 the index of |value| in the grid (NaN -> 0)."""
    grid = fmt.grid.to(device=values.device, dtype=torch.float32)
    mag = torch.nan_to_num(values.abs(), nan=0.0)
    index = torch.searchsorted(grid, mag.contiguous())
    if bool((grid[index.clamp(max=grid.numel() - 1)] != mag).any()):
        raise ValueError(f"values are not on the {fmt.name} grid")
    sign = torch.signbit(values) & ~torch.isnan(values)
    return (index | (sign.to(torch.int64) << 3)).to(torch.uint8)


def pack_values(values: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Pack grid values (float32) into `storage_dtype(fmt)`; 4-bit rows of odd length are padded.
    ValueError for values off the grid (±inf included; NaN is kept where the format has a NaN
    code, else stored as 0) and for 0-dim 4-bit values (they are packed by rows)."""
    fmt = formats.get(fmt)
    dtype = storage_dtype(fmt)
    if not values.is_floating_point():
        raise TypeError(f"pack_values takes floating-point grid values, got {values.dtype}")
    if fmt.bits == 8:
        _check_on_grid(values, fmt)
        return values.to(dtype)
    if values.dim() == 0:
        raise ValueError(
            f"pack_values needs at least 1-D values for {fmt.name}, got a 0-dim tensor"
        )
    codes = _codes(values, fmt)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(dtype) if dtype != torch.uint8 else packed


def unpack_values(data: torch.Tensor, fmt: ElementFormat, shape: torch.Size) -> torch.Tensor:
    """Inverse of `pack_values`: float32 grid values of `shape` (the unpacked values' shape).
    ValueError when `data` is not what `pack_values` makes of values of that shape."""
    fmt = formats.get(fmt)
    shape = torch.Size(shape)
    _check_packed(data, fmt, shape)
    if fmt.bits == 8:
        return data.float().reshape(shape)
    raw = data.view(torch.uint8)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)[..., : shape[-1]]
    grid = fmt.grid.to(device=data.device, dtype=torch.float32)
    mag = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag).reshape(shape)


def _check_packed(data: torch.Tensor, fmt: ElementFormat, shape: torch.Size) -> None:
    """`data` must have `pack_values`' dtype and shape for values of `shape`: other bytes would
    be read as codes (float32 data as four codes an element), and a `shape` whose rows are
    shorter than the packed rows would drop values silently."""
    dtype = storage_dtype(fmt)
    allowed = (dtype, torch.uint8) if fmt.bits == 4 else (dtype,)
    if data.dtype not in allowed:
        raise ValueError(f"{fmt.name} data must be {dtype}, got {data.dtype}")
    if fmt.bits == 4:
        want = (*shape[:-1], -(-shape[-1] // 2)) if len(shape) else None
        ok = want is not None and tuple(data.shape) == want
    else:
        ok = data.numel() == shape.numel()
    if not ok:
        raise ValueError(
            f"{fmt.name} data of shape {tuple(data.shape)} does not hold values of shape "
            f"{tuple(shape)}"
        )
