"""Time, power and SM clock of one training step's linear-layer GEMMs alone, bf16 against FP8.

    PYTHONPATH=src python benchmarks/step_gemms.py --model 1.3B \
        [--steps-file train_interleaved_....json] [--reps 20] [--device cpu]

On an H200 a 1.3B training step runs at the GPU's 700 W power limit in every row, bf16's
included (`train_interleaved_1.3B_ours_s30_power_...`: every NVML sample under the power cap,
692-694 W medians), and the SM clock settles where the row's work draws that power. This runs the
GEMMs of every linear layer of one step (fprop, dgrad and wgrad of q, k, v, o, gate, up and down
in every block, M = batch x seq tokens) back to back, as bf16 `torch.mm` (bf16 out) and as
`scaled_mm_rowish` the way minifloat's Hopper backend calls it (fp8-tensorwise: E4M3 x E4M3 fprop
with fast accumulation, E5M2 x E4M3 dgrad, bf16 out; wgrad float32 out; fp8-rowwise: the same
with row scales), `--reps` times, with the GPU's power, clock and limit reasons sampled
(`gpu_sampler.py`).

With `--steps-file` (a `train_interleaved.py` result) it also writes each row's bound: bf16's
step with its GEMMs' time replaced by the recipe's and everything else (attention, norms, the
output head, the optimizer) costing what it costs bf16, i.e. T_bf16 / (T_bf16 - G_bf16 + G_r),
with no time for quantization; the recipe's measured speed-up beside it, and the time its
quantization and glue take (its step less the bound's).

`--device cpu` runs the tiny preset once, untimed (a smoke test). Writes
`step_gemms_<model>_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, write_results  # noqa: E402
from gpu_sampler import GpuSampler  # noqa: E402
from minifloat.kernels.scaled_mm import scaled_mm_rowish  # noqa: E402
from minifloat.models.llama import get_config  # noqa: E402
from train_e2e import PRESETS  # noqa: E402

SETS = ("bf16", "fp8-tensorwise", "fp8-rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def linear_shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, out features N, in features K) of one block's linears."""
    cfg = get_config(model)
    kv = cfg.kv_heads * cfg.head_dim
    d, f = cfg.dim, cfg.ffn_dim
    return [("q", d, d), ("k", kv, d), ("v", kv, d), ("o", d, d),
            ("gate", f, d), ("up", f, d), ("down", d, f)]  # fmt: skip


def _operands(kind: str, m: int, n: int, k: int, device: str) -> dict:
    """The tensors one linear's three GEMMs read, in the layouts the GEMMs want."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    if kind == "bf16":
        return {"x": rand(m, k), "w": rand(n, k), "g": rand(m, n)}
    rows = kind == "fp8-rowwise"

    def scale(r):
        return torch.rand(r if rows else 1, 1, device=device) + 0.5

    return {  # a @ bᵀ with a and b row-major: x_q·w_qᵀ, g_q·(w_qᵀ)ᵀ, g_qᵀ·(x_qᵀ)ᵀ
        "x_q": rand(m, k).to(E4M3), "w_q": rand(n, k).to(E4M3), "g_q": rand(m, n).to(E5M2),
        "w_q_t": rand(k, n).to(E4M3), "g_q_t": rand(n, m).to(E5M2), "x_q_t": rand(k, m).to(E4M3),
        "s_x": scale(m), "s_w": scale(n), "s_g": scale(m), "s_wt": scale(k),
        "s_gt": scale(n), "s_xt": scale(k),
    }  # fmt: skip


def _gemms(kind: str, ops: dict):
    """fprop, dgrad and wgrad of one linear as three callables."""
    if kind == "bf16":
        x, w, g = ops["x"], ops["w"], ops["g"]
        return (lambda: torch.mm(x, w.t()), lambda: torch.mm(g, w), lambda: torch.mm(g.t(), x))
    o = ops
    return (
        lambda: scaled_mm_rowish(o["x_q"], o["s_x"], o["w_q"], o["s_w"],
                                 out_dtype=torch.bfloat16, use_fast_accum=True),
        lambda: scaled_mm_rowish(o["g_q"], o["s_g"], o["w_q_t"], o["s_wt"],
                                 out_dtype=torch.bfloat16),
        lambda: scaled_mm_rowish(o["g_q_t"], o["s_gt"], o["x_q_t"], o["s_xt"],
                                 out_dtype=torch.float32),
    )  # fmt: skip


def step_gemms(kind: str, model: str, m: int, device: str):
    """A callable running every linear GEMM of one training step: the forward's fprops block
    by block, then the backward's dgrads and wgrads in reverse (operands shared across blocks)."""
    layers = get_config(model).n_layers
    per_linear = [_gemms(kind, _operands(kind, m, n, k, device))
                  for _, n, k in linear_shapes(model)]  # fmt: skip

    def run() -> None:
        for _ in range(layers):
            for fprop, _, _ in per_linear:
                fprop()
        for _ in range(layers):
            for _, dgrad, wgrad in reversed(per_linear):
                dgrad()
                wgrad()

    return run


