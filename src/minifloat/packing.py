"""Bit-level storage of quantized values: 4-bit formats two per byte, 8-bit formats one per byte.

E2M1's 4-bit codes are sign | 3-bit index into its grid, the layout of OCP MX FP4 and of
`torch.float4_e2m1fn_x2`; the first element of each pair sits in the low nibble. Packing is a
storage concern only: values go in and come out exactly.
"""

from __future__ import annotations

import torch

from minifloat.formats import ElementFormat

__all__ = ["pack_values", "unpack_values", "storage_dtype"]

_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


def storage_dtype(fmt: ElementFormat) -> torch.dtype:
    """The dtype `pack_values` produces for `fmt`."""
    if fmt.name in _FLOAT8:
        return _FLOAT8[fmt.name]
    if fmt.name == "int8":
        return torch.int8
    if fmt.bits == 4:
        return _FP4_X2 if (fmt.name == "e2m1" and _FP4_X2 is not None) else torch.uint8
    raise ValueError(f"no packed storage for format {fmt.name!r}")


def _codes(values: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """4-bit codes: bit 3 the sign, bits 0-2 the index of |value| in the grid (NaN -> 0)."""
    grid = fmt.grid.to(device=values.device, dtype=torch.float32)
    mag = torch.nan_to_num(values.abs(), nan=0.0)
    index = torch.searchsorted(grid, mag.contiguous())
    if bool((grid[index.clamp(max=grid.numel() - 1)] != mag).any()):
        raise ValueError(f"values are not on the {fmt.name} grid")
    sign = torch.signbit(values) & ~torch.isnan(values)
    return (index | (sign.to(torch.int64) << 3)).to(torch.uint8)


def pack_values(values: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Pack grid values (float32) into `storage_dtype(fmt)`; 4-bit rows of odd length are padded."""
    dtype = storage_dtype(fmt)
    if fmt.bits == 8:
        return values.to(dtype)
    codes = _codes(values, fmt)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(dtype) if dtype != torch.uint8 else packed


def unpack_values(data: torch.Tensor, fmt: ElementFormat, shape: torch.Size) -> torch.Tensor:
    """Inverse of `pack_values`: float32 grid values of `shape`."""
    if fmt.bits == 8:
        return data.float().reshape(shape)
    raw = data.view(torch.uint8)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)[..., : shape[-1]]
    grid = fmt.grid.to(device=data.device, dtype=torch.float32)
    mag = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag).reshape(shape)
