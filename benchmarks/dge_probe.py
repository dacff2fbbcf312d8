"""What does DGE's weight-gradient correction cost on the GPU, and where? (issue 13)

    PYTHONPATH=src python benchmarks/dge_probe.py [--device cpu] [--out-dir DIR] [--date D]

A 1.3B fp4-dge step spends ~9 ms more GPU time than fp4-direct's (`train_e2e_1.3B_ours_s29_
fp4_prof_...`: 245.8 against 236.7 ms of kernels), though DGE adds only a read of dw and a write
of the corrected dw (8 bytes a weight, ~2.5 ms at copy bandwidth for 1.3B weights). The kernels
that carry it (the weight's E2M1 re-quantization, its transposed copy for dgrad and DGE's
rescaling of dw, fused by inductor) run at ~1.7 TB/s: arithmetic, not memory, binds them.

This compiles the backward's weight work of one linear as training does, for several weight
shapes, in variants:
- `direct`: fp4-direct's: the row-scaled E2M1 weight written transposed (no DGE);
- `dge_quotient`: fp4-dge's before session 39: f' at the float64 quotient w / s_w;
- `dge`: fp4-dge's as shipped (`dge.dge_derivative` at w · m_w, the "inv" multipliers; its
  power `pow` until session 58, a libdevice call on CUDA; since session 59 exp2·log2 on CUDA,
  `pow` on the CPU: `dge._power`). Its grid spacing came from frexp/ldexp until session
  40; session 40's `dge_bits` variant, the spacing read from the float32 bits (77.9 against
  115.7 us at 5632 x 2048, `results/dge_probe_h200_2026-11-28.md`), is what
  `FloatFormat.spacings` does since. Session 41's power from tables ran as `dge` in
  `results/dge_probe_h200_2026-11-28_s42.md` (there `dge_pow` is pow): faster alone (251
  against 269 us at 11008 x 4096), no faster in training, so dropped;
- `dge_split`: the same, but DGE compiled as a graph of its own, so that inductor cannot fuse it
  into the transposed E2M1 kernel (one 1-D pass over w and dw more: is the fused 2-D kernel's
  arithmetic the cost?);
- `dge_bits_exp2`: the same with |t|^(1/k-1) as exp2((1/k-1)·log2|t|) (on CUDA, since
  session 59, what `dge` computes, with the last interval's selects and a NaN select that `dge`
  no longer has; each variant's largest difference from `dge` is reported);
- `dge_bits_nopow`: the same without the power (a lower bound for the arithmetic, not DGE).
All but `dge_quotient` evaluate f' at w · m_w.
GPU kernel time per call (profiler), launches, the bytes of one ideal pass (w and dw read,
the E2M1 bytes and the corrected dw written) over that time as a share of copy, and whether the
compiled variant equals its eager form bit for bit. `--device cpu` runs small shapes eagerly and
compiled, without timing (a smoke test). Writes `dge_probe_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, copy_bandwidth, kernel_profile, same_bytes, write_results  # noqa: E402
from minifloat import dge  # noqa: E402
from minifloat.exact import div_rn_by_scale  # noqa: E402
from minifloat.kernels.operand import quantize_operand  # noqa: E402

VARIANTS = (
    "direct",
    "dge_quotient",
    "dge",
    "dge_split",
    "dge_bits_exp2",
    "dge_bits_nopow",
)
K, CAP = 5.0, 3.0


def _derivative(x: torch.Tensor, variant: str) -> torch.Tensor:
    """f'(x) of `variant` (float32 x), NaN kept."""
    if variant in ("dge", "dge_quotient", "dge_split"):
        return dge.dge_derivative(x, "e2m1", K, CAP)
    u = dge.grid_position(x, "e2m1").abs()
    exp2 = variant == "dge_bits_exp2"  # else dge_bits_nopow: no power at all (a bound)
    p = torch.exp2((1.0 / K - 1.0) * torch.log2(u)) if exp2 else u
    return torch.where(torch.isnan(x), x, ((1.0 / K) * p).clamp(max=CAP))


def weight_backward(w: torch.Tensor, dw: torch.Tensor, variant: str):
    """The backward's weight work of one linear: w's E2M1 row quantization written transposed
    (dgrad's operand) and, unless `direct`, dw * f'(w · m_w) (`dge_quotient`: f'(w / s_w))."""
    w_q, s_w, m_w = quantize_operand(w, "e2m1", "row", scale_format="inv", with_multiplier=True)
    w_q_t = w_q.t().contiguous()
    if variant == "direct":
        return w_q_t, s_w
    if variant == "dge_split":
        return w_q_t, m_w
    w_scaled = div_rn_by_scale(w, s_w) if variant == "dge_quotient" else w * m_w
    return w_q_t, dw * _derivative(w_scaled, variant)


