"""How much a last-bit change of a layer's input moves its output, per recipe, eager on the CPU.

    PYTHONPATH=src python benchmarks/occ_factor_flip_probe.py [--recipes fp4-dge,fp4-occ,fp4]
        [--rows 256 --cols 256 --out-features 512] [--eps 1e-7,1e-6] [--out-dir DIR]
        [--date D] [--tag T]

Why (session 82): compiled against eager, the tiny LLaMA's gradients under fp4 and fp4-occ
differed by up to 11-17 % even with `emulate_precision_casts` and scalar code (other recipes: at
most 1.3 %), and `compile_drift.py`'s whole-model fp32 difference for fp4 had gone from 6.5e-6
(2026-11-23) to 8.9e-2, while compiling only the linear layers still gave eager's bits. This
probe found the cause: `occ.joint_lhs` gives each row a factor f in {1, 1.25, 1.5} (session
65), the one that rounds the row's largest remainder to E4M3 closest, ties to the smaller f;
but where two factors round it to the same value their errors, computed in float32 through an
inexact 1 / f, differed in the last bits, so a last-bit change of the remainder flipped f and
the whole row's remainder was rounded to E4M3 anew (fp4-occ's y moved 8.4e-4 for a 1e-7 change
of x, fp4-dge's 8.9e-8). `_joint_factor` now compares such ties exactly (`_s82_` results: before
the fix; `_s82_fixed_`: after, no flips).

For a converted `nn.Linear` and x with outlier columns (every row has clipped entries), x
perturbed by (1 + eps·u), u uniform in [-1, 1]: the relative L2 change of y, dx and dw; under
OCC recipes also how many rows' y moved by more than 1e-5 of their norm, and how many rows'
joint factor flipped (from the same ops as `joint_lhs`). Writes
`occ_factor_flip_probe[_<tag>]_cpu_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import probe_parser, write_probe  # noqa: E402
from minifloat import convert, occ  # noqa: E402
from minifloat.kernels.clip import clamp, remainder_row_amax  # noqa: E402
from minifloat.kernels.operand import quantize_operand  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def joint_factors(x: torch.Tensor, cfg: occ.OCCConfig) -> torch.Tensor:
    """The factor f `joint_lhs` takes for each row of x [M, K] (fp4's lhs: row-scaled E2M1, "inv"
    scales), [M, 1]."""
    lo, hi = occ.thresholds(x, cfg)
    *_, multiplier = quantize_operand(
        clamp(x, lo, hi), "e2m1", "row", scale_format="inv", with_multiplier=True
    )
    return occ._joint_factor(remainder_row_amax(x, lo, hi) * multiplier)[0]


def one_recipe(recipe: str, shape: tuple[int, int, int], eps_list: list[float]) -> list[dict]:
    rows, cols, n_out = shape
    torch.manual_seed(0)
    layer = convert(torch.nn.Sequential(torch.nn.Linear(cols, n_out)), recipe)[0]
    x0 = torch.randn(rows, cols) * torch.rand(1, cols) * 3  # columns of unequal scale
    dy = torch.randn(rows, n_out)

    def run(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x.clone().requires_grad_(True)
        layer.zero_grad()
        y = layer(x)
        y.backward(dy)
        return y.detach(), x.grad.clone(), layer.weight.grad.clone()

    base = run(x0)
    gen = torch.Generator().manual_seed(1)
    out = []
    for eps in eps_list:
        xp = x0 * (1 + eps * (2 * torch.rand(x0.shape, generator=gen) - 1))
        got = run(xp)
        rec = {"recipe": recipe, "shape": list(shape), "eps": eps,
               "y": _rel(got[0], base[0]), "dx": _rel(got[1], base[1]),
               "dw": _rel(got[2], base[2])}  # fmt: skip
        row_change = (got[0] - base[0]).norm(dim=1) / base[0].norm(dim=1).clamp_min(1e-30)
        moved = row_change > 1e-5
        rec["rows_moved"] = int(moved.sum())
        rec["row_max"] = float(row_change.max())
        cfg = layer.recipe.occ
        if cfg is not None and cfg.one_gemm and cfg.compensate:
            flipped = (joint_factors(x0, cfg) != joint_factors(xp, cfg)).flatten()
            rec["factor_flips"] = int(flipped.sum())
            rec["moved_rows_flipped"] = int((flipped & moved).sum())
        print(rec, flush=True)
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = probe_parser(__doc__)
    ap.add_argument("--recipes", default="fp4-dge,fp4-occ,fp4")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--out-features", type=int, default=512)
    ap.add_argument("--eps", default="1e-7,1e-6")
    args = ap.parse_args(argv)
    shape = (args.rows, args.cols, args.out_features)
    eps_list = [float(e) for e in args.eps.split(",")]
    records = [r for name in args.recipes.split(",") for r in one_recipe(name, shape, eps_list)]
    lines = ["| recipe | eps | y | dx | dw | rows of y moved (> 1e-5) | largest row change | "
             "joint factors flipped (moved rows among them) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        flips = f"{r['factor_flips']} ({r['moved_rows_flipped']})" if "factor_flips" in r else "—"
        lines.append(
            f"| {r['recipe']} | {r['eps']:.0e} | {r['y']:.2e} | {r['dx']:.2e} | {r['dw']:.2e} "
            f"| {r['rows_moved']} of {shape[0]} | {r['row_max']:.2e} | {flips} |"
        )
    write_probe("occ_factor_flip_probe", args, records, "\n".join(lines))
    return records


if __name__ == "__main__":
    main()
