"""Each FP8 GEMM of one training block alone, as the Hopper backend calls it and with its operands
swapped (out = a·bᵀ computed as (b·aᵀ)ᵀ), to see whether cuBLAS picks a faster kernel for one
orientation of a shape.

    PYTHONPATH=src python benchmarks/gemm_orientation.py --model 1.3B [--recipes fp8-tensorwise]

For every linear of one block (q, k, v, o, gate, up, down) and every GEMM (fprop y = x·wᵀ, dgrad
dx = dy·w, wgrad dw = dyᵀ·x; M = batch x seq tokens), the operands in the dtypes, scales, output
dtypes and fast-accumulation flags the recipe uses (`QuantRecipe`), timed alone: the median of
`--reps` CUDA-event timings after a warm-up, the L2 flushed before each (`common.time_ms`),
bf16 `torch.mm` beside them. "swapped" runs the same product with the other operand as cuBLAS's
A (its output is the transpose, a view: what a change to that orientation would also pay for a
copy of it is not counted). The cuBLAS kernel each form ran is read from the profiler. Why: in
a 6-layer 1.3B profile (session 60) fp8-tensorwise's 2048 x 2048 GEMMs ran 99-158 µs a call in
kernels of different families.

Tensor- and row-scaled recipes without OCC, and fp8-blockwise (session 63: its GEMMs are what
keeps it under its target), whose swapped fprop and dgrad run cuBLAS's 128x128 x 1x128 kernel
(`scaled_mm_blocks_lhs`, block-scaled GEMMs run on CUDA only); others exit with a message.
`--device cpu` runs the tiny preset once, untimed (a smoke test). Writes
`gemm_orientation_<model>[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, kernel_times, time_ms, write_results  # noqa: E402
from minifloat.kernels.scaled_mm import (  # noqa: E402
    pad_contraction,
    scaled_mm_blocks,
    scaled_mm_rowish,
)
from minifloat.recipes import get as get_recipe  # noqa: E402
from step_gemms import linear_shapes  # noqa: E402
from train_e2e import PRESETS  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
STORAGE = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E4M3}
# (a rows, b rows, contraction) of each GEMM's a·bᵀ for a linear [n, k] on m tokens
DIMS = {
    "fprop": lambda m, n, k: (m, n, k),
    "dgrad": lambda m, n, k: (m, k, n),
    "wgrad": lambda m, n, k: (n, k, m),
}


def _operand(rows: int, cols: int, fmt: str, per_row: bool, gen: torch.Generator, device: str):
    """A row-major FP8 operand [rows, cols] and its scale ([rows, 1] or [1, 1])."""
    x = torch.randn(rows, cols, device=device, generator=gen).to(STORAGE[fmt])
    scale = torch.rand(rows if per_row else 1, 1, device=device, generator=gen) + 0.5
    return x, scale


def _block_operand(rows: int, cols: int, block: tuple[int, int], gen, device: str):
    """A row-major E4M3 operand [rows, cols] and its block scale [ceil(rows/br), ceil(cols/bc)]."""
    x = torch.randn(rows, cols, device=device, generator=gen).to(E4M3)
    shape = (-(-rows // block[0]), -(-cols // block[1]))
    return x, torch.rand(*shape, device=device, generator=gen) + 0.5


def scaled_mm_blocks_lhs(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, *, out_dtype
) -> torch.Tensor:
    """a @ bᵀ with a 128x128-scaled lhs (a_scale [R/128, Kc/128]) and a 1x128-scaled rhs (b_scale
    [C, Kc/128]): the orientation `scaled_mm_blocks` does not call (cuBLAS's other DeepSeek
    kernel). R, C and Kc multiples of 128 here (the 1.3B shapes)."""
    a, b = pad_contraction(a, 512), pad_contraction(b, 512)
    sb = b_scale.float().t().contiguous()  # [Kc/128, C], as scaled_mm_blocks' 1x128 rhs
    return torch._scaled_mm(a, b.t(), scale_a=a_scale.float().contiguous(), scale_b=sb,
                            out_dtype=out_dtype)  # fmt: skip


def _block_gemms(r, m: int, n: int, k: int, gen, device: str) -> dict:
    """fp8-blockwise's three GEMMs, as called (1x128 lhs) and swapped (`gemms`)."""
    out = {}
    out_dtype = {"fprop": torch.bfloat16, "dgrad": torch.bfloat16, "wgrad": torch.float32}
    for name, dims in DIMS.items():
        rows_a, rows_b, kc = dims(m, n, k)
        spec = getattr(r, name)
        tiles = spec.rhs.granularity == (1, 128) and not spec.rhs.reuse
        b_block = (1, 128) if tiles else (128, 128)  # a reused rhs is fprop's 128x128 w_q
        a, sa = _block_operand(rows_a, kc, (1, 128), gen, device)
        b, sb = _block_operand(rows_b, kc, b_block, gen, device)
        kw = {"out_dtype": out_dtype[name]}

        def called(a=a, sa=sa, b=b, sb=sb, b_block=b_block, kw=kw):
            return scaled_mm_blocks(a, sa, b, sb, b_block, **kw)

        def swapped(a=a, sa=sa, b=b, sb=sb, b_block=b_block, kw=kw):
            if b_block == (1, 128):
                return scaled_mm_blocks(b, sb, a, sa, b_block, **kw).t()
            return scaled_mm_blocks_lhs(b, sb, a, sa, **kw).t()

        out[name] = (called, swapped)
    return out


