"""Is the quantized SwiGLU bound by the SiLU's arithmetic? One compiled MLP, several SiLU forms.

    PYTHONPATH=src python benchmarks/silu_form_probe.py [--recipes bf16,fp8-tensorwise]
        [--forms aten,sigmoid,fn,fastmath] [--m 16384 --dim 2048 --ffn 5632] [--dump DIR]
        [--out-dir DIR] [--date D] [--tag T] [--device cuda|cpu]

Under fp8-tensorwise a 1.3B layer's SwiGLU backward runs as an amax pass (0.21 ms) and a
five-output cast (h_qᵀ, dg_q, du_q and the last two transposed; 0.39 ms) that both recompute
the SiLU derivative from g, u and dh, and its forward as an amax pass and a cast that both
recompute the SiLU (session 60's profile). bf16's
backward kernel does the same arithmetic and moves more bytes in 0.22 ms, so the quantized
passes look bound by their instructions, not their bytes. This probe times the model's MLP,
`w2(act(w1 x, w3 x))`, converted with each recipe and compiled, under forms of `act`:

- aten: `F.silu(g) * u`, the model's form (inductor: g / (1 + exp(-g)) with libdevice's exp,
  ATen's `silu_backward` decomposition for the derivative);
- sigmoid: `g * torch.sigmoid(g) * u` (inductor: `tl.sigmoid`);
- fn: `minifloat.models.swiglu.swiglu`, the form the model landed: s = sigmoid(g) once in
  float32, h = g·s·u, and in backward du = dh·g·s, dg = dh·u·s·(1 + g·(1 - s)), rounded once
  to g's dtype (session 62's first runs timed this arithmetic as the probe's own copy);
- fastmath: `aten` compiled with inductor's `use_fast_math` (its exp without libdevice).

`silu_form_probe_s62lib_...` also has a form `lib`, a variant of the module that rounded h
through `exact.to_dtype` (not landed; the form is gone).

Each row: the fwd+bwd step's median time (CUDA events), its GPU kernel time and the SwiGLU
kernels' (profiler; kernels whose inductor name holds silu, sigmoid, exp or mul of the MLP's
pointwise ops are listed by name), peak memory, and the form's error against a float64
SwiGLU (eager and compiled, max |error| over max |reference| of h and of both gradients).
`--dump` copies the inductor source of each row's slowest Triton kernels. On the CPU (`--device
cpu`, small shapes) it runs the eager error check and one compiled step per row (a smoke test).
Writes `silu_form_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    dump_kernel_sources,
    kernel_profile,
    probe_parser,
    step_fn,
    time_ms,
    write_probe,
)
from minifloat import convert  # noqa: E402
from minifloat.models.swiglu import swiglu  # noqa: E402

FORMS = ("aten", "sigmoid", "fn", "fastmath")


def act(form: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The SwiGLU's elementwise part, h = silu(g)·u, in `form`."""
    if form in ("aten", "fastmath"):
        return F.silu(g) * u
    if form == "sigmoid":
        return g * torch.sigmoid(g) * u
    if form == "fn":
        return swiglu(g, u)
    raise ValueError(f"unknown form {form!r}; choose from {FORMS}")


class MLP(nn.Module):
    """The model's SwiGLU MLP (models/llama.FeedForward) with the SiLU in `form`."""

    def __init__(self, dim: int, ffn: int, form: str) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(act(self.form, self.w1(x), self.w3(x)))


