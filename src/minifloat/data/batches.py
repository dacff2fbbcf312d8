"""Deterministic, exactly resumable batches of (input, target) windows from a token array.

Batch ``k`` is a pure function of (tokens, seed, k, rank, world_size): the iterator's only state
is the step counter ``position``, so ``state_dict()`` / ``load_state_dict()`` resume a run with
exactly the batches it would have seen without the interruption.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from minifloat.data.errors import DataError

__all__ = ["BatchIterator"]

_MODES = ("random", "sequential")


class BatchIterator:
    """Windows of ``seq_len + 1`` tokens, split into inputs ``[:-1]`` and targets ``[1:]``.

    ``mode="random"``: each row starts at a uniformly random offset, drawn from a numpy PCG64
    generator seeded with ``(seed, position, rank)``. ``mode="sequential"``: consecutive
    non-overlapping windows in order (for evaluation), wrapping around at the end. With
    ``world_size > 1`` each rank gets different windows (pass its ``rank``).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        position: int = 0,
        mode: str = "random",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(_MODES)}")
        for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1),
                                 ("seed", seed, 0), ("position", position, 0)):  # fmt: skip
            # a float or negative value failed only at the first batch, deep inside numpy
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                kind = "a positive int" if low else "an int >= 0"
                raise ValueError(f"{name} must be {kind}, got {value!r}")
        if getattr(tokens, "ndim", 1) != 1:  # 2-D tokens gave [batch, seq, row] batches
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        needed = batch_size * seq_len + 1
        if len(tokens) < needed:
            raise DataError(
                f"only {len(tokens)} tokens, fewer than one batch needs ({batch_size} x {seq_len}"
                " + 1): use more data or a smaller batch_size/seq_len"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = position
        self.mode = mode
        self.rank = rank
        self.world_size = world_size

    @property
    def num_windows(self) -> int:
        """Non-overlapping windows in one pass (the sequential mode's epoch length in rows)."""
        return (len(self.tokens) - 1) // self.seq_len

    def _starts(self, position: int) -> np.ndarray:
        if self.mode == "random":
            rng = np.random.Generator(np.random.PCG64([self.seed, position, self.rank]))
            return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        first = (position * self.world_size + self.rank) * self.batch_size
        windows = (first + np.arange(self.batch_size)) % self.num_windows
        return windows * self.seq_len

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (inputs, targets), each an int64 CPU tensor of shape [batch_size, seq_len]."""
        starts = self._starts(self.position)
        self.position += 1
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        windows = torch.from_numpy(rows.astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def state_dict(self) -> dict:
        """Everything needed to continue exactly where this iterator is."""
        return {
            "position": self.position,
            "seed": self.seed,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``; the shape settings and token count must match."""
        missing = sorted({"mode", "batch_size", "seq_len", "num_tokens", "rank", "world_size",
                          "seed", "position"} - set(state))  # fmt: skip
        if missing:
            raise ValueError(f"cannot resume: the batch iterator state lacks {', '.join(missing)}")
        for key in ("mode", "batch_size", "seq_len", "num_tokens", "rank", "world_size"):
            mine = len(self.tokens) if key == "num_tokens" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"cannot resume: {key} is {mine}, the checkpoint has {state[key]}")
        self.seed = state["seed"]
        self.position = state["position"]