def gemms(recipe_name: str, m: int, n: int, k: int, device: str) -> dict:
    """{gemm: (as called, swapped)}: fprop, dgrad and wgrad of one [n, k] linear as callables."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    if recipe_name == "bf16":

        def rand(*shape):
            return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

        x, w, g = rand(m, k), rand(n, k), rand(m, n)
        return {
            "fprop": (lambda: torch.mm(x, w.t()), lambda: torch.mm(w, x.t()).t()),
            "dgrad": (lambda: torch.mm(g, w), lambda: torch.mm(w.t(), g.t()).t()),
            "wgrad": (lambda: torch.mm(g.t(), x), lambda: torch.mm(x.t(), g).t()),
        }
    r = get_recipe(recipe_name)
    if recipe_name == "fp8-blockwise":
        return _block_gemms(r, m, n, k, gen, device)
    specs = [s for g in DIMS for s in (getattr(r, g).lhs, getattr(r, g).rhs)]
    if r.occ is not None or any(
        s.granularity not in ("tensor", "row") or s.hadamard for s in specs
    ):
        raise SystemExit(
            f"gemm_orientation times tensor- and row-scaled GEMMs without OCC or rotations, "
            f"and fp8-blockwise's; {recipe_name} has others"
        )
    out = {}
    out_dtype = {"fprop": torch.bfloat16, "dgrad": torch.bfloat16, "wgrad": torch.float32}
    for name, dims in DIMS.items():
        rows_a, rows_b, kc = dims(m, n, k)
        spec = getattr(r, name)
        # a reused operand (fprop's w_q or x_q, transposed) carries a tensor scale, or a unit
        # one where the recipe folds its row scale into dy: [1, 1] either way
        rhs_rows = spec.rhs.granularity == "row" and not spec.rhs.reuse
        a, sa = _operand(rows_a, kc, spec.lhs.fmt, spec.lhs.granularity == "row", gen, device)
        b, sb = _operand(rows_b, kc, spec.rhs.fmt, rhs_rows, gen, device)
        fast = getattr(r, f"{name}_fast_accum")
        kw = {"out_dtype": out_dtype[name], "use_fast_accum": fast}

        def called(a=a, sa=sa, b=b, sb=sb, kw=kw):
            return scaled_mm_rowish(a, sa, b, sb, **kw)

        def swapped(a=a, sa=sa, b=b, sb=sb, kw=kw):
            return scaled_mm_rowish(b, sb, a, sa, **kw).t()

        out[name] = (called, swapped)
    return out


def kernel_name(fn) -> str:
    """The longest GPU kernel one call of `fn` ran (its GEMM), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ms, _ = kernel_times(prof, 1)
    return max(ms, key=ms.get) if ms else "?"


