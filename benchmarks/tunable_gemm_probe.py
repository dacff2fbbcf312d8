"""Does cuBLASLt hold faster kernels for fp8-blockwise's GEMMs than its heuristic picks? Each GEMM
of one 1.3B block (`gemm_orientation.gemms`, as the Hopper backend calls it), timed with the
default pick, then again after PyTorch's TunableOp has tuned it (`torch.cuda.tunable`: it tries
the candidates cuBLASLt offers and keeps the fastest), with the kernel each ran.

    PYTHONPATH=src python benchmarks/tunable_gemm_probe.py [--recipes fp8-blockwise,fp8-rowwise]

Why (session 63): fp8-blockwise's quantization costs what fp8-rowwise's does in training
(6-layer profile), but its GEMMs take ~45 % longer, and one kernel family
(`..._128x128_128x6_..._Ablk128_Bvec128`) ran every fprop and dgrad shape. TunableOp is
process-wide state, so this is a probe, not a library setting; on a torch whose TunableOp does
not cover `_scaled_mm` on CUDA, `tuned` equals `default` and `tunable_entries` is empty.
`--device cpu` builds every GEMM of the tiny preset and exits (a smoke test). Writes
`tunable_gemm_probe_<model>[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_ms, write_results  # noqa: E402
from gemm_orientation import DIMS, block_gemm_args, gemms, kernel_name  # noqa: E402
from step_gemms import linear_shapes  # noqa: E402


def _time_all(made: dict, reps: int) -> dict:
    """{(linear, gemm): (ms, kernel)} of every called form in `made`."""
    out = {}
    for key, fn in made.items():
        out[key] = (time_ms(fn, warmup=2, reps=reps), kernel_name(fn))
    return out


def main(argv: list[str] | None = None) -> None:
    args, model, m, cuda = block_gemm_args(
        __doc__.splitlines()[0], "fp8-blockwise,fp8-rowwise", argv
    )
    made = {}
    for recipe in args.recipes.split(","):
        for linear, n, k in linear_shapes(model):
            for gemm, (called, _) in gemms(recipe, m, n, k, args.device).items():
                made[(recipe, linear, gemm, DIMS[gemm](m, n, k))] = called
    if not cuda:
        print(f"cpu smoke run: {len(made)} GEMMs built")
        return
    default = _time_all(made, args.reps)
    tunable = torch.cuda.tunable
    tunable.set_filename(str(Path(tempfile.mkdtemp()) / "tunableop_results.csv"))
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(200)  # ms a GEMM
    for fn in made.values():  # the first call of each shape tunes it
        fn()
    torch.cuda.synchronize()
    tunable.tuning_enable(False)  # timed with what tuning chose
    tuned = _time_all(made, args.reps)
    entries = [list(map(str, r)) for r in tunable.get_results()]
    tunable.enable(False)
    records = []
    for key in made:
        recipe, linear, gemm, shape = key
        (d_ms, d_kernel), (t_ms, t_kernel) = default[key], tuned[key]
        records.append({"recipe": recipe, "linear": linear, "gemm": gemm, "shape": list(shape),
                        "default_ms": d_ms, "tuned_ms": t_ms, "default_kernel": d_kernel,
                        "tuned_kernel": t_kernel})  # fmt: skip
    records.append({"tunable_entries": entries})
    lines = [f"`{' '.join(sys.argv)}`", "", f"One {model} block's GEMMs alone (M = {m}), median "
             f"of {args.reps} CUDA-event timings, L2 flushed; TunableOp entries: {len(entries)}.",
             "", "| recipe | linear | GEMM | [R, C, K] | default ms | tuned ms | default kernel "
             "| tuned kernel |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records[:-1]:
        lines.append(
            f"| {r['recipe']} | {r['linear']} | {r['gemm']} | {r['shape']} | "
            f"{r['default_ms']:.3f} | {r['tuned_ms']:.3f} | `{r['default_kernel'][:60]}` | "
            f"`{r['tuned_kernel'][:60]}` |"
        )
    lines += ["", "Sums over one block, ms (default / tuned):", ""]
    for recipe in args.recipes.split(","):
        rows = [r for r in records[:-1] if r["recipe"] == recipe]
        d, t = sum(r["default_ms"] for r in rows), sum(r["tuned_ms"] for r in rows)
        lines.append(f"- {recipe}: {d:.3f} / {t:.3f}")
    lines += ["", "TunableOp entries (op, params, solution, ms):", ""]
    lines += [f"- `{' | '.join(e)[:200]}`" for e in entries]
    title = f"tunable_gemm_probe_{model}" + (f"_{args.tag}" if args.tag else "")
    md, _ = write_results(
        title, records, "\n".join(lines), out_dir=Path(args.out_dir), day=args.date
    )
    print(md.read_text())


if __name__ == "__main__":
    main()
