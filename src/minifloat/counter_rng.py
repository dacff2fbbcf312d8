"""Counter-based random numbers for stochastic rounding and random Hadamard signs.

The FP4 micro-block recipes (nvfp4, mxfp4) draw a uniform number per gradient element (stochastic
rounding) and a random sign vector per step (the random Hadamard transform of wgrad). Both must be

- reproducible: a function of (layer, step, element) only, so a resumed run draws what the
  uninterrupted one would have drawn, and the CPU emulation draws what the GPU draws;
- bit-identical eager and compiled: `torch.rand` under inductor uses its own generator (compiled
  draws differ from eager ones), and a `torch.Generator` argument breaks dynamo's graph;
- free of process-global state: no global generator, no seed set elsewhere.

So the numbers are a hash of the element's index and a key, computed with int64 tensor ops
(exact in every backend): `h = mix(index ^ key)`, with `mix` the 32-bit integer finalizer
(x ^= x >> 16; x *= 0x45d9f3b, twice, then x ^= x >> 16; products stay below 2^59, so int64
never overflows), and the key a mixed per-step seed xor-ed with a stream constant. One `mix` per
element keeps compiled kernels small (inductor inlines every scalar step into each kernel; with
more rounds one CPU quantizer took ~35 s of CPU time to compile). The seed is a 0-dim int64
tensor, so a new step's seed never makes torch.compile recompile. A layer derives its seeds
from its `rng_state` buffer (layer salt, step count), advanced once per trained backward (see
`QuantizedGemmMixin`), and from the process's rank under torch.distributed (`process_rank`):
data-parallel ranks round their different gradients with different draws, while the buffer, the
same on every rank, stays what checkpoints save. Rank 0, and a process outside any process group,
draws what a single process draws.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "STREAMS",
    "mix",
    "derive",
    "process_rank",
    "layer_seeds",
    "uniform",
    "random_signs",
    "advance",
]

_MASK = 0xFFFFFFFF
_MUL = 0x45D9F3B

# Independent streams of one step: the dgrad and wgrad GEMMs (mixed into the layer's seeds), and
# within an operand its rounding noise and its Hadamard signs (xor-ed into an already mixed seed).
STREAMS = {"dgrad": 0x1B873593, "wgrad": 0x2C1B3C6D, "noise": 0x297A2D39, "signs": 0x68E31DA4}


def mix(x: torch.Tensor | int) -> torch.Tensor | int:
    """A bijection of 32-bit values (int64 tensors, or Python ints, holding [0, 2^32)), well
    mixed; mix(0) = 0."""
    x = (((x >> 16) ^ x) * _MUL) & _MASK
    x = (((x >> 16) ^ x) * _MUL) & _MASK
    return (x >> 16) ^ x


def derive(seed: torch.Tensor, stream: str) -> torch.Tensor:
    """The key of a named sub-stream (`STREAMS`) of a mixed `seed` (0-dim int64)."""
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; valid: {', '.join(STREAMS)}")
    return seed ^ STREAMS[stream]


def process_rank() -> int:
    """This process's rank in the default torch.distributed group; 0 when none is initialized
    (torch.compile folds it into a constant)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def layer_seeds(rng_state: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """[2] int64: the dgrad and wgrad seeds of the current step of a layer whose `rng_state` is
    (salt, step), on the process of `rank` (`process_rank()`; 0 leaves the seeds as without
    one, as `mix(0) = 0`). Computed in forward and saved, so backward uses the forward's step."""
    # int32 would overflow in the products (other seeds, silently); a float state has no bits
    if rng_state.dtype != torch.int64 or rng_state.shape != (2,):
        raise ValueError(
            f"rng_state must be int64 [2] (salt, step), got {rng_state.dtype} of shape "
            f"{tuple(rng_state.shape)}"
        )
    rank_key = mix(rank & _MASK)  # a Python int: the same operators, no tensor in the graph
    base = (((rng_state[0] & _MASK) * _MUL) & _MASK) ^ (rng_state[1] & _MASK) ^ rank_key
    return torch.stack([mix(base ^ STREAMS["dgrad"]), mix(base ^ STREAMS["wgrad"])])


def advance(rng_state: torch.Tensor) -> None:
    """Count one trained backward (in place): the next step draws new numbers."""
    rng_state[1:].add_(1)


def _is_size(n: object) -> bool:
    """An int >= 0 (a SymInt under dynamic shapes; bool is no size)."""
    return isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) and n >= 0


def _hash(key: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """32-bit hashes (int64) of the indices 0..numel-1 under `key`: one `mix` per element, so
    compiled kernels stay small. The key must be well mixed already (`layer_seeds`, `derive`):
    small consecutive keys would give overlapping streams (key k at index i = key 0 at i ^ k)."""
    if not isinstance(key, torch.Tensor) or key.numel() != 1:  # [n] keys would broadcast
        got = tuple(key.shape) if isinstance(key, torch.Tensor) else type(key).__name__
        raise ValueError(f"key must be a one-element (0-dim) int64 tensor, got {got}")
    if not _is_size(numel):
        raise ValueError(f"the number of draws must be an int >= 0, got {numel!r}")
    index = torch.arange(numel, dtype=torch.int64, device=device)
    key = key.to(device=device, dtype=torch.int64)
    return mix((index & _MASK) ^ key ^ (index >> 32))


def uniform(key: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 uniforms in [0, 1), multiples of 2^-24, one per element of `shape` (row-major
    element index), a function of `key` (0-dim int64, mixed: `derive(seed, "noise")` of a
    `layer_seeds` seed) and the index only."""
    if not all(_is_size(n) for n in shape):
        raise ValueError(f"shape must be a tuple of ints >= 0, got {shape!r}")
    numel = 1
    for n in shape:
        numel *= n
    h = _hash(key, numel, device)
    return ((h >> 8).to(torch.float32) * 2.0**-24).reshape(shape)


def random_signs(key: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """float32 [n] of ±1, a function of `key` (0-dim int64) only."""
    bit = (_hash(key, n, device) >> 16) & 1
    return 1.0 - 2.0 * bit.to(torch.float32)