def dge_alone(w: torch.Tensor, dw: torch.Tensor, m_w: torch.Tensor) -> torch.Tensor:
    """`dge_split`'s second graph: dw * f'(w · m_w) on its own."""
    return dw * _derivative(w * m_w, "dge")


def _split(first, second):
    """`dge_split` as one call: the transposed E2M1 weight, then DGE in a graph of its own."""

    def both(w: torch.Tensor, dw: torch.Tensor, variant: str = "dge_split"):
        w_q_t, m_w = first(w, dw, "dge_split")
        return w_q_t, second(w, dw, m_w)

    return both


def _max_rel_vs_head(w, dw, variant) -> float:
    """Largest relative difference of the corrected dw against `dge` (eager)."""
    ref = weight_backward(w, dw, "dge")[1].double()
    got = _eager(variant)(w, dw, variant)[1].double()
    return ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()


def _eager(variant: str):
    return _split(weight_backward, dge_alone) if variant == "dge_split" else weight_backward


def _compiled(variant: str):
    if variant == "dge_split":
        return _split(torch.compile(weight_backward), torch.compile(dge_alone))
    return torch.compile(weight_backward)


def run_case(n: int, k: int, device: str, timed: bool, copy_gbs: float) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, generator=gen) * 0.02
    dw = torch.randn(n, k, device=device, generator=gen)
    out = []
    for variant in VARIANTS:
        torch._dynamo.reset()
        fn = _compiled(variant)
        same = same_bytes(fn(w, dw, variant), _eager(variant)(w, dw, variant))
        rec = {"shape": [n, k], "variant": variant, "compiled_equals_eager": same}
        if variant.startswith("dge_"):
            rec["max_rel_vs_dge"] = _max_rel_vs_head(w, dw, variant)
        if timed:
            prof = kernel_profile(lambda fn=fn, v=variant: fn(w, dw, v), reps=20, top=4)
            moved = n * k * (4 + 1 + (8 if variant != "direct" else 0))  # one ideal pass
            rec |= {"kernel_us": prof["kernel_ms"] * 1e3, "kernels": prof["kernels"],
                    "pct_of_copy": 100 * moved / (prof["kernel_ms"] * 1e-3) / 1e9 / copy_gbs,
                    "top_kernels": prof["top_kernels"]}  # fmt: skip
        out.append(rec)
        print(n, k, variant, {k_: v for k_, v in rec.items() if k_ != "top_kernels"}, flush=True)
    return out


def _row(r: dict) -> str:
    timed = (f"{r['kernel_us']:.1f} | {r['kernels']:.0f} | {r['pct_of_copy']:.0f}%"
             if "kernel_us" in r else "— | — | —")  # fmt: skip
    rel = f"{r['max_rel_vs_dge']:.1e}" if "max_rel_vs_dge" in r else "—"
    return (f"| {r['shape'][0]}x{r['shape'][1]} | {r['variant']} | {timed} | "
            f"{r['compiled_equals_eager']} | {rel} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    ap.add_argument(
        "--shapes",
        default="5632x2048,2048x5632,2048x2048,11008x4096",
        help="weight shapes N x K, comma-separated (CUDA; the CPU smoke test: 96x64)",
    )
    args = ap.parse_args(argv)
    timed = args.device == "cuda"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    shapes = shapes if timed else [(96, 64)]
    copy_gbs = copy_bandwidth() if timed else 0.0
    records = [r for n, k in shapes for r in run_case(n, k, args.device, timed, copy_gbs)]
    body = (
        f"`{' '.join(sys.argv)}`\n\nCopy bandwidth {copy_gbs:.0f} GB/s. The backward's weight "
        "work of one linear, compiled (E2M1 row quantization written transposed, and DGE's "
        "rescaling of dw): GPU kernel time per call, launches, one ideal pass (w and dw read, "
        "E2M1 bytes and dw written; `direct`: w read, bytes written) as a share of copy; "
        "compiled equal to eager (bits); the largest relative difference of the corrected dw "
        "from `dge`'s.\n\n"
        "| weight | variant | kernel us | kernels | one pass vs copy | compiled = eager "
        "| max rel vs dge |\n|---|---|---|---|---|---|---|\n" + "\n".join(_row(r) for r in records)
    )
    md, _ = write_results("dge_probe", records, body, out_dir=Path(args.out_dir), day=args.date)
    print(md)


if __name__ == "__main__":
    main()