def form_error(form: str, device: str, n: int = 1 << 20) -> dict:
    """max |error| / max |reference| of h, dg and du in bf16 against float64 (of the same
    bf16 inputs), eager and compiled, for Gaussian g, u, dh with a wide g (|g| up to ~20)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    # inputs exact in bf16, so that the error is the form's own
    g64 = (torch.randn(n, generator=gen, dtype=torch.float64) * 4).bfloat16().double()
    u64, dh64 = (torch.randn(n, generator=gen).bfloat16().double() for _ in range(2))
    s = torch.sigmoid(g64)
    ref = (g64 * s * u64, dh64 * u64 * s * (1 + g64 * (1 - s)), dh64 * g64 * s)

    def run(fn):
        g = g64.to(device, torch.bfloat16).requires_grad_(True)
        u = u64.to(device, torch.bfloat16).requires_grad_(True)
        h = fn(g, u)
        h.backward(dh64.to(device, torch.bfloat16))
        return h, g.grad, u.grad

    out = {}
    for mode in ("eager", "compiled"):
        fn = lambda g, u: act(form, g, u)  # noqa: E731
        if mode == "compiled":
            torch._dynamo.reset()
            options = {"use_fast_math": True} if form == "fastmath" else None
            fn = torch.compile(fn, options=options)
        got = run(fn)
        out[mode] = [
            float((a.detach().double().cpu() - r).abs().max() / r.abs().max())
            for a, r in zip(got, ref, strict=True)
        ]
    return out


def run_row(args, recipe: str, form: str) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = MLP(args.dim, args.ffn, form).to(args.device)
    if recipe != "bf16":
        convert(mlp, recipe)
    options = {"use_fast_math": True} if form == "fastmath" else None
    step_mod = torch.compile(mlp, options=options)
    x = torch.randn(args.m, args.dim, device=args.device).bfloat16().requires_grad_(True)
    dy = torch.randn(args.m, args.dim, device=args.device).bfloat16()
    step = step_fn(step_mod, x, dy, device=args.device)

    row = {"recipe": recipe, "form": form, "m": args.m, "dim": args.dim, "ffn": args.ffn}
    if args.device == "cpu":
        step()
        return row | {"ran": True}
    torch.cuda.reset_peak_memory_stats()
    row["step_ms"] = time_ms(step, warmup=3, reps=20)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    prof = kernel_profile(step, reps=5, top=40)
    row["kernel_ms"], row["kernels"] = prof["kernel_ms"], prof["kernels"]
    row["top_kernels"] = prof["top_kernels"]
    words = ("silu", "sigmoid", "exp", "neg")
    row["silu_kernels"] = [k for k in prof["top_kernels"] if any(w in k[0] for w in words)]
    row["silu_ms"] = sum(k[1] for k in row["silu_kernels"])
    if args.dump:
        names = [k[0] for k in prof["top_kernels"] if not k[0].startswith(("nvjet", "void"))]
        dump_kernel_sources(names, Path(args.dump), f"{recipe}_{form}", 6)
    return row


def markdown(rows: list[dict], errors: dict) -> str:
    lines = [
        "| recipe | form | step ms | kernel ms | SiLU kernels ms | kernels | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "step_ms" not in r:
            continue
        lines.append(
            f"| {r['recipe']} | {r['form']} | {r['step_ms']:.3f} | {r['kernel_ms']:.3f} | "
            f"{r['silu_ms']:.3f} | {r['kernels']} | {r['peak_gib']:.2f} |"
        )
    lines += ["", "SiLU kernels (ms a step, launches):", ""]
    for r in rows:
        for name, ms, n in r.get("silu_kernels", []):
            lines.append(f"- {r['recipe']} {r['form']}: `{name}` {ms:.3f} ({n})")
    lines += [
        "",
        "Error against float64 (max |err| / max |ref|; h, dg, du):",
        "",
        "| form | eager | compiled |",
        "|---|---|---|",
    ]
    for form, e in errors.items():
        cells = [", ".join(f"{v:.2e}" for v in e[m]) for m in ("eager", "compiled")]
        lines.append(f"| {form} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--recipes", default="bf16,fp8-tensorwise")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    forms = args.forms.split(",")
    for form in forms:
        if form not in FORMS:
            ap.error(f"unknown form {form!r}; choose from {FORMS}")
    if "fastmath" in forms and not hasattr(torch._inductor.config, "use_fast_math"):
        print("this torch's inductor has no use_fast_math option: fastmath left out", flush=True)
        forms.remove("fastmath")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("silu_form_probe needs a CUDA GPU (or --device cpu)")
    errors = {form: form_error(form, args.device) for form in forms}
    print(errors, flush=True)
    rows = []
    for recipe in args.recipes.split(","):
        for form in forms:
            rows.append(run_row(args, recipe, form))
            print({k: v for k, v in rows[-1].items() if k != "top_kernels"}, flush=True)
    write_probe("silu_form_probe", args, rows + [{"errors": errors}], markdown(rows, errors))


if __name__ == "__main__":
    main()
