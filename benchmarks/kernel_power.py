"""Power and SM clock of single kernels run in a loop: does quantization cost GEMMs clock speed?

    PYTHONPATH=src python benchmarks/kernel_power.py [--seconds 4] [--device cpu]

A 1.3B step runs at the H200's 700 W power limit in every row (`train_interleaved_1.3B_ours_
s30_power_...`), so a row's GEMMs run at the clock that the rest of its work leaves them: the
same FP8 GEMMs took 4-8 % longer in fp8-tensorwise's row than in torchao's (session 29), whose
row ran at a higher median SM clock. If the quantization kernels draw more power than their
memory traffic needs (the float64 quotient of `exact.div_rn`, say), they pull the clock down
for the GEMMs beside them. This runs each workload back to back for `--seconds` and samples the
GPU (`gpu_sampler.py`):
- `copy`: a bf16 [16384, 5632] copy (memory only);
- `amax`: its absolute maximum (compiled);
- `cast_f64`: `quantize_operand(x, "e4m3", "tensor")` compiled, as training runs it (the
  quotient in float64);
- `cast_f32`: the same amax, the cast as x * (448 / amax) in float32 (torchao's form; not
  minifloat's numerics, a reference for the power);
- `given_f64`, `given_fma`, `given_bf16`, `given_mul`: the cast alone, its scale given (no amax
  pass), the quotient in float64 (minifloat's), in float32 with Markstein's two FMAs (exact, the
  same bits; `division_probe.py`'s, scale factors computed once), from a table of the 128
  bfloat16 significands' quotients (`division_probe.div_table_bf16`: exact, float32 and integer
  arithmetic) and as a float32 multiply by 1/s (inexact);
- `gemm_fp8`, `gemm_bf16`: [16384, 2048] x [2048, 5632] (the 1.3B gate projection's fprop).
Reports the per-call time, the bytes per second, and the median power and SM clock. `--device
cpu` runs each workload once on small tensors (a smoke test). Writes
`kernel_power_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, write_results  # noqa: E402
from division_probe import div_fma_by_factors, div_mul, div_table_bf16, fma_factors  # noqa: E402
from gpu_sampler import GpuSampler  # noqa: E402
from minifloat.exact import div_rn  # noqa: E402
from minifloat.kernels.operand import quantize_operand  # noqa: E402
from minifloat.kernels.scaled_mm import scaled_mm_rowish  # noqa: E402

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _cast_f32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax().float()
    scale = E4M3_MAX / amax
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def cast_given(x: torch.Tensor, scale: torch.Tensor, form: str, factors=None) -> torch.Tensor:
    """x / scale onto E4M3 (saturating), the quotient in `form`: f64, fma, bf16 or mul."""
    v = x.float()
    if form == "bf16":
        q = div_table_bf16(x, scale)
    elif form == "f64":
        q = div_rn(v, scale)
    elif form == "fma":
        q = div_fma_by_factors(v, factors)
    else:
        q = div_mul(v, scale)
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def workloads(m: int, k: int, n: int, device: str) -> dict:
    """name -> (callable, bytes it moves per call or None for GEMMs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(x)
    a = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16)
    a_q, w_q = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones(1, 1, device=device)
    amax = torch.compile(lambda t: t.abs().amax())
    cast64 = torch.compile(lambda t: quantize_operand(t, "e4m3", "tensor"))
    cast32 = torch.compile(_cast_f32)
    given = torch.compile(cast_given)
    scale = quantize_operand(x, "e4m3", "tensor")[1]
    factors = fma_factors(scale)
    elems = m * n
    return {
        "copy": (lambda: out.copy_(x), 4 * elems),
        "amax": (lambda: amax(x), 2 * elems),
        "cast_f64": (lambda: cast64(x), 2 * 2 * elems + elems),
        "cast_f32": (lambda: cast32(x), 2 * 2 * elems + elems),
        "given_f64": (lambda: given(x, scale, "f64"), 3 * elems),
        "given_fma": (lambda: given(x, scale, "fma", factors), 3 * elems),
        "given_bf16": (lambda: given(x, scale, "bf16"), 3 * elems),
        "given_mul": (lambda: given(x, scale, "mul"), 3 * elems),
        "gemm_fp8": (lambda: scaled_mm_rowish(a_q, one, w_q, one, out_dtype=torch.bfloat16,
                                              use_fast_accum=True), None),
        "gemm_bf16": (lambda: torch.mm(a, w.t()), None),
    }  # fmt: skip


def run(fn, seconds: float, sampler: GpuSampler, cuda: bool) -> dict:
    """`fn` back to back for about `seconds` (after a warm-up): calls, ms a call, samples."""
    fn()
    if not cuda:
        return {"calls": 1, "ms": None, "gpu_samples": {}}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls, batch = 0, 20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with sampler.collect() as samples:
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(batch):
                fn()
            calls += batch
            torch.cuda.synchronize()
        end.record()
        end.synchronize()
    ms = start.elapsed_time(end) / calls
    return {"calls": calls, "ms": ms, "gpu_samples": GpuSampler.summary(samples)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    m, k, n = (16384, 2048, 5632) if cuda else (64, 32, 48)
    sampler = GpuSampler.for_device(args.device)
    records, lines = [], []
    for name, (fn, nbytes) in workloads(m, k, n, args.device).items():
        rec = {"workload": name, "shape": [m, k, n]} | run(fn, args.seconds, sampler, cuda)
        gpu = rec["gpu_samples"]
        if rec["ms"] is not None and nbytes:
            rec["gb_per_s"] = nbytes / (rec["ms"] * 1e-3) / 1e9
        records.append(rec)
        print(name, {k_: v for k_, v in rec.items() if k_ != "gpu_samples"}, gpu, flush=True)
        lines.append(
            f"| {name} | {rec['ms'] or 0:.3f} | {rec.get('gb_per_s', 0):.0f} | "
            f"{gpu.get('power_w', 0):.0f} | {gpu.get('sm_mhz', 0):.0f} | "
            f"{100 * gpu.get('share_sw_power_cap', 0):.0f}% |"
        )
    body = (
        f"`{' '.join(sys.argv)}`\n\nEach workload back to back for ~{args.seconds} s; "
        f"x bf16 [{m}, {n}], GEMMs [{m}, {k}] x [{k}, {n}]. GB/s counts the bytes one call "
        "moves (copy: read + write; amax: read; casts: the amax's read, the cast's read and its "
        "write; given: the cast's read and write); power and SM clock are the NVML samples' "
        "medians.\n\n"
        "| workload | ms a call | GB/s | power W | SM clock MHz | at power cap |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    md, _ = write_results("kernel_power", records, body, out_dir=Path(args.out_dir), day=args.date)
    print(md)


if __name__ == "__main__":
    main()
