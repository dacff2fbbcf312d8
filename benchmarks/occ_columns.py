"""How many input channels hold OCC-clipped entries, on the linear benchmark's kind of input.

alpha = 0.99 clips 2 % of the entries by definition, so when the true outlier channels hold fewer
entries than that the rest of the clipped entries land in ordinary channels. This counts them for x
= N(0, 1) with 128 channels scaled x50 (as `benchmarks/linear.py` builds it, here on the CPU with M
= 4096 rows), with fp4's sampled thresholds. Measured (CPU): K = 2048 and 4096: the 128 outlier
channels only; K = 11008 (128 channels hold 1.2 % < 2 % of the entries): every channel. The clipped
entries of benchmarks/recipe_sqnr.py's Student-t inputs also spread over every channel: why OCC's
compensation GEMM is dense (occ_gemm.py), not restricted to the outlier channels. Real inputs
of a trained 125M model: benchmarks/occ_real_activations.py (session 68; the same answer).

Second table (session 29): what restricting the compensation to the C channels that hold most of
the remainder's energy would cost. On recipe_sqnr.py's inputs (x Student-t with outlier
channels, w with log-normal channel norms), y = Q(x_c)·Q(w)ᵀ (E2M1 per row, as fp4's fprop) plus
the compensation of those C channels only, in float64, against full compensation: its SQNR
against the float64 product. The issue asks for within 0.5 dB of full compensation.

    python benchmarks/occ_columns.py
"""

from __future__ import annotations

import torch

from minifloat import recipes
from minifloat.occ import clamp, remainder, thresholds
from minifloat.quantize import quantize
from minifloat.sqnr import sqnr_db, synthetic_activation, synthetic_weight


def outlier_columns(k: int, m: int = 4096, seed: int = 0) -> tuple[int, float]:
    """(channels holding clipped entries, fraction of clipped entries) for a [m, k] input."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:128]] *= 50.0
    x = x.bfloat16()
    clipped = remainder(x, *thresholds(x, recipes.get("fp4").occ)) != 0
    return int(clipped.any(dim=0).sum()), clipped.sum().item() / x.numel()


def top_channel_compensation(m: int, k: int, keep: tuple[int, ...]) -> dict[str, float]:
    """y's SQNR (dB) on recipe_sqnr.py's inputs [m, k] x [k, k]: without compensation, with all
    of it, and with only the `c` channels of largest remainder energy for each c in `keep`
    (and the share of the energy they hold)."""
    x, w = synthetic_activation(m, k, seed=1), synthetic_weight(k, k, seed=2)
    ref = x.double() @ w.double().t()
    lo, hi = thresholds(x, recipes.get("fp4").occ)
    x_q = quantize(clamp(x, lo, hi), "e2m1", "row").dequantize().double()
    y = x_q @ quantize(w, "e2m1", "row").dequantize().double().t()
    dx = remainder(x, lo, hi).double()
    energy = dx.pow(2).sum(dim=0)
    out = {"none": sqnr_db(ref, y), "all": sqnr_db(ref, y + dx @ w.double().t())}
    for c in keep:
        idx = energy.topk(c).indices
        out[f"top {c}"] = sqnr_db(ref, y + dx[:, idx] @ w.double()[:, idx].t())
        out[f"top {c} energy"] = (energy[idx].sum() / energy.sum()).item()
    return out


def main() -> None:
    print("| K | channels with clipped entries | clipped fraction |")
    print("|---|---|---|")
    for k in (2048, 4096, 11008):
        n, frac = outlier_columns(k)
        print(f"| {k} | {n} of {k} | {100 * frac:.2f} % |")
    print()
    print("| x | y SQNR (dB): none / all | C channels by energy: share of energy, y SQNR (dB) |")
    print("|---|---|---|")
    for m, k in ((1024, 1024), (2048, 2048)):
        r = top_channel_compensation(m, k, (k // 8, k // 16, k // 32))
        cells = ", ".join(
            f"{c}: {100 * r[f'top {c} energy']:.0f} %, {r[f'top {c}']:.2f}"
            for c in (k // 8, k // 16, k // 32)
        )
        print(f"| {m} x {k} | {r['none']:.2f} / {r['all']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
