"""A tiled 2-D transpose in Triton, the CUDA body of `kernels/transpose.py`'s op.

Each program loads a BLOCK_R x BLOCK_C tile row-major (coalesced, 16-byte vector loads) and
stores its transpose; Triton routes the tile through shared memory so that the stores are
coalesced too. Elements are moved as unsigned integers of their width, so any dtype works and
the copy is bit-exact. Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["transpose_2d", "unpack_e2m1_t_2d", "TILES"]

# (BLOCK_R, BLOCK_C, num_warps) by element size in bytes: the best mean over the 1.3B / 7B
# operand shapes of benchmarks/transpose_bench.py on an H200 (82 % of copy bandwidth for FP8
# bytes, 79 % for bf16; benchmarks/results/transpose_h200_2026-11-23.md). 4 bytes: untuned.
TILES: dict[int, tuple[int, int, int]] = {1: (64, 128, 4), 2: (64, 128, 4), 4: (64, 64, 4)}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _transpose_kernel(
    src, dst, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # pragma: no cover - runs on the GPU
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(src + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask)
    out_mask = (c[:, None] < cols) & (r[None, :] < rows)
    tl.store(dst + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=out_mask)


def transpose_2d(
    x: torch.Tensor, tile: tuple[int, int, int] | None = None, *, traced: bool = False
) -> torch.Tensor:  # pragma: no cover - runs on the GPU
    """x.t() contiguous, for a contiguous 2-D CUDA tensor; `tile` overrides `TILES`.

    `traced`: launched through `torch.library.wrap_triton`, the body of a `triton_op` that
    torch.compile traces (kernels/transpose.py). The kernel then reads and writes x's own dtype:
    a dtype view would be one more graph node for inductor to lower. Loads and stores move
    bits (no arithmetic touches the tile), so both forms give the same bytes."""
    rows, cols = x.shape
    size = x.element_size()
    block_r, block_c, warps = tile or TILES.get(size, TILES[4])
    src = x if traced else x.view(_BITS[size])
    out = torch.empty((cols, rows), dtype=src.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    kernel = torch.library.wrap_triton(_transpose_kernel) if traced else _transpose_kernel
    kernel[grid](src, out, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out.view(x.dtype)


@triton.jit
def _e2m1_code_to_e4m3_byte(code):  # pragma: no cover - runs on the GPU
    """E2M1 code (sign << 3 | grid index) -> the E4M3 byte of the same value (-0 for code 8)."""
    index = code & 0x7
    # grid {0, .5, 1, 1.5, 2, 3, 4, 6}: E4M3 bytes 0x00, 0x30, then 0x38 + 4 per step
    mag = tl.where(index == 0, 0, tl.where(index == 1, 0x30, 0x38 + (index - 2) * 4))
    return (mag | ((code & 0x8) << 4)).to(tl.uint8)


@triton.jit
def _unpack_e2m1_t_kernel(
    src, dst, rows, cols, pcols, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr
):  # pragma: no cover - runs on the GPU
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = (r[:, None] < rows) & (p[None, :] < pcols)
    packed = tl.load(src + r[:, None].to(tl.int64) * pcols + p[None, :], mask=mask, other=0)
    lo = tl.trans(_e2m1_code_to_e4m3_byte(packed & 0xF))  # column 2p of the unpacked operand
    hi = tl.trans(_e2m1_code_to_e4m3_byte(packed >> 4))  # column 2p + 1
    c = 2 * p[:, None].to(tl.int64)
    in_rows = r[None, :] < rows
    tl.store(dst + c * rows + r[None, :], lo, mask=(c < cols) & in_rows)
    tl.store(dst + (c + 1) * rows + r[None, :], hi, mask=(c + 1 < cols) & in_rows)


def unpack_e2m1_t_2d(
    packed: torch.Tensor, cols: int, tile: tuple[int, int, int] = (64, 64, 4)
) -> torch.Tensor:  # pragma: no cover - runs on the GPU
    """E2M1 codes [rows, ceil(cols/2)] (contiguous uint8, CUDA) -> float8_e4m3fn [cols, rows],
    the unpacked values transposed; `tile` is (BLOCK_R, BLOCK_P packed columns, num_warps)."""
    rows, pcols = packed.shape
    block_r, block_p, warps = tile
    out = torch.empty((cols, rows), dtype=torch.uint8, device=packed.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(pcols, block_p))
    _unpack_e2m1_t_kernel[grid](packed, out, rows, cols, pcols, BLOCK_R=block_r,
                                BLOCK_P=block_p, num_warps=warps)  # fmt: skip
    return out.view(torch.float8_e4m3fn)
