"""Linears that share an input (q, k, v; gate, up) as one GEMM each way instead of one a linear:
would cuBLAS run the concatenated shapes faster per FLOP, and more so for FP8 than for bf16?

    PYTHONPATH=src python benchmarks/fused_gemm_probe.py --model 1.3B \
        [--recipes bf16,fp8-blockwise,fp8-rowwise]

Why: in session 82's 6-layer 1.3B profile, fp8-blockwise's wgrad GEMMs (its 1x128 x 1x128
kernel) ran at ~890 TFLOPS against fprop's and dgrad's ~1,180, and its gate/up wgrads
([5632, 2048] outputs: 704 tiles of 128 x 128 on 132 SMs, 5.3 waves) at ~890 against the
2048 x 2048 ones' ~980: a concatenated [11264, 2048] output is 10.7 waves. fp8-blockwise is ~0.2
ms a step short of its 1.10x (docs/hopper.md), so a gain of that size would decide it.

For each group and each GEMM (fprop y = x·wᵀ, dgrad dx = dy·w, wgrad dw = dyᵀ·x; M = batch x
seq tokens) in the operand layouts, scales and output dtypes the recipe's Hopper backend uses
(`gemm_orientation.gemms`): "separate" runs one call a linear (dgrad adds the partial dx, as
autograd does), "fused" one call on the concatenated operands (block-aligned: 2048 and 5632 are
multiples of 128, so every 1x128 and 128x128 scale block is the same either way, and only dgrad's
sum order changes). The two forms alternate (`common.alternating_ms`, L2 flushed), `--rounds`
times `--reps` calls; the median of the rounds' medians is kept. Writes
`fused_gemm_probe_<model>[_<tag>]_<gpu>_<date>.{md,json}`. `--device cpu` builds every form once
at the tiny preset (a smoke test).

Session 90 on an H200 (`fused_gemm_probe_1.3B_s90_{a,b}_h200_2026-12-04.md`): a block's grouped
GEMMs 3.80 -> 3.39 ms for fp8-blockwise, 5.19 -> 4.85 for bf16. In the model the stacked forms
made the step slower (docs/hopper_sessions.md, session 90), so minifloat does not stack them.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternating_ms, write_results  # noqa: E402
from gemm_orientation import DIMS, block_gemm_args, gemms, kernel_name  # noqa: E402
from step_gemms import linear_shapes  # noqa: E402


def groups(model: str) -> dict[str, list[tuple[int, int]]]:
    """{group: [(out features, in features) of each member]}: the linears that read one input."""
    shapes = {name: (n, k) for name, n, k in linear_shapes(model)}
    return {"qkv": [shapes[s] for s in "qkv"], "gate_up": [shapes["gate"], shapes["up"]]}


def forms(recipe: str, gemm: str, m: int, members: list[tuple[int, int]], device: str):
    """(separate, fused) callables for one GEMM of one group."""
    parts = [gemms(recipe, m, n, k, device)[gemm][0] for n, k in members]
    k = members[0][1]
    fused = gemms(recipe, m, sum(n for n, _ in members), k, device)[gemm][0]

    def separate():
        outs = [p() for p in parts]
        if gemm != "dgrad":
            return outs
        total = outs[0]
        for o in outs[1:]:
            total = total + o
        return total

    return separate, fused


def main(argv: list[str] | None = None) -> None:
    args, model, m, cuda = block_gemm_args(
        __doc__.splitlines()[0], "bf16,fp8-blockwise,fp8-rowwise", argv
    )
    rounds = 5
    records = []
    for recipe in args.recipes.split(","):
        for group, members in groups(model).items():
            for gemm in DIMS:
                separate, fused = forms(recipe, gemm, m, members, args.device)
                if not cuda:
                    separate(), fused()
                    continue
                meds = {"separate": [], "fused": []}
                for _ in range(rounds):
                    t = alternating_ms({"separate": separate, "fused": fused}, reps=args.reps)
                    for form, ms in t.items():
                        meds[form].append(ms)
                n_total, k = sum(n for n, _ in members), members[0][1]
                flop = 2.0 * m * n_total * k
                rec = {"recipe": recipe, "group": group, "gemm": gemm,
                       "fused_shape": list(DIMS[gemm](m, n_total, k))}  # fmt: skip
                for form in meds:
                    ms = statistics.median(meds[form])
                    rec[f"{form}_ms"], rec[f"{form}_tflops"] = ms, flop / ms / 1e9
                    rec[f"{form}_rounds_ms"] = meds[form]
                rec["fused_kernel"] = kernel_name(fused)
                records.append(rec)
                print(f"{recipe} {group} {gemm}: separate {rec['separate_ms']:.3f} ms, "
                      f"fused {rec['fused_ms']:.3f} ms", flush=True)  # fmt: skip
    if not cuda:
        print("cpu smoke run: every form built and run once")
        return
    title = f"fused_gemm_probe_{model}" + (f"_{args.tag}" if args.tag else "")
    lines = [f"`{' '.join(sys.argv)}`", "", f"One {model} block's grouped GEMMs (M = {m} tokens), "
             f"median of {rounds} rounds of {args.reps} alternating CUDA-event timings, L2 "
             "flushed.", "",
             "| recipe | group | GEMM | fused [R, C, K] | separate ms (TFLOPS) | fused ms (TFLOPS) "
             "| fused kernel |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        lines.append(
            f"| {r['recipe']} | {r['group']} | {r['gemm']} | {r['fused_shape']} | "
            f"{r['separate_ms']:.3f} ({r['separate_tflops']:.0f}) | "
            f"{r['fused_ms']:.3f} ({r['fused_tflops']:.0f}) | `{r['fused_kernel'][:70]}` |"
        )
    lines += ["", "Sum over one block's grouped GEMMs, ms (separate / fused):", ""]
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        rows = [r for r in records if r["recipe"] == recipe]
        sep, fus = sum(r["separate_ms"] for r in rows), sum(r["fused_ms"] for r in rows)
        wg = [r for r in rows if r["gemm"] == "wgrad"]
        lines.append(
            f"- {recipe}: {sep:.3f} / {fus:.3f} (wgrad alone "
            f"{sum(r['separate_ms'] for r in wg):.3f} / {sum(r['fused_ms'] for r in wg):.3f})"
        )
    md, _ = write_results(
        title, records, "\n".join(lines), out_dir=Path(args.out_dir), day=args.date
    )
    print(md.read_text())


if __name__ == "__main__":
    main()
