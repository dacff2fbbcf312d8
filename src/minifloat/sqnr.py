"""SQNR, the error metric used everywhere, and the quantization tables `make demo` prints first.

SQNR (dB) = 20·log10(‖ref‖ / ‖out − ref‖), computed in float64. Higher is better; each bit of
mantissa is worth about 6 dB.

`main()` prints SQNR per element format × granularity on a weight-like and an activation-like
tensor: heavy-tailed values with per-channel spread and a few outlier channels, the shape of
real LLM tensors that makes per-tensor FP4 scaling fail. Run it as
`python -c "from minifloat.sqnr import main; main()"`; `python -m minifloat.sqnr` works too, but
runpy warns because `import minifloat` has already imported this module.

Every random draw comes from a local `torch.Generator`: nothing here touches torch's global RNG.
"""

from __future__ import annotations

import math

import torch

from minifloat.quantize import Granularity, fake_quantize

__all__ = [
    "sqnr_db",
    "student_t",
    "synthetic_weight",
    "synthetic_activation",
    "sqnr_table",
    "format_table",
    "granularity_label",
    "main",
    "FORMATS",
    "GRANULARITIES",
]

FORMATS = ("e2m1", "e1m2", "e3m0", "e4m3", "e5m2", "int8", "int4")
GRANULARITIES: tuple[Granularity, ...] = (
    "tensor",
    "row",
    "column",
    (1, 16),
    (1, 32),
    (1, 128),
    (16, 16),
    (128, 128),
)
_KIND_TITLES = {
    "weight": "weight-like (Gaussian, log-normal row norms)",
    "activation": "activation-like (Student-t, 3 dof, 4 outlier channels x20)",
}


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `out` against `ref`, in dB. For finite input: inf
    when equal, -inf when `ref` is all zeros and `out` is not. NaN when either holds NaN, or
    when ref holds an inf (inf - inf or inf / inf): non-finite input is not read as "no
    signal"; an inf in `out` alone is infinite noise, -inf. The shapes must match:
    broadcasting would compare the wrong entries."""
    if ref.shape != out.shape:
        raise ValueError(
            f"sqnr_db: ref and out shapes differ: {tuple(ref.shape)} vs {tuple(out.shape)}"
        )
    if ref.is_complex() or out.is_complex():  # .double() drops the imaginary part
        raise TypeError(f"sqnr_db takes real tensors, got {ref.dtype} and {out.dtype}")
    ref64, out64 = ref.double(), out.double()
    noise = (out64 - ref64).norm().item()
    if math.isnan(noise):  # NaN in either input; before the comparisons, which NaN fails
        return math.nan
    if noise == 0.0:
        return math.inf
    signal = ref64.norm().item()
    ratio = signal / noise
    if math.isnan(ratio):  # inf / inf: an inf in ref that out does not share
        return math.nan
    # ratio 0: no signal, infinite noise, or a quotient below float64's range (log10(0) raises)
    return 20.0 * math.log10(ratio) if signal > 0.0 and ratio > 0.0 else -math.inf


def student_t(shape: tuple[int, ...], dof: int, generator: torch.Generator) -> torch.Tensor:
    """Student-t samples with integer `dof`, all drawn from `generator`.

    t = z / sqrt(chi2 / dof) with z standard normal and chi2 the sum of `dof` squared standard
    normals (torch.distributions.StudentT has no generator argument, so it would need the global
    RNG to be reproducible).
    """
    if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"dof must be a positive int, got {dof!r}")
    z = torch.randn(shape, generator=generator)
    chi2 = torch.randn((dof, *shape), generator=generator).pow(2).sum(dim=0)
    return z / (chi2 / dof).sqrt()


def synthetic_weight(n: int, k: int, *, seed: int = 0) -> torch.Tensor:
    """Weight-like [n, k]: Gaussian rows with log-normally varying per-row (channel) norms."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    return w * torch.exp(0.5 * torch.randn(n, 1, generator=gen))


def synthetic_activation(
    m: int, k: int, *, seed: int = 0, outlier_channels: int = 4
) -> torch.Tensor:
    """Activation-like [m tokens, k channels]: Student-t (3 dof) with a few channels ×20."""
    if isinstance(outlier_channels, bool) or not isinstance(outlier_channels, int):
        raise TypeError(f"outlier_channels must be an int, got {outlier_channels!r}")
    if not 0 <= outlier_channels <= k:  # -1 sliced [:-1]: all channels but one x20
        raise ValueError(f"outlier_channels must lie in [0, k={k}], got {outlier_channels}")
    gen = torch.Generator().manual_seed(seed)
    x = student_t((m, k), 3, gen)
    channels = torch.randperm(k, generator=gen)[:outlier_channels]
    x[:, channels] *= 20.0
    return x


def granularity_label(granularity: Granularity) -> str:
    """Short column label: "tensor", "row", "column", or "1x32" for a block shape."""
    return granularity if isinstance(granularity, str) else "x".join(map(str, granularity))


def sqnr_table(
    m: int = 1024,
    k: int = 1024,
    *,
    formats: tuple[str, ...] = FORMATS,
    granularities: tuple[Granularity, ...] = GRANULARITIES,
) -> list[dict]:
    """SQNR (dB) of fake quantization for every format × granularity on both tensor kinds.

    One dict per cell: {"tensor": "weight" | "activation", "format", "granularity" (its label),
    "sqnr_db"}. Scales are fp32 and rounding nearest-even, so the table isolates the element
    format and the grouping.
    """
    tensors = {"weight": synthetic_weight(m, k), "activation": synthetic_activation(m, k)}
    rows = []
    for kind, x in tensors.items():
        for fmt in formats:
            for gran in granularities:
                rows.append(
                    {
                        "tensor": kind,
                        "format": fmt,
                        "granularity": granularity_label(gran),
                        "sqnr_db": sqnr_db(x, fake_quantize(x, fmt, gran)),
                    }
                )
    return rows


def format_table(rows: list[dict]) -> str:
    """One Markdown table per tensor kind: formats as rows, granularities as columns."""
    grans = list(dict.fromkeys(r["granularity"] for r in rows))
    blocks = []
    for kind in dict.fromkeys(r["tensor"] for r in rows):
        cells = {(r["format"], r["granularity"]): r["sqnr_db"] for r in rows if r["tensor"] == kind}
        lines = [
            f"{_KIND_TITLES.get(kind, kind)}:",
            "",
            "| format | " + " | ".join(grans) + " |",
            "|---|" + "---:|" * len(grans),
        ]
        for fmt in dict.fromkeys(f for f, _ in cells):
            lines.append(f"| {fmt} | " + " | ".join(f"{cells[fmt, g]:.1f}" for g in grans) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(m: int = 1024, k: int = 1024) -> None:
    """Print the demo tables for [m, k] tensors (1024 × 1024: about a second on a CPU)."""
    print("Quantization SQNR (dB, higher is better), fp32 scales, round to nearest even.")
    print("Columns: one scale per tensor, per row, per column, or per block (rows x cols).\n")
    print(format_table(sqnr_table(m, k)))
    print("\nE1M2 and INT4 coincide: under absmax scaling both are 8 evenly spaced magnitudes.")


if __name__ == "__main__":
    main()
