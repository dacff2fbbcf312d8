"""SQNR, the error metric used everywhere, and the quantization table `make demo` prints first.

SQNR (dB) = 20·log10(‖ref‖ / ‖out − ref‖), computed in float64. Higher is better; each bit of
mantissa is worth about 6 dB.

`python -m minifloat.sqnr` prints SQNR per element format × granularity on weight-like and
activation-like tensors: heavy-tailed (Student-t) values with a few outlier channels, the shape of
real LLM activations that makes per-tensor FP4 scaling fail.
"""

from __future__ import annotations

import math

import torch

from minifloat.quantize import fake_quantize

__all__ = ["sqnr_db", "synthetic_weight", "synthetic_activation", "sqnr_table", "main"]


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `out` against `ref`, in dB (inf when equal)."""
    ref64, out64 = ref.double(), out.double()
    noise = (out64 - ref64).norm().item()
    if noise == 0.0:
        return math.inf
    return 20.0 * math.log10(ref64.norm().item() / noise)


def synthetic_weight(n: int, k: int, *, seed: int = 0) -> torch.Tensor:
    """Weight-like [n, k]: Gaussian rows with log-normally varying per-row (channel) norms."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    return w * torch.exp(0.5 * torch.randn(n, 1, generator=gen))


def synthetic_activation(
    m: int, k: int, *, seed: int = 0, outlier_channels: int = 4
) -> torch.Tensor:
    """Activation-like [m tokens, k channels]: Student-t (3 dof) with a few channels ×20."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)  # StudentT has no generator argument; keep the demo deterministic
    x = t.sample((m, k))
    channels = torch.randperm(k, generator=gen)[:outlier_channels]
    x[:, channels] *= 20.0
    return x


FORMATS = ("e2m1", "e4m3", "e5m2", "int8")
GRANULARITIES = ("tensor", "row", (1, 32), (1, 128))


def sqnr_table(m: int = 1024, k: int = 1024) -> list[dict]:
    """SQNR (dB) of fake quantization for every format × granularity on both tensor kinds."""
    tensors = {"weight": synthetic_weight(m, k), "activation": synthetic_activation(m, k)}
    rows = []
    for kind, x in tensors.items():
        for fmt in FORMATS:
            for gran in GRANULARITIES:
                rows.append(
                    {
                        "tensor": kind,
                        "format": fmt,
                        "granularity": gran if isinstance(gran, str) else "x".join(map(str, gran)),
                        "sqnr_db": sqnr_db(x, fake_quantize(x, fmt, gran)),
                    }
                )
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table: one row per tensor kind × format, one column per granularity."""
    grans = list(dict.fromkeys(r["granularity"] for r in rows))
    lines = ["| tensor | format | " + " | ".join(grans) + " |", "|---|---|" + "---|" * len(grans)]
    for kind in dict.fromkeys(r["tensor"] for r in rows):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            cells = {
                r["granularity"]: r["sqnr_db"]
                for r in rows
                if (r["tensor"], r["format"]) == (kind, fmt)
            }
            lines.append(
                f"| {kind} | {fmt} | " + " | ".join(f"{cells[g]:.1f}" for g in grans) + " |"
            )
    return "\n".join(lines)


def main() -> None:
    print("Quantization SQNR (dB, higher is better) on heavy-tailed tensors with outlier channels:")
    print(format_table(sqnr_table()))


if __name__ == "__main__":
    main()
