"""Could OCC's compensation run as a sparse product? (issue 13: fp4's last named lever)

    PYTHONPATH=src python benchmarks/occ_sparse_probe.py [--out-dir DIR] [--date D] [--tag T]
    PYTHONPATH=src python benchmarks/occ_sparse_probe.py --smoke     # CPU, small shapes

fp4 (OCC) computes fprop as y = Q(x_c)·Q(w)ᵀ + Q8(Δx)·Q8(w)ᵀ. The second product is a dense
E4M3 GEMM (occ_gemm.py), although Δx = x - clamp(x) is zero outside the entries OCC clips,
~2 % of them at alpha = 0.99. Restricting it to the outlier channels loses 5.5-8 dB
(benchmarks/occ_columns.py), so what is left is a product that skips the zeros wherever
they are. This probe times both at the 1.3B projections' shapes (M = 16384 tokens; K x N
= 2048 x 5632 for gate and up, 5632 x 2048 for down, 2048 x 2048 for q and o) on
recipe_sqnr.py's kind of input (Student-t with outlier channels, `sqnr.synthetic_activation`),
with fp4's own thresholds (`occ.thresholds`, sampled):
- dense: the compensation as fp4 runs it (`occ_gemm.fprop_correction`, E4M3 per row, bf16
  output), compiled, and its `_scaled_mm` alone on prepared operands;
- sparse: Δx in CSR (bf16 values) times wᵀ (bf16) by `torch.sparse.mm` (cuSPARSE SpMM), and
  the CSR conversion on its own (`--smoke`: float32, MKL has no bf16 SpMM). The SpMM alone,
  without the conversion and without matching the dense product's rounding, is a lower bound
  on any sparse compensation built on it.
GPU kernel time per call (profiler). Writes `occ_sparse_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import kernel_ms, probe_parser, write_probe  # noqa: E402
from minifloat import occ, occ_gemm, recipes  # noqa: E402
from minifloat.kernels import get_backend  # noqa: E402
from minifloat.sqnr import synthetic_activation, synthetic_weight  # noqa: E402

SHAPES = ((16384, 2048, 5632), (16384, 5632, 2048), (16384, 2048, 2048))  # M, K, N
SMOKE_SHAPES = ((64, 128, 96),)


def _inputs(m: int, k: int, n: int, device: str):
    """(x bf16 [m, k], w fp32 [n, k], clip (lo, hi)) with fp4's thresholds."""
    x = synthetic_activation(m, k, outlier_channels=max(4, k // 512)).to(device, torch.bfloat16)
    w = synthetic_weight(n, k).to(device)
    return x, w, occ.thresholds(x, recipes.get("fp4").occ)


def measure(m: int, k: int, n: int, device: str) -> dict:
    """Density of Δx and the kernel time of each form (None on the CPU)."""
    x, w, clip = _inputs(m, k, n, device)
    backend = get_backend("auto", torch.device(device))
    delta = occ.remainder(x.float(), *clip)
    density = float((delta != 0).float().mean())

    def dense():
        return occ_gemm.fprop_correction(backend, "e4m3", x, clip, w, True, torch.bfloat16)

    compiled = torch.compile(dense) if device == "cuda" else dense
    delta_q = backend.quantize(x, occ_gemm._E4M3_ROWS, clip=clip, remainder=True)
    w_q = backend.quantize(w, occ_gemm._E4M3_ROWS)

    def gemm():
        return backend.scaled_mm(delta_q, w_q, out_dtype=torch.bfloat16, fast_accum=True)

    # bf16 on the GPU (cuSPARSE); the CPU's MKL SpMM takes float32 only
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    delta_lp = delta.to(dtype)
    csr = delta_lp.to_sparse_csr()
    w_t = w.t().contiguous().to(dtype)

    def sparse():
        return torch.sparse.mm(csr, w_t)

    def convert():
        return delta_lp.to_sparse_csr()

    # the forms compute the same product: the sparse one in bf16 from unquantized Δx
    ref = (delta.double() @ w.double().t()).float()
    errors = {
        name: float((fn().float() - ref).norm() / ref.norm().clamp(min=1e-30))
        for name, fn in (("dense", compiled), ("sparse", sparse))
    }
    timed = {"dense_ms": compiled, "gemm_ms": gemm, "sparse_ms": sparse, "csr_ms": convert}
    times = {key: kernel_ms(fn) if device == "cuda" else None for key, fn in timed.items()}
    return dict(shape=[m, k, n], density=density, nnz=int(csr.values().numel()),
                rel_error=errors, **times)  # fmt: skip


def _fmt(v) -> str:
    return "—" if v is None else f"{v * 1e3:.1f}"


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--smoke", action="store_true", help="small shapes on the CPU, no timing")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("occ_sparse_probe needs a CUDA GPU (or --smoke)")
    device = "cpu" if args.smoke else "cuda"
    records, lines = [], []
    for m, k, n in SMOKE_SHAPES if args.smoke else SHAPES:
        r = measure(m, k, n, device)
        records.append(r)
        print(r, flush=True)
        lines.append(
            f"| {m} x {k} x {n} | {r['density'] * 100:.2f} % | {_fmt(r['dense_ms'])} | "
            f"{_fmt(r['gemm_ms'])} | {_fmt(r['sparse_ms'])} | {_fmt(r['csr_ms'])} | "
            f"{r['rel_error']['dense']:.1e} / {r['rel_error']['sparse']:.1e} |"
        )
    if args.smoke:
        return
    body = (
        "GPU kernel time per call in µs (profiler, 10 calls). "
        "dense: fp4's compensation (Δx and w to E4M3 per row, one FP8 GEMM, bf16 out), "
        "compiled; GEMM: its `_scaled_mm` alone; SpMM: `torch.sparse.mm` of Δx in CSR (bf16) "
        "by wᵀ (bf16); CSR: the conversion alone. Relative error of each against the float64 "
        "product of the unquantized Δx.\n\n"
        "| M x K x N | Δx nonzero | dense µs | GEMM µs | SpMM µs | CSR µs | error dense / "
        "SpMM |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    write_probe("occ_sparse_probe", args, records, body)


if __name__ == "__main__":
    main()
