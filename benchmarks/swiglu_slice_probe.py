"""The SwiGLU's h = silu(g)·u and fp8-blockwise's two casts of h, compiled, with g and u as two
tensors or as the two halves of one GEMM output: which reductions inductor makes persistent, and
what each form costs.

    PYTHONPATH=src python benchmarks/swiglu_slice_probe.py --model 1.3B [--reps 30]

Why (docs/hopper_sessions.md, session 90): with gate and up stacked into one fprop GEMM, g and u
are slices of one [M, 2F] output, and in a compiled 1.3B block the kernel that computes h and
its 1x128 maxima became a looped reduction (`triton_heuristics.reduction`, 1.66 ms a 6-layer
step) where it had been a persistent one (1.03 ms), its arithmetic unchanged. The likely cause
is that `InductorChoices.should_use_persistent_reduction` asks for the kernel's reduction hint
without tiling scores, and the hint drops from INNER to DEFAULT (threshold 64 < 128) when a
pointwise node of the kernel reads memory non-contiguously.

Forms: "two" (g, u [M, F] each), "slices" (y [M, 2F], g = y[:, :F], u = y[:, F:]). Each runs
`swiglu(g, u)` then the backend's fprop cast of h (1x128 tiles along F) and its wgrad cast
(1x128 tiles along M, transposed), as the down projection's forward makes them. The answers
inductor's choices handler gives (the hint it is asked with, non-contiguous pointwise access,
reduction size, persistent or not) are recorded through a recording subclass of
`InductorChoices` (`V.set_choices_handler`), the kernels' names and times from the profiler,
the forms' times alternating (`common.alternating_ms`). The forms' outputs are checked equal.
Writes `swiglu_slice_probe_<model>[_<tag>]_<gpu>_<date>.{md,json}`. `--device cpu` runs the
tiny preset's shapes eagerly (a smoke test of the forms and their equality).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternating_ms, kernel_times, same_bits, write_results  # noqa: E402
from gemm_orientation import block_gemm_args  # noqa: E402
from minifloat.kernels import get_backend  # noqa: E402
from minifloat.models.llama import get_config  # noqa: E402
from minifloat.models.swiglu import swiglu  # noqa: E402
from minifloat.recipes import get as get_recipe  # noqa: E402


def casts(g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """h = silu(g)·u, then fp8-blockwise's fprop and wgrad casts of h (values and scales)."""
    recipe = get_recipe("fp8-blockwise")
    backend = get_backend("auto", g.device)
    h = swiglu(g, u)
    x_q = backend.quantize(h, recipe.fprop.lhs)
    x_t = backend.quantize(h, recipe.wgrad.rhs, transpose=True)
    return x_q.data, x_q.scale, x_t.data.t().contiguous(), x_t.scale


def inputs(m: int, f: int, device: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{form: (g, u)} with the same values in every form."""
    gen = torch.Generator(device=device).manual_seed(0)
    y = torch.randn(m, 2 * f, device=device, generator=gen).to(torch.bfloat16)
    return {
        "two": (y[:, :f].contiguous(), y[:, f:].contiguous()),
        "slices": (y[:, :f], y[:, f:]),
    }


def _recording_choices(log: list[dict]):
    """An `InductorChoices` that records every persistent-reduction decision it makes."""
    from torch._inductor.choices import InductorChoices

    class Recording(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):  # noqa: ANN001
            answer = InductorChoices.should_use_persistent_reduction(
                features, cooperative_reduction
            )
            # (the non-contiguity test is torch 2.13's name: None where a version lacks it)
            check = getattr(features, "has_non_contiguous_pw_in_reduction_kernel", None)
            log.append({
                "reduction_numel": str(features.reduction_numel),
                "hint": str(features.get_reduction_hint()),
                "non_contiguous_pointwise": None if check is None else bool(check()),
                "persistent": bool(answer),
            })  # fmt: skip
            return answer

    return Recording()


def main(argv: list[str] | None = None) -> None:
    # (the shared options of the block-GEMM probes; --recipes is not read here)
    args, model, m, cuda = block_gemm_args(__doc__.splitlines()[0], "fp8-blockwise", argv)
    f = get_config(model).ffn_dim
    forms = inputs(m, f, args.device)
    if not cuda:  # eager, untimed: the two forms agree
        want, got = casts(*forms["two"]), casts(*forms["slices"])
        assert same_bits(want, got)
        print("cpu smoke run: both forms built, same bits")
        return
    from torch._inductor.virtualized import V
    from torch.profiler import ProfilerActivity, profile

    records, compiled = [], {}
    for form, (g, u) in forms.items():
        log: list[dict] = []
        V.set_choices_handler(_recording_choices(log))
        torch._dynamo.reset()
        fn = torch.compile(casts)
        out = fn(g, u)  # compiles here, with the recording handler
        compiled[form] = (fn, g, u, out)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(g, u)
            torch.cuda.synchronize()
        ms, _ = kernel_times(prof, 1)
        records.append({"form": form, "m": m, "f": f, "decisions": log,
                        "kernels": sorted(ms.items(), key=lambda kv: -kv[1])})  # fmt: skip
    V.set_choices_handler(None)
    same = same_bits(compiled["two"][3], compiled["slices"][3])
    times = alternating_ms({k: (lambda v=v: v[0](v[1], v[2])) for k, v in compiled.items()},
                           reps=args.reps)  # fmt: skip
    for rec in records:
        rec["ms"], rec["same_bits_as_two"] = times[rec["form"]], same
    lines = [f"`{' '.join(sys.argv)}`", "", f"h = silu(g)·u and fp8-blockwise's two casts of h, "
             f"M = {m}, F = {f}, compiled; median of {args.reps} alternating timings, L2 "
             f"flushed. Both forms give the same bits: {same}.", "",
             "| form | ms | decisions (hint, non-contiguous pointwise, r, persistent) | kernels "
             "(ms) |", "|---|---|---|---|"]  # fmt: skip
    for rec in records:
        dec = "; ".join(f"{d['hint']}, {d['non_contiguous_pointwise']}, {d['reduction_numel']}, "
                        f"{d['persistent']}" for d in rec["decisions"])  # fmt: skip
        ks = "; ".join(f"`{n[:60]}` {t:.3f}" for n, t in rec["kernels"])
        lines.append(f"| {rec['form']} | {rec['ms']:.3f} | {dec} | {ks} |")
    title = f"swiglu_slice_probe_{model}" + (f"_{args.tag}" if args.tag else "")
    md, _ = write_results(
        title, records, "\n".join(lines), out_dir=Path(args.out_dir), day=args.date
    )
    print(md.read_text())


if __name__ == "__main__":
    main()
