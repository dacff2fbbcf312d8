"""How many input channels hold OCC-clipped entries, on the linear benchmark's kind of input.

alpha = 0.99 clips 2 % of the entries by definition, so when the true outlier channels hold fewer
entries than that the rest of the clipped entries land in ordinary channels. This counts them for x
= N(0, 1) with 128 channels scaled x50 (as `benchmarks/linear.py` builds it, here on the CPU with M
= 4096 rows), with fp4's sampled thresholds. Measured (CPU): K = 2048 and 4096: the 128 outlier
channels only; K = 11008 (128 channels hold 1.2 % < 2 % of the entries): every channel. The clipped
entries of benchmarks/recipe_sqnr.py's Student-t inputs also spread over every channel: why OCC's
compensation GEMM is dense (occ_gemm.py), not restricted to the outlier channels.

    python benchmarks/occ_columns.py
"""

from __future__ import annotations

import torch

from minifloat import recipes
from minifloat.occ import remainder, thresholds


def outlier_columns(k: int, m: int = 4096, seed: int = 0) -> tuple[int, float]:
    """(channels holding clipped entries, fraction of clipped entries) for a [m, k] input."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:128]] *= 50.0
    x = x.bfloat16()
    clipped = remainder(x, *thresholds(x, recipes.get("fp4").occ)) != 0
    return int(clipped.any(dim=0).sum()), clipped.sum().item() / x.numel()


def main() -> None:
    print("| K | channels with clipped entries | clipped fraction |")
    print("|---|---|---|")
    for k in (2048, 4096, 11008):
        n, frac = outlier_columns(k)
        print(f"| {k} | {n} of {k} | {100 * frac:.2f} % |")


if __name__ == "__main__":
    main()