def block_gemm_args(
    description: str, recipes: str, argv: list[str] | None
) -> tuple[argparse.Namespace, str, int, bool]:
    """(args, model, M tokens, on CUDA) of a script that times one block's GEMMs: this one and
    `tunable_gemm_probe.py`. On the CPU the tiny preset, M = 64 (a smoke test)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="1.3B", choices=sorted(PRESETS))
    ap.add_argument("--recipes", default=recipes)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    batch, seq, _ = PRESETS[args.model] if cuda else (1, 64, None)
    return args, (args.model if cuda else "tiny"), batch * seq, cuda


def main(argv: list[str] | None = None) -> None:
    args, model, m, cuda = block_gemm_args(
        __doc__.splitlines()[0], "bf16,fp8-tensorwise,fp8-rowwise,fp4-dge", argv
    )
    records = []
    for recipe in args.recipes.split(","):
        for linear, n, k in linear_shapes(model):
            for gemm, (called, swapped) in gemms(recipe, m, n, k, args.device).items():
                if not cuda:  # the smoke test: both forms run and agree in shape
                    assert called().shape == swapped().shape
                    continue
                # the two forms must compute one product (a layout mistake shows here)
                want, got = called().float(), swapped().float()
                err = ((got - want).norm() / want.norm()).item()
                if err > 1e-3:
                    raise SystemExit(f"{recipe} {linear} {gemm}: swapped form differs ({err:.2e})")
                rows_a, rows_b, kc = DIMS[gemm](m, n, k)
                flop = 2.0 * rows_a * rows_b * kc
                rec = {
                    "recipe": recipe,
                    "linear": linear,
                    "gemm": gemm,
                    "shape": [rows_a, rows_b, kc],
                }
                for form, fn in (("called", called), ("swapped", swapped)):
                    ms = time_ms(fn, warmup=1, reps=args.reps)
                    rec[f"{form}_ms"], rec[f"{form}_tflops"] = ms, flop / ms / 1e9
                    rec[f"{form}_kernel"] = kernel_name(fn)
                records.append(rec)
                ms = f"{rec['called_ms']:.3f} / {rec['swapped_ms']:.3f} ms"
                print(f"{recipe} {linear} {gemm} {ms}", flush=True)
    if not cuda:
        print("cpu smoke run: every GEMM built and run once")
        return
    title = f"gemm_orientation_{model}" + (f"_{args.tag}" if args.tag else "")
    lines = [f"`{' '.join(sys.argv)}`", "", f"One {model} block's GEMMs alone (M = {m} tokens), "
             f"median of {args.reps} CUDA-event timings, L2 flushed; a·bᵀ as called and as "
             "(b·aᵀ)ᵀ.", "",
             "| recipe | linear | GEMM | a·bᵀ [R, C, K] | called ms (TFLOPS) | swapped ms (TFLOPS) "
             "| called kernel | swapped kernel |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        lines.append(
            f"| {r['recipe']} | {r['linear']} | {r['gemm']} | {r['shape']} | "
            f"{r['called_ms']:.3f} ({r['called_tflops']:.0f}) | "
            f"{r['swapped_ms']:.3f} ({r['swapped_tflops']:.0f}) | "
            f"`{r['called_kernel'][:70]}` | `{r['swapped_kernel'][:70]}` |"
        )
    lines += ["", "Sum over one block's GEMMs, ms (called / swapped / the faster of the two):", ""]
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        rows = [r for r in records if r["recipe"] == recipe]
        called = sum(r["called_ms"] for r in rows)
        swapped = sum(r["swapped_ms"] for r in rows)
        best = sum(min(r["called_ms"], r["swapped_ms"]) for r in rows)
        lines.append(f"- {recipe}: {called:.3f} / {swapped:.3f} / {best:.3f}")
    md, _ = write_results(
        title, records, "\n".join(lines), out_dir=Path(args.out_dir), day=args.date
    )
    print(md.read_text())


if __name__ == "__main__":
    main()