def measure(run, sampler: GpuSampler, reps: int, cuda: bool) -> dict:
    """Milliseconds of one `run()` (the mean over `reps` back to back) and the GPU's samples."""
    run()  # warm-up: cuBLAS handles and heuristics
    if not cuda:
        return {"ms": None, "gpu_samples": {}}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with sampler.collect() as samples:
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
    return {"ms": start.elapsed_time(end) / reps, "gpu_samples": GpuSampler.summary(samples)}


def bounds(records: list[dict], steps: list[dict]) -> list[dict]:
    """Each interleaved row's bound: bf16's step with its GEMMs swapped for the recipe's, and
    what the row spends over it (quantization and glue)."""
    by_set = {r["set"]: r for r in records}
    rows = {r["recipe"]: r for r in steps if "error" not in r}
    bf16, g_bf16 = rows.get("bf16"), by_set["bf16"]
    out = []
    for name, row in rows.items():
        g = by_set.get(name)
        if g is None or bf16 is None:
            continue
        bound_ms = bf16["step_ms"] - g_bf16["ms"] + g["ms"]
        out.append({"recipe": name, "measured_speedup": bf16["step_ms"] / row["step_ms"],
                    "bound_ms": bound_ms, "bound": bf16["step_ms"] / bound_ms,
                    "overhead_ms": row["step_ms"] - bound_ms})  # fmt: skip
    return out


def _cell(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.3B", choices=sorted(PRESETS))
    ap.add_argument("--steps-file", default=None, help="a train_interleaved.py JSON result")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    steps = json.loads(Path(args.steps_file).read_text()) if args.steps_file else []
    cuda = args.device == "cuda"
    model = args.model if cuda else "tiny"
    batch, seq, _ = PRESETS[args.model] if cuda else (1, 64, None)
    sampler = GpuSampler.for_device(args.device)
    records = []
    for kind in SETS:
        rec = {"set": kind, "model": model, "tokens": batch * seq}
        rec |= measure(step_gemms(kind, model, batch * seq, args.device), sampler, args.reps, cuda)
        records.append(rec)
        print(kind, {k: v for k, v in rec.items() if k != "gpu_samples"}, flush=True)
        if cuda:
            torch.cuda.empty_cache()
    lines = [f"`{' '.join(sys.argv)}`", "", f"Every linear GEMM of one {model} training step "
             f"({batch * seq} tokens), back to back, {args.reps} repetitions after one warm-up.",
             "", "| GEMMs | ms a step | power W | SM clock MHz | at power cap |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        gpu = r["gpu_samples"]
        cap = 100 * gpu["share_sw_power_cap"] if gpu else None
        lines.append(f"| {r['set']} | {_cell(r['ms'], '.1f')} | {_cell(gpu.get('power_w'), '.0f')}"
                     f" | {_cell(gpu.get('sm_mhz'), '.0f')} | {_cell(cap, '.0f')}% |")  # fmt: skip
    found = bounds(records, steps) if steps and cuda else []
    if found:
        lines += ["", f"Bounds from `{Path(args.steps_file).name}` (bf16's step with its GEMMs "
                  "replaced by the recipe's, everything else as bf16's):", "",
                  "| recipe | measured vs bf16 | bound ms | bound vs bf16 | over the bound ms |",
                  "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {b['recipe']} | {b['measured_speedup']:.2f}x | {b['bound_ms']:.1f} | "
                  f"{b['bound']:.2f}x | {b['overhead_ms']:.1f} |" for b in found]  # fmt: skip
    md, _ = write_results(f"step_gemms_{model}", records + found, "\n".join(lines),
                          out_dir=Path(args.out_dir), day=args.date)  # fmt: skip
    print(md.read_text())


if __name__ == "__main__":
    main()
