"""How many input channels hold OCC-clipped entries, on the linear benchmark's kind of input.

OCC's compensation runs over only the channels that hold clipped entries. alpha = 0.99 clips 2 %
of the entries by definition, so when the true outlier channels hold fewer entries than that the
rest of the clipped entries land in ordinary channels. This counts them for x = N(0, 1) with 128
channels scaled x50 (as `benchmarks/linear.py` builds it, here on the CPU with M = 4096 rows),
with fp4's sampled thresholds.

    python benchmarks/occ_columns.py
"""

from __future__ import annotations

import torch

from minifloat import recipes
from minifloat.occ import outliers, thresholds


def outlier_columns(k: int, m: int = 4096, seed: int = 0) -> tuple[int, float]:
    """(channels holding clipped entries, fraction of clipped entries) for a [m, k] input."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:128]] *= 50.0
    x = x.bfloat16()
    cols, delta = outliers(x, *thresholds(x, recipes.get("fp4").occ))
    return cols.numel(), (delta != 0).sum().item() / x.numel()


def main() -> None:
    print("| K | channels with clipped entries | clipped fraction |")
    print("|---|---|---|")
    for k in (2048, 4096, 11008):
        n, frac = outlier_columns(k)
        print(f"| {k} | {n} of {k} | {100 * frac:.2f} % |")


if __name__ == "__main__":
    main()
