"""Order statistics by radix select in Triton, the CUDA body of `kernels/quantiles.py`'s op.

A quantile needs two order statistics of the finite entries (ranks lo and lo + 1 for linear
interpolation), not a sorted copy. The entries' float32 bits are mapped to unsigned keys that
order as the values do, and BITS of the key are decided per pass, from the top: a histogram of
the digit over the entries whose higher digits match those decided so far, and the bin holding
the wanted rank fixes the digit. 32 / BITS passes, each one kernel over chunks of the input
(CHUNK entries a program, `tl.histogram`, then one atomic add per non-empty bin into a global
histogram); each program of a pass re-derives the digits decided so far from the earlier
passes' histograms (BITS-wide cumulative sums), and a last one-program kernel writes the
values. bf16 entries need only the top 16 bits of their keys (every entry of one value has
the same low half), so 16 / BITS passes decide them (session 74). torch.sort of a ~64K-entry
threshold sample launches ~6 CUB kernels and memsets, and a reduction and an index kernel
around them pick the two entries (docs/hopper_sessions.md, session 67). One program per
order statistic, looping over the whole input, ran 3.4x slower than the sort at 65,536
entries (likely: `tl.histogram`'s counts of a few crowded bins serialise): hence the chunks.

The first pass's histogram counts the finite entries n, from which the later passes compute
each rank as the sort path does (`quantize._quantiles_by_sort`, float64): pos = (n - 1) q,
lo = floor(pos), ranks lo and min(lo + 1, n - 1), frac = float32(pos - lo). An order statistic
does not depend on how it is found, so the values equal the sort's, except that both zeros map
to one key and come back as +0.0 (the sort and kthvalue paths may differ in that sign already).
After a configuration's first call its compiled kernels are launched directly (`_LAUNCHERS`),
without Triton's per-launch binding: ~100 us of host a call less (session 71).
Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

__all__ = ["order_statistics", "BITS", "CHUNK", "WARPS"]

# Digit width, entries per program, warps per program: the best of seven configurations from
# 262,144 entries up, 1.7 us behind the best at 65,536 (a threshold sample) and ~4 us at 4,096
# to 16,384 (benchmarks/results/quantile_select_s67_chunks_*); 4-bit digits (8 passes) were
# slower everywhere.
BITS, CHUNK, WARPS = 8, 2048, 4


@triton.jit
def _key(v):  # pragma: no cover - runs on the GPU
    """float32 -> uint32 key with the values' order (-0.0 and +0.0 share the key of +0.0):
    negative values' magnitude bits flipped (a signed order), then the sign bit flipped."""
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)  # by bits: a flushed subnormal is no zero
    signed = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (signed ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _value(key):  # pragma: no cover - runs on the GPU
    """The inverse of `_key`."""
    signed = key.to(tl.int32, bitcast=True) ^ -2147483648
    return tl.where(signed < 0, signed ^ 0x7FFFFFFF, signed).to(tl.float32, bitcast=True)


@triton.jit
def _rank(hist_ptr, stat, Q_LO_BITS, Q_HI_BITS, BITS: tl.constexpr):  # pragma: no cover - GPU
    """Order statistic `stat` (2 j + h: rank lo (h = 0) or lo + 1 (h = 1) of quantile j, q_lo
    for j = 0 and q_hi for j = 1, float64 given as the int64 of their bits) from pass 0's
    histogram: (n, pos, floor(pos), rank), rank clamped into [0, n - 1]."""
    j = stat // 2
    q_bits = tl.where(j == 0, tl.full((), Q_LO_BITS, tl.int64), tl.full((), Q_HI_BITS, tl.int64))
    n = tl.sum(tl.load(hist_ptr + tl.arange(0, 1 << BITS)), 0)
    pos = (n - 1).to(tl.float64) * q_bits.to(tl.float64, bitcast=True)
    lo = tl.floor(pos)
    rank = tl.minimum(tl.maximum(lo.to(tl.int32) + stat % 2, 0), tl.maximum(n - 1, 0))
    return n, pos, lo, rank


@triton.jit
def _row(p, stat):  # pragma: no cover - runs on the GPU
    """Pass p's histogram row for order statistic `stat`: pass 0's (over all finite entries)
    is one row, shared; later passes have one per statistic."""
    return 0 if p == 0 else p * 4 + stat


@triton.jit
def _descend(hist_ptr, stat, rank, PASSES: tl.constexpr, BITS: tl.constexpr):  # pragma: no cover
    """The key digits fixed by passes 0 .. PASSES-1 for `rank` (histograms [pass, stat, bin];
    pass 0's, over all finite entries, is stat 0's row), and the rank left within them. With no
    finite entry a digit comes out as 2^BITS and spoils the prefix: the callers then write NaN."""
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.full((), 0, tl.uint32)
    for p in tl.static_range(PASSES):
        hist = tl.load(hist_ptr + _row(p, stat) * (1 << BITS) + bins)
        digit = tl.sum((tl.cumsum(hist, 0) <= rank).to(tl.int32), 0)
        rank = rank - tl.sum(tl.where(bins < digit, hist, 0), 0)
        prefix = (prefix << BITS) | digit.to(tl.uint32)
    return prefix, rank


# Nothing specialised on the entry count's value or the pointers' alignment: the kernels compiled
# for one call then serve every call of the same dtype and device (`_LAUNCHERS`).
@triton.jit(do_not_specialize=["numel"], do_not_specialize_on_alignment=["x_ptr", "hist_ptr"])
def _pass_kernel(
    x_ptr,
    hist_ptr,
    numel,
    Q_LO_BITS: tl.constexpr,
    Q_HI_BITS: tl.constexpr,
    PASS: tl.constexpr,
    BITS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # pragma: no cover - runs on the GPU
    # program (c, stat): chunk c's histogram of the digit PASS for order statistic `stat`
    # (pass 0: one statistic, all finite entries), added into the global histogram
    stat = tl.program_id(1)
    prefix = tl.full((), 0, tl.uint32)
    if PASS > 0:
        _, _, _, rank = _rank(hist_ptr, stat, Q_LO_BITS, Q_HI_BITS, BITS)
        prefix, _ = _descend(hist_ptr, stat, rank, PASS, BITS)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    inside = offs < numel
    v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    key = _key(v)
    keep = inside & (tl.abs(v) < float("inf"))  # finite: NaN fails the comparison too
    shift: tl.constexpr = 32 - (PASS + 1) * BITS
    if PASS > 0:
        keep = keep & ((key >> (shift + BITS)) == prefix)
    digit = ((key >> shift) & ((1 << BITS) - 1)).to(tl.int32)
    counts = tl.histogram(digit, 1 << BITS, mask=keep)
    bins = tl.arange(0, 1 << BITS)
    row_ptr = hist_ptr + _row(PASS, stat) * (1 << BITS)
    tl.atomic_add(row_ptr + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit(do_not_specialize_on_alignment=["hist_ptr", "out_ptr"])
def _finish_kernel(
    hist_ptr,
    out_ptr,
    Q_LO_BITS: tl.constexpr,
    Q_HI_BITS: tl.constexpr,
    BITS: tl.constexpr,
    KEY_BITS: tl.constexpr,
):  # pragma: no cover - runs on the GPU
    # program stat = 2 j + h: out[j, h] = the order statistic, out[j, 2] = frac (h = 0)
    stat = tl.program_id(0)
    n, pos, lo, rank = _rank(hist_ptr, stat, Q_LO_BITS, Q_HI_BITS, BITS)
    key, _ = _descend(hist_ptr, stat, rank, KEY_BITS // BITS, BITS)
    if KEY_BITS < 32:  # the key's top KEY_BITS decided; every entry of that value has the
        # same low bits: zeros after a non-negative value's, ones after a negative's (`_key`)
        key = key << (32 - KEY_BITS)
        key = tl.where((key >> 31) == 0, key | ((1 << (32 - KEY_BITS)) - 1), key)
    tl.store(out_ptr + (stat // 2) * 3 + stat % 2, tl.where(n > 0, _value(key), float("nan")))
    if stat % 2 == 0:
        tl.store(out_ptr + (stat // 2) * 3 + 2, (pos - lo).to(tl.float32))


# The compiled kernels of one configuration, by (device, dtype, whether the entry count needs
# int64, q bits, config), launched directly (`CompiledKernel[grid]`) from the second call on:
# Triton's argument binding and cache lookup, once a launch (five with 8-bit digits, three on
# bf16), took ~100 of the ~450 us of host a call on session 71's machine (benchmarks/results/
# quantile_select_s71_host_*), 96 calls a 1.3B fp4 step. Triton's debug and instrumentation
# settings are those of the first call. Kept only where the launcher takes every parameter in
# order, constexprs included (Triton 3.6's convention; `_launchable`); else the JIT launches.
_LAUNCHERS: dict[tuple, tuple] = {}


def order_statistics(
    flat: torch.Tensor,
    q_lo_bits: int,
    q_hi_bits: int,
    *,
    config: tuple[int, int, int] | None = None,
    cached: bool = True,
) -> torch.Tensor:  # pragma: no cover - runs on the GPU
    """[2, 3] float32 (v_lo, v_hi, frac) of the finite entries of contiguous 1-D CUDA `flat`
    (any float dtype, read as float32) for the quantiles q_lo and q_hi, given as the int64 of
    their float64 bits (module docstring); NaN values when no entry is finite. bf16 entries
    take 16 / BITS passes, others 32 / BITS.

    `config`: (BITS, CHUNK, WARPS) in place of the defaults: BITS of 2, 4, 8 or 16, CHUNK a
    power of two. `cached=False` launches every kernel through Triton's JIT, as the first call
    of a configuration does (the benchmark's reference for the host's time)."""
    bits, chunk, warps = config or (BITS, CHUNK, WARPS)
    if bits not in (2, 4, 8, 16) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"config needs BITS in (2, 4, 8, 16) and a power-of-two CHUNK: {config}")
    key_bits = 16 if flat.dtype == torch.bfloat16 else 32
    passes = key_bits // bits
    hist = torch.zeros((passes, 4, 1 << bits), dtype=torch.int32, device=flat.device)
    out = torch.empty((2, 3), dtype=torch.float32, device=flat.device)
    grids = [(triton.cdiv(flat.numel(), chunk), 1 if p == 0 else 4, 1) for p in range(passes)]
    key = (flat.device, flat.dtype, flat.numel() >= 2**31, q_lo_bits, q_hi_bits, bits, chunk, warps)
    launchers = _LAUNCHERS.get(key) if cached and flat.is_cuda else None
    if launchers is None:
        kernels = _jit_launch(flat, hist, out, q_lo_bits, q_hi_bits, grids, bits, chunk, warps)
        functions = (_pass_kernel,) * passes + (_finish_kernel,)
        if flat.is_cuda and all(map(_launchable, kernels, functions)):
            _LAUNCHERS[key] = kernels
        return out
    # the launches go to the current stream of the current device, flat's (as Triton's own)
    index = flat.device.index
    guard = contextlib.nullcontext()
    if torch.cuda.current_device() != index:
        guard = torch.cuda.device(index)
    with guard:
        stream = torch._C._cuda_getCurrentRawStream(index)
        for p, kernel in enumerate(launchers[:-1]):
            kernel[grids[p]](
                flat, hist, flat.numel(), q_lo_bits, q_hi_bits, p, bits, chunk, stream=stream
            )
        launchers[-1][(4, 1, 1)](hist, out, q_lo_bits, q_hi_bits, bits, key_bits, stream=stream)
    return out


def _launchable(kernel: object, function: triton.JITFunction) -> bool:
    """Whether `kernel`, returned by a JIT launch of `function`, is a `CompiledKernel` whose
    launcher takes every parameter of `function` positionally (its signature lists them all)."""
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    return isinstance(kernel, CompiledKernel) and len(signature or ()) == len(function.arg_names)


def _jit_launch(
    flat: torch.Tensor,
    hist: torch.Tensor,
    out: torch.Tensor,
    q_lo_bits: int,
    q_hi_bits: int,
    grids: list[tuple[int, int, int]],
    bits: int,
    chunk: int,
    warps: int,
) -> tuple:  # pragma: no cover - runs on the GPU
    """The passes (one per grid) and the finish through Triton's JIT (compiling them the first
    time); returns what each launch returns: its `CompiledKernel` (None in Triton's
    interpreter)."""
    # The q's are constants, so each distinct alpha compiles its own kernels (five with 8-bit
    # digits, three on bf16): an integer argument that large is one inductor cannot pass to a
    # user kernel (torch 2.11), were the op ever traced (kernels/quantiles.py). No FMA
    # contraction (Triton's default allows it): frac = pos - lo after pos = (n - 1) q must
    # round twice, as torch's float64 ops do.
    kw = {"Q_LO_BITS": q_lo_bits, "Q_HI_BITS": q_hi_bits, "BITS": bits, "enable_fp_fusion": False}
    # Triton launches on the current device (a CPU tensor: Triton's interpreter, in tests)
    guard = torch.cuda.device(flat.device) if flat.is_cuda else contextlib.nullcontext()
    with guard:
        kernels = [
            _pass_kernel[grid](flat, hist, flat.numel(), **kw, PASS=p, CHUNK=chunk, num_warps=warps)
            for p, grid in enumerate(grids)
        ]
        key_bits = bits * len(grids)
        kernels.append(_finish_kernel[(4,)](hist, out, **kw, KEY_BITS=key_bits, num_warps=1))
    return tuple(kernels)
