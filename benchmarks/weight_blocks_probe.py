"""fp8-blockwise's weight operands (128x128-block E4M3 values, row-major and transposed) by
inductor from kernels/operand.py against the one Triton kernel of kernels/weight_blocks.py;
with `--granularity tensor`, fp8-tensorwise's against kernels/weight_tensor_triton.py's two;
with `--granularity rows`, fp8-rowwise's fprop and dgrad operands (w and wᵀ, each with its own
row scales) against kernels/weight_rows_triton.py's two.

    PYTHONPATH=src python benchmarks/weight_blocks_probe.py --model 1.3B [--reps 30]
        [--granularity block|tensor|rows]

Why (docs/hopper_sessions.md, session 91): in a 1.3B training step each fp8-blockwise weight
costs five kernels, ~23 us for a 2048 x 2048 float32 weight that a single pass reads in ~5 us:
the block maxima in two reductions, the forward's cast, the backward's cast again into the
transposed layout, and the transposed scales. Forms timed, per weight shape of the model's
block (float32 master weights, "inv" scales as the recipe has them):

- "inductor fwd": `quantize_operand` compiled (the forward's part, values and scales);
- "inductor both": the same plus the transposed values and scales as HEAD's backward writes
  them (`written_once`, then `.t().contiguous()`), in one compiled function; for row scales
  fprop's operand and dgrad's (`inductor_dgrad`: wᵀ quantized anew) compiled apart, as HEAD's
  forward and backward graphs make them;
- "triton wN": `weight_blocks_2d` with N warps a block (both layouts, both scale layouts;
  session 91's runs also timed transposed stores by `tl.trans` of the cast, wrong bytes, and
  by a separate transpose kernel, slower: `weight_blocks_probe_1.3B_s91b_...`); for tensor
  scales `weight_tensor_2d` (block maxima, then the cast of both layouts; session 92's run,
  `weight_blocks_probe_1.3B_tensor_s92t_...`, put it in the Hopper backend); for row scales
  `weight_rows_2d` (row and column maxima by atomic maxima, then both casts; in the Hopper
  backend since session 93);
  (session 94's run also timed two cast kernels that read each block once, "addr" and
  "trans32", `weight_blocks_probe_1.3B_rows_s94_...`: "addr" at 4 warps replaced the op's);

Every form's bytes are checked against the eager `quantize_operand` first (values, transposed
values, scales), its outputs allocated where 0x55 bytes were (`poisoned`). Times: medians of
alternating CUDA-event timings, L2 flushed (`common.alternating_ms`), and each form's kernel
count and time (each kernel's, too) from the profiler, 10 calls each after an L2 flush (until
session 93 one call, L2 warm). Writes
`weight_blocks_probe_<model>[_tensor|_rows][_<tag>]_<gpu>_<date>.{md,json}`. `--device cpu`
checks the eager forms on the tiny preset's shapes (a smoke test: no Triton there).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternating_ms, cold_kernel_times, probe_parser, same_bits, write_probe  # noqa: E402
from minifloat.exact import written_once  # noqa: E402
from minifloat.kernels.operand import quantize_operand  # noqa: E402
from minifloat.models.llama import get_config  # noqa: E402


def weight_shapes(model: str) -> list[tuple[str, int, int]]:
    """(names, out_features, in_features) of one block's distinct weight shapes."""
    cfg = get_config(model)
    d, f = cfg.dim, cfg.ffn_dim
    kv = (cfg.n_kv_heads or cfg.n_heads) * (d // cfg.n_heads)
    shapes = {(d, d): "q, o", (kv, d): "k, v", (f, d): "gate, up", (d, f): "down"}
    if kv == d:
        shapes[(d, d)] = "q, k, v, o"
    return [(name, n, k) for (n, k), name in shapes.items()]


GRANULARITY = {"block": (128, 128), "tensor": "tensor", "rows": "row"}


def inductor_fwd(w: torch.Tensor, granularity: str = "block") -> tuple[torch.Tensor, ...]:
    """The forward's operand (values, scale), as QuantLinear's compiled graph quantizes it."""
    return quantize_operand(w, "e4m3", GRANULARITY[granularity], scale_format="inv")


def inductor_dgrad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8-rowwise's dgrad operand: wᵀ quantized anew with a scale per row of wᵀ, written
    row-major (as the compiled backward writes it for the GEMM)."""
    values, scale = quantize_operand(w, "e4m3", "row", transpose=True, scale_format="inv")
    return values.contiguous(), scale


def inductor_both(w: torch.Tensor, granularity: str = "block") -> tuple[torch.Tensor, ...]:
    """(values, dgrad's values, scale): the forward's operand and dgrad's, as the compiled
    backward writes dgrad's: the forward's values transposed (`written_once`, then
    `.t().contiguous()`), or for row scales wᵀ quantized anew (`inductor_dgrad`)."""
    values, scale = inductor_fwd(w, granularity)
    if granularity == "rows":
        return values, inductor_dgrad(w)[0], scale
    return values, written_once(values).t().contiguous(), scale


def cuda_forms(w: torch.Tensor, granularity: str, warps: list[int]) -> dict[str, Callable]:
    """The timed forms of one CUDA weight (the module docstring)."""
    from minifloat.kernels.weight_blocks_triton import weight_blocks_2d
    from minifloat.kernels.weight_rows_triton import weight_rows_2d
    from minifloat.kernels.weight_tensor_triton import weight_tensor_2d

    fwd = torch.compile(functools.partial(inductor_fwd, granularity=granularity))
    both = torch.compile(functools.partial(inductor_both, granularity=granularity))
    if granularity == "rows":  # two graphs, as HEAD's forward and backward quantize them
        dgrad = torch.compile(inductor_dgrad)

        def both(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
            values, scale = fwd(t)
            return values, dgrad(t)[0], scale

    forms = {"inductor fwd": lambda: fwd(w), "inductor both": lambda: both(w)}
    triton_form = {"tensor": weight_tensor_2d, "rows": weight_rows_2d}.get(
        granularity, weight_blocks_2d
    )
    for n in warps:
        forms[f"triton w{n}"] = lambda n=n: triton_form(w, 448.0, True, num_warps=n)
    return forms


def poisoned(fn: Callable[[], tuple], like: tuple[torch.Tensor, ...]) -> tuple:
    """fn() after buffers of its outputs' sizes were filled with 0x55 bytes and freed: the
    caching allocator hands such blocks out again, so bytes a kernel fails to write show up
    instead of a previous call's right ones."""
    junk = [torch.full((t.numel() * t.element_size(),), 0x55, dtype=torch.uint8,
                       device=t.device) for t in like]  # fmt: skip
    del junk
    return fn()


def _split(kernels: dict[str, float]) -> str:
    """Each kernel's time in us, by name (the first 28 characters), slowest first."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    return ", ".join(f"`{name[:28]}` {ms * 1e3:.1f}" for name, ms in ranked)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)  # --out-dir, --date, --tag
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--granularity", default="block", choices=sorted(GRANULARITY),
                    help="block: fp8-blockwise's weights; tensor: fp8-tensorwise's; rows: "
                         "fp8-rowwise's (fprop's and dgrad's operands)")  # fmt: skip
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    model = args.model if cuda else "tiny"
    gen = torch.Generator().manual_seed(0)
    if not cuda:
        for _, n, k in weight_shapes(model):
            w = torch.randn(n, k, generator=gen) * 0.02
            pad_n, pad_k = -n % 128, -k % 128  # the tiny preset's dims are not whole blocks
            w = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n))
            values, t_values, _ = inductor_both(w, args.granularity)
            if args.granularity == "rows":  # wᵀ's own scales: the same shape, not the values
                assert t_values.shape == values.t().shape and t_values.is_contiguous()
            else:
                assert same_bits((values.t(),), (t_values,))
        print("cpu smoke run: the eager forms agree")
        return
    records = []
    for names, n, k in weight_shapes(model):
        w = (torch.randn(n, k, generator=gen) * 0.02).cuda()
        want = inductor_both(w, args.granularity)  # eager: the definition
        forms = cuda_forms(w, args.granularity, _ints(args.warps))
        same = {}
        for form, fn in forms.items():
            got = poisoned(fn, want)  # (q, q_t, s, ...), or inductor fwd's (q, s)
            got = (got[0], got[1], got[2]) if len(got) > 2 else got
            same[form] = same_bits(want if len(got) == 3 else (want[0], want[2]), got)
        ms = alternating_ms(forms, reps=args.reps)
        for form, fn in forms.items():
            kernels, launches = cold_kernel_times(fn)
            records.append({"weights": names, "rows": n, "cols": k, "form": form,
                            "ms": ms[form], "same_bits": same[form],
                            "kernels": round(sum(launches.values())),
                            "kernel_ms": sum(kernels.values()), "kernel_split": kernels,
                            "gbps_read": n * k * 4 / ms[form] / 1e6})  # fmt: skip
    scales = {"block": "128 x 128 blocks", "tensor": "one a tensor",
              "rows": "one a row of w (fprop) and of wᵀ (dgrad)"}[args.granularity]  # fmt: skip
    lines = [f"{model}: one block's weights (float32), E4M3 with \"inv\" scales, {scales}; "
             f"median of {args.reps} alternating timings, L2 flushed; kernels and their time "
             "per call from the profiler (10 calls, L2 flushed before each).", "",
             "| weights | shape | form | ms | kernels | kernel ms | weight read GB/s | "
             "same bits | each kernel (us) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        lines.append(f"| {r['weights']} | {r['rows']} x {r['cols']} | {r['form']} | "
                     f"{r['ms'] * 1e3:.1f} us | {r['kernels']} | {r['kernel_ms'] * 1e3:.1f} us | "
                     f"{r['gbps_read']:.0f} | {r['same_bits']} | "
                     f"{_split(r['kernel_split'])} |")  # fmt: skip
    base = f"weight_blocks_probe_{model}" + ("" if args.granularity == "block" else
                                              f"_{args.granularity}")  # fmt: skip
    write_probe(base, args, records, "\n".join(lines))


if __name__ == "__main__":
    main()
