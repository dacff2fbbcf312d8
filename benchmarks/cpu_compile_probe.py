"""Compiled against eager on the CPU: one training step of the tiny LLaMA, gradient by gradient.

    PYTHONPATH=src python benchmarks/cpu_compile_probe.py [--recipe fp8-delayed] [--only 1]
        [--simdlen N] [--region auto|always] [--out-dir DIR] [--date D] [--tag T]

Session 81 found compiled fp8-delayed on the CPU (torch 2.13) 18 of 21 gradients off eager, up
to ~30 % relative, with the same loss: inductor's C++ code generator fuses the last block's
norm backward with the recomputed FP8 casts of the region that fp8-delayed layers run in
(recompute.py) into one outer-loop-fused kernel whose local buffer holds one row while the outer
loop is tiled 16 rows at a time (pytorch/pytorch#185702, fixed by #185855, not in 2.13.0). Vector
code only: `--simdlen 1` (scalar C++) makes it rounding-sized. The GPU's Triton code generator
does not take this path.

Since session 82 the library leaves the recompute region out on the emulation (recompute.py),
which makes compiled fp8-delayed on the CPU agree with eager to rounding under 2.13 too.
`--region always` puts the region back on the emulation (for the compiled step only: it swaps
`recompute.applies` for one without the backend condition), to reproduce the torch bug.

Each row: the tiny model (2 layers, bf16 autocast, emulate_precision_casts on, deterministic)
compiled per block (`--only I`: block I alone), one step from the same seed as the eager model;
for every parameter the max |difference| over max |eager gradient|; how many differ at all and
how many by more than 1e-5 of their maximum (rounding is ~1e-7).
Writes `cpu_compile_probe[_<tag>]_cpu_<date>.{md,json}`.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_e2e  # noqa: E402
from common import probe_parser, write_probe  # noqa: E402
from minifloat import recompute  # noqa: E402


def one_step(recipe: str, compiled: bool, only: int) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients) of one step of the tiny model under `recipe`."""
    batch, seq, vocab = train_e2e.PRESETS["tiny"]
    net = train_e2e.prepare(train_e2e.build_model("tiny", "ours", vocab, seq, "cpu", 2), recipe)
    if compiled:
        torch._dynamo.reset()
        for i, block in enumerate(net.layers):
            if only < 0 or i == only:
                block.compile()
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()}


def _region_always(recipe, weight, backend) -> bool:
    """`recompute.applies` before session 82: fp8-delayed in the region on any backend (the
    FSDP2 exclusion does not arise here)."""
    return recipe.delayed is not None


def main(argv: list[str] | None = None) -> dict:
    ap = probe_parser(__doc__)
    ap.add_argument("--recipe", default="fp8-delayed")
    ap.add_argument("--only", type=int, default=-1, help="compile block I alone (-1: all)")
    ap.add_argument("--simdlen", type=int, default=None, help="inductor's cpp.simdlen")
    ap.add_argument("--region", choices=("auto", "always"), default="auto",
                    help="the recompute region where the library puts it, or always")  # fmt: skip
    args = ap.parse_args(argv)
    config = {"emulate_precision_casts": True}
    if args.simdlen is not None:
        config["cpp.simdlen"] = args.simdlen
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # process state: restored below (tests import this)
    try:
        eager_loss, eager = one_step(args.recipe, False, args.only)
        region = (
            mock.patch.object(recompute, "applies", _region_always)
            if args.region == "always"
            else contextlib.nullcontext()
        )
        with torch._inductor.config.patch(config), region:
            loss, grads = one_step(args.recipe, True, args.only)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    rel = {
        n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        for n, g in eager.items()
    }
    rec = {
        "recipe": args.recipe, "torch": torch.__version__, "only": args.only,
        "simdlen": args.simdlen, "region": args.region, "eager_loss": eager_loss,
        "compiled_loss": loss,
        "differ": sum(not torch.equal(grads[n], g) for n, g in eager.items()),
        "differ_past_1e-5": sum(r > 1e-5 for r in rel.values()), "of": len(eager),
        "max_rel": max(rel.values()), "rel": rel,
    }  # fmt: skip
    print({k: v for k, v in rec.items() if k != "rel"}, flush=True)
    lines = [
        f"{args.recipe}, torch {torch.__version__}, blocks compiled: "
        f"{'all' if args.only < 0 else args.only}, simdlen {args.simdlen}, recompute region "
        f"{args.region}; loss eager "
        f"{eager_loss!r}, compiled {loss!r}; {rec['differ']} of {rec['of']} gradients differ, "
        f"{rec['differ_past_1e-5']} by more than 1e-5 of their maximum.",
        "",
        "| parameter | max abs difference / max abs eager |",
        "|---|---|",
    ] + [f"| {n} | {r:.2e} |" for n, r in rel.items()]
    write_probe("cpu_compile_probe", args, [rec], "\n".join(lines))
    return rec


if __name__ == "__main__":
    main()
