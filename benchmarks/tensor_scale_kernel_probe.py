"""Would tensor-scaled GEMMs run faster in cuBLAS's row-scaled kernels? Each GEMM of one block
of a tensor-scaled recipe, as training calls it (two one-element scales: cuBLAS's tensor-scaled
kernels) and with the same scales given as vectors (`scaled_mm_rowish` then runs the row-scaled
"outer vector scale" kernels), timed in alternation.

    PYTHONPATH=src python benchmarks/tensor_scale_kernel_probe.py [--recipes fp8-tensorwise]

Why (session 64): fp8-tensorwise's GEMMs take 33.3 ms of a 6-layer 1.3B profile against
fp8-rowwise's 30.4 (`train_e2e_1.3B_ours_s63_blockprof_l6_...`), the same operand bytes and
more scale work in the row-wise ones. Alone, cuBLAS runs the tensor-scaled 2048 x 2048 fprop and
dgrad in a 256x128 kernel at ~1,300 TFLOPS (`gemm_orientation_1.3B_s62_*`), the row-scaled ones
in a 128x128 kernel at ~1,450 (`gemm_orientation_1.3B_s63_block_*`). Vectors of one repeated
value give the same product up to the order of the epilogue's two float32 multiplies
(acc·s_a·s_b against acc·(s_a·s_b)): each form's result is checked against the other's
(relative Frobenius error below 1e-3) before it is timed.

Operands as `gemm_orientation.py` makes them (the recipe's formats and fast-accumulation flags,
random values, scales in [0.5, 1.5)); the median of `--reps` rounds, each form after an L2
flush (`common.alternating_ms`); the kernel each form ran, from the profiler. Shapes that repeat
in a block (q, k, v, o) are timed once and counted for each linear in the sums.
`--device cpu` builds and runs the tiny preset's GEMMs once (a smoke test: `_scaled_mm` runs on
CUDA only, so there both forms are the emulation's product). Writes
`tensor_scale_kernel_probe_<model>[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternating_ms, probe_parser, write_probe  # noqa: E402
from gemm_orientation import DIMS, _operand, kernel_name  # noqa: E402
from minifloat.kernels.scaled_mm import scaled_mm_rowish  # noqa: E402
from minifloat.recipes import get as get_recipe  # noqa: E402
from step_gemms import linear_shapes  # noqa: E402
from train_e2e import PRESETS  # noqa: E402

OUT_DTYPE = {"fprop": torch.bfloat16, "dgrad": torch.bfloat16, "wgrad": torch.float32}


def _emulated(a, sa, b, sb, *, out_dtype, use_fast_accum):
    """The CPU stand-in for `_scaled_mm` in the smoke run: float32 product, then the scales."""
    del use_fast_accum
    out = (a.float() @ b.float().t()) * sa.reshape(-1, 1).float() * sb.reshape(1, -1).float()
    return out.to(out_dtype)


def forms(recipe_name: str, m: int, device: str) -> list[dict]:
    """Each unique GEMM shape of one block: operands, flags and the two forms as callables."""
    r = get_recipe(recipe_name)
    for gemm in DIMS:
        spec = getattr(r, gemm)
        if spec.lhs.granularity != "tensor" or spec.rhs.granularity != "tensor" or r.occ:
            raise SystemExit(f"{recipe_name}'s {gemm} is not tensor-scaled on both operands")
    mm = scaled_mm_rowish if device == "cuda" else _emulated
    out: dict[tuple, dict] = {}
    for linear, n, k in linear_shapes("1.3B" if device == "cuda" else "tiny"):
        for gemm, dims in DIMS.items():
            rows_a, rows_b, kc = dims(m, n, k)
            key = (gemm, rows_a, rows_b, kc)
            if key in out:
                out[key]["linears"].append(linear)
                continue
            spec = getattr(r, gemm)
            gen = torch.Generator(device=device).manual_seed(rows_a * 31 + rows_b * 7 + kc)
            a, sa = _operand(rows_a, kc, spec.lhs.fmt, False, gen, device)
            b, sb = _operand(rows_b, kc, spec.rhs.fmt, False, gen, device)
            kw = {"out_dtype": OUT_DTYPE[gemm], "use_fast_accum": getattr(r, f"{gemm}_fast_accum")}
            fns = {
                "tensor": lambda a=a, sa=sa, b=b, sb=sb, kw=kw: mm(a, sa, b, sb, **kw),
                "row": lambda a=a, sa=sa, b=b, sb=sb, kw=kw: mm(
                    a, sa.expand(a.shape[0], 1), b, sb.expand(b.shape[0], 1), **kw
                ),
            }
            out[key] = {"recipe": recipe_name, "gemm": gemm, "shape": [rows_a, rows_b, kc],
                        "fmts": [spec.lhs.fmt, spec.rhs.fmt], "fast_accum": kw["use_fast_accum"],
                        "linears": [linear], "fns": fns}  # fmt: skip
    return list(out.values())


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--recipes", default="fp8-tensorwise")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    batch, seq, _ = PRESETS["1.3B"]
    m = batch * seq if cuda else 64
    records = []
    for recipe in args.recipes.split(","):
        for entry in forms(recipe, m, args.device):
            fns = entry.pop("fns")
            want, got = fns["tensor"]().float(), fns["row"]().float()
            err = ((got - want).norm() / want.norm()).item()
            if err > 1e-3:
                raise SystemExit(f"{recipe} {entry['gemm']} {entry['shape']}: the forms differ "
                                 f"({err:.2e})")  # fmt: skip
            entry["rel_diff"] = err
            if cuda:
                flop = 2.0 * entry["shape"][0] * entry["shape"][1] * entry["shape"][2]
                entry["ms"] = alternating_ms(fns, reps=args.reps)
                entry["tflops"] = {k: flop / v / 1e9 for k, v in entry["ms"].items()}
                entry["kernel"] = {k: kernel_name(fn) for k, fn in fns.items()}
                print(f"{recipe} {entry['gemm']} {entry['shape']}: " + ", ".join(
                    f"{k} {v:.3f} ms" for k, v in entry["ms"].items()), flush=True)  # fmt: skip
            records.append(entry)
    if not cuda:
        print("cpu smoke run: both forms of every GEMM built, run once and compared")
        return
    write_probe("tensor_scale_kernel_probe_1.3B", args, records, _body(records, m))


def _body(records: list[dict], m: int) -> str:
    lines = [f"One 1.3B block's GEMMs (M = {m} tokens) alone: ms (TFLOPS), median of the "
             "rounds, the two forms in alternation, L2 flushed. `tensor`: one-element scales "
             "(as training calls them); `row`: the same scales as vectors.", "",
             "| recipe | GEMM | a·bᵀ [R, C, K] | linears | fmts, fast accum | tensor | row "
             "| rel. diff | tensor kernel | row kernel |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        cells = [f"{r['ms'][f]:.3f} ({r['tflops'][f]:.0f})" for f in ("tensor", "row")]
        lines.append(f"| {r['recipe']} | {r['gemm']} | {r['shape']} | {','.join(r['linears'])} "
                     f"| {'x'.join(r['fmts'])}, {r['fast_accum']} | {cells[0]} | {cells[1]} | "
                     f"{r['rel_diff']:.1e} | `{r['kernel']['tensor'][:60]}` | "
                     f"`{r['kernel']['row'][:60]}` |")  # fmt: skip
    lines += ["", "One block's sums, ms (each shape counted for each linear that has it): "
              "tensor / row / the faster form a GEMM:", ""]  # fmt: skip
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        for gemm in (*DIMS, None):
            rows = [r for r in records if r["recipe"] == recipe and gemm in (None, r["gemm"])]
            t = [sum(r["ms"][f] * len(r["linears"]) for r in rows) for f in ("tensor", "row")]
            best = sum(min(r["ms"].values()) * len(r["linears"]) for r in rows)
            lines.append(f"- {recipe} {gemm or 'all'}: {t[0]:.3f} / {t[1]:.3f} / {best:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
