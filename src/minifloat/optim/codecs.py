"""Storage formats for optimizer states: how a moment tensor is kept between steps.

AdamW decodes each moment to fp32, updates it in fp32 and encodes it again, so a format only
decides what is *stored*. Scaled formats keep one fp32 `_scale` per block of `block_size`
consecutive elements of the flattened tensor; the scale is recomputed from the block's absmax at
every encode, so values never overflow between steps. The sqrt-domain format stores sqrt(v) for
the second moment: it halves the number of binades the 8-bit grid must cover.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minifloat.exact import div_rn, sqrt_eager
from minifloat.formats import check_random_source

__all__ = [
    "STATE_FORMATS",
    "StateFormat",
    "draw_bf16_noise",
    "get_state_format",
    "stochastic_round_bf16",
    "stochastic_round_e4m3",
]

# Largest block a scaled state may use. Every moment is padded to whole blocks, so a block far
# beyond a parameter's size allocates a block per tensor (block_size=1e9 was an OOM kill), while
# the scales it saves are negligible long before: 4 / 2**16 = 6e-5 bytes per element.
MAX_BLOCK_SIZE = 2**16

_E4M3_MAX = 448.0
_FP16_MAX = 65504.0
_E4M3_MAX_BITS = 0x7E  # bit pattern of +448, the largest finite e4m3 magnitude


@dataclass(frozen=True, kw_only=True)
class StateFormat:
    """One way of storing an optimizer moment.

    storage_dtype: dtype of the stored payload; scaled: per-block absmax scale (payload is the
    flattened tensor padded to whole blocks, shape [n_blocks, block_size]); sqrt_domain: store
    sqrt(x) (x must be >= 0); stochastic: round the payload stochastically (e4m3 only).
    """

    name: str
    storage_dtype: torch.dtype
    scaled: bool = False
    sqrt_domain: bool = False
    stochastic: bool = False

    @property
    def element_max(self) -> float:
        return _E4M3_MAX if self.storage_dtype == torch.float8_e4m3fn else _FP16_MAX

    def bytes_per_element(self, block_size: int = 128) -> float:
        """Stored bytes per tensor element, including the fp32 block scales."""
        check_block_size(block_size)
        payload = torch.empty((), dtype=self.storage_dtype).element_size()
        return payload + (4.0 / block_size if self.scaled else 0.0)

    def encode(
        self,
        x: torch.Tensor,
        *,
        block_size: int = 128,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encode fp32 `x` -> (payload, scale or None). Non-finite values stay non-finite.

        Stochastic formats draw their uniforms from `generator`, or take them pre-drawn as
        `noise` (what :meth:`draw_noise` returns from the same generator: identical results).
        """
        if not self.scaled:
            return x.to(self.storage_dtype), None
        check_block_size(block_size)
        hp = x.float()
        if self.sqrt_domain:
            hp = sqrt_eager(hp)  # torch.sqrt, with eager's bits when compiled (exact.py)
        blocks = _to_blocks(hp, block_size)
        amax = blocks.abs().amax(dim=1, keepdim=True)
        # All-zero blocks get scale 1 (DESIGN.md). An inf amax makes the scale inf, so the
        # whole block decodes to nan/inf; a NaN amax fails `amax > 0` and gets scale 1, and the
        # NaN entries stay NaN: either way the step guard can see it.
        # Both divisions through div_rn: Triton divides approximately (exact.py), so compiled
        # code would otherwise differ from eager; div_rn differs from `/` only for subnormal
        # quotients (a zero payload anyway). div_rn_by_scale measured slower here (docs/optim.md).
        raw = div_rn(amax, torch.full_like(amax, self.element_max))
        scale = torch.where(amax > 0, raw, torch.ones_like(amax))
        scaled = div_rn(blocks, scale).clamp(-self.element_max, self.element_max)
        if self.stochastic:
            payload = stochastic_round_e4m3(scaled, generator=generator, noise=noise)
        else:
            payload = scaled.to(self.storage_dtype)
        return payload, scale.squeeze(1)

    def draw_noise(
        self, numel: int, device: torch.device, generator: torch.Generator, *, block_size: int = 128
    ) -> torch.Tensor | None:
        """The uniforms :meth:`encode` would draw from `generator` for `numel` elements (one per
        padded payload element), or None for a format that rounds to nearest."""
        if not self.stochastic:
            return None
        check_block_size(block_size)
        shape = (-(-numel // block_size), block_size)
        return torch.rand(shape, device=device, generator=generator)

    @property
    def smallest(self) -> float:
        """Smallest positive payload value (the subnormal minimum)."""
        return torch.finfo(self.storage_dtype).smallest_normal * torch.finfo(self.storage_dtype).eps

    def decode(
        self,
        payload: torch.Tensor,
        scale: torch.Tensor | None,
        shape: torch.Size,
        *,
        floor_underflow: bool = False,
    ) -> torch.Tensor:
        """Decode a stored payload back to an fp32 tensor of `shape`.

        floor_underflow: decode zeros of a scaled payload as its smallest positive value times
        the block scale. For Adam's second moment: a v that underflowed to 0 beside a non-zero
        m would turn the update into m / eps; with the floor the update stays bounded (a true
        v below the floor has |m| below sqrt(floor) too), erring on the small side.
        """
        shape = torch.Size(shape)
        if not self.scaled:
            return payload.float().view(shape)
        if not torch.compiler.is_compiling():  # eager only: no symbolic-shape guards
            _check_scaled_payload(payload, scale, shape)
        values = payload.float()
        if floor_underflow:
            # Only in blocks with a non-zero entry: an all-zero block (scale 1 by convention)
            # holds exact zeros, e.g. parameters that never received a gradient.
            live = values.abs().amax(dim=1, keepdim=True) > 0
            values = torch.where((values == 0) & live, self.smallest, values)
        numel = shape.numel()
        hp = (values * scale.unsqueeze(1)).reshape(-1)[:numel].view(shape)
        return hp.square() if self.sqrt_domain else hp

    def zeros(
        self, shape: torch.Size, device: torch.device, *, block_size: int = 128
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoded all-zero state."""
        return self.encode(torch.zeros(shape, device=device), block_size=block_size)


STATE_FORMATS: dict[str, StateFormat] = {
    f.name: f
    for f in (
        StateFormat(name="fp32", storage_dtype=torch.float32),
        StateFormat(name="bf16", storage_dtype=torch.bfloat16),
        # fp16 with block scales: plain fp16 flushes second moments below ~6e-8 (gradients
        # below ~2e-4) to zero, and m / (sqrt(0) + eps) then explodes.
        StateFormat(name="fp16", storage_dtype=torch.float16, scaled=True),
        StateFormat(name="fp8", storage_dtype=torch.float8_e4m3fn, scaled=True),
        StateFormat(name="fp8-sr", storage_dtype=torch.float8_e4m3fn, scaled=True, stochastic=True),
        StateFormat(
            name="fp8-sqrt", storage_dtype=torch.float8_e4m3fn, scaled=True, sqrt_domain=True
        ),
        StateFormat(
            name="fp8-sqrt-sr",
            storage_dtype=torch.float8_e4m3fn,
            scaled=True,
            sqrt_domain=True,
            stochastic=True,
        ),
    )
}


def check_block_size(block_size: object) -> None:
    """ValueError unless `block_size` is an int in [1, MAX_BLOCK_SIZE] (bool is not an int)."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or not 1 <= block_size <= MAX_BLOCK_SIZE
    ):
        raise ValueError(
            f"block_size must be a positive int <= {MAX_BLOCK_SIZE} (2**16; every moment is "
            f"padded to whole blocks), got {block_size!r}"
        )


def _check_scaled_payload(
    payload: torch.Tensor, scale: torch.Tensor | None, shape: torch.Size
) -> None:
    """A scaled payload [n_blocks, block_size] must hold `shape`'s elements in its blocks, the
    last one padded: a larger shape would read the padding as values, a smaller one drop some."""
    if payload.dim() != 2 or scale is None or scale.shape != payload.shape[:1]:
        got = None if scale is None else tuple(scale.shape)
        raise ValueError(
            f"a scaled payload is [n_blocks, block_size] with scales [n_blocks], got payload "
            f"{tuple(payload.shape)} and scale {got}"
        )
    blocks, block_size = payload.shape
    if not (blocks - 1) * block_size < shape.numel() <= blocks * block_size:
        raise ValueError(
            f"shape {tuple(shape)} ({shape.numel()} elements) does not fit a payload of "
            f"{blocks} blocks of {block_size}"
        )


def get_state_format(name: str) -> StateFormat:
    """Look up a state format by name; unknown names raise ValueError listing the valid ones."""
    try:
        return STATE_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer state format {name!r}; choose one of {sorted(STATE_FORMATS)}"
        ) from None


def _to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block_size
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def stochastic_round_e4m3(
    x: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round fp32 `x` (|x| <= 448) to e4m3 stochastically: up with probability equal to the
    fractional distance to the next grid point, so the rounding is unbiased.

    noise: pre-drawn uniforms in [0, 1) shaped like `x` (else drawn from `generator`).

    Positive e4m3 bit patterns are consecutive grid points (subnormals included), so the two
    neighbours of a value are its round-to-nearest result and the pattern one step away.
    """
    check_random_source(generator, noise, x)
    mag = x.abs()
    nearest = mag.to(torch.float8_e4m3fn)
    bits = nearest.view(torch.uint8).to(torch.int16)
    lo_bits = torch.where(nearest.float() > mag, bits - 1, bits)
    hi_bits = (lo_bits + 1).clamp(max=_E4M3_MAX_BITS)
    lo = lo_bits.to(torch.uint8).view(torch.float8_e4m3fn).float()
    hi = hi_bits.to(torch.uint8).view(torch.float8_e4m3fn).float()
    gap = hi - lo
    frac = torch.where(gap > 0, (mag - lo) / gap, torch.zeros_like(mag))
    u = torch.rand(x.shape, device=x.device, generator=generator) if noise is None else noise
    rounded = torch.where(u < frac, hi, lo).copysign(x)
    return torch.where(torch.isnan(x), x, rounded).to(torch.float8_e4m3fn)


def stochastic_round_bf16(
    x: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round fp32 `x` to bf16 stochastically (unbiased): add uniform noise below the 16 bits
    bf16 keeps, then truncate. Non-finite values pass through unchanged.

    noise: pre-drawn int32 values in [0, 2^16) shaped like `x` (else drawn from `generator`,
    as :func:`draw_bf16_noise` draws them)."""
    check_random_source(generator, noise, x, (torch.int32,))
    bits = x.float().view(torch.int32)
    if noise is None:
        noise = draw_bf16_noise(x.shape, x.device, generator)
    truncated = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), truncated, x).to(torch.bfloat16)


def draw_bf16_noise(
    shape: torch.Size | tuple[int, ...], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """The int32 noise :func:`stochastic_round_bf16` adds below bf16's 16 kept bits."""
    return torch.randint(0, 1 << 16, shape, device=device, dtype=torch.int32, generator=generator)
