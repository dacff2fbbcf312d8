"""Why does inductor's plain FP8 cast run at ~58 % of copy bandwidth? (issue 13, bandwidth)

    PYTHONPATH=src python benchmarks/cast_probe.py [--out-dir DIR] [--date D] [--tag T]
        [--shapes M:K,...] [--dump DIR]

Session 52 found that a plain scaled E4M3 cast of bf16 x (one output, no other arithmetic)
compiled by inductor moves its 3 bytes an element at 56-59 % of the measured copy bandwidth
(`fold_probe_s52_...`): slower in time than a bf16 copy of the same tensor, which moves 4.
Every quantizer's cast pass is such a kernel. Before any change to how the library's casts are
written or compiled, this probe asks where that time goes, timing the same pass several ways
(bf16 [M, K] in, E4M3 out, the multiplier m loaded at run time):
- `copy bf16 (ATen)`: `out.copy_(x)`, 4 bytes an element: the ceiling a kernel can reach;
- `cast (ATen)`: `out8.copy_(x)`, ATen's own conversion (no multiplier);
- `inductor tensor m` / `inductor row m`: `(x.float() * m).clamp(-448, 448).to(e4m3)` compiled,
  m a [1, 1] or an [M, 1] float32 tensor (the library's tensor and row cast passes);
- `inductor ..., coordinate descent`: the same with `coordinate_descent_tuning=True`;
- `inductor col m`: m a [1, K] tensor, a multiplier per column (the casts of operands that
  wgrad reads transposed, row- and block-scaled recipes: 60-65 % of copy in session 47);
- `inductor tensor m / row m, ±448 by selects`: the clamp as two compare-selects without a
  NaN test (the same bits; session 72);
- `inductor row m, OCC clamp / bare clamp / finite test`: fold_probe's "plain cast" floor,
  which clamped by OCC's bounds first (`kernels/clip.clamp`), and its two halves;
- `triton cast BLOCK/warps` (tensor m) and `triton row/col cast` (2-D tiles): hand-written
  Triton kernels of the same arithmetic, whose bytes must equal inductor's;
- `triton copy BLOCK/warps`: a hand-written bf16 copy, Triton's own ceiling.
Time: GPU kernel time per call (profiler, 10 calls). Bandwidth = bytes (2 read + 1 written, a
copy 2 + 2) over that time, as a share of the measured copy bandwidth. The launch geometry of
each kernel (grid, block) is read from the profiler's trace. With --dump, inductor's generated
source of each compiled variant is written there.
Session 58 (`cast_probe_s58_h200_2026-11-30.md`): inductor's scaled cast runs at 89-92 % of
copy, ~100 % without its clamp to ±448 or with coordinate descent's larger blocks, as the
hand-written kernels do; OCC's clamp takes it to 58-59 % (session 52's "plain cast"). These
casts are bound by their instructions: inductor writes each clamp bound as a NaN-propagating
compare and select. Compiled, the unclamped cast equals the clamped one bit for bit (Triton's
conversion saturates): `satfinite_check`, reported first.
Writes `cast_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import (  # noqa: E402
    copy_bandwidth,
    kernel_profile,
    probe_parser,
    require_cuda,
    same_bytes,
    write_probe,
)
from minifloat.kernels import clip  # noqa: E402
from minifloat.partition_hints import finite  # noqa: E402

E4M3_MAX = 448.0
_MAX = tl.constexpr(E4M3_MAX)  # a Triton kernel reads module globals only as constexprs
TRITON_CONFIGS = ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16))
ROW_TILES = ((8, 1024, 4), (16, 512, 4), (32, 256, 4), (4, 2048, 8))


@triton.jit
def _cast_kernel(x_ptr, m_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = E4M3(clamp(x * m, ±448)), m one float32, BLOCK elements a program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * tl.load(m_ptr)
    v = tl.minimum(tl.maximum(v, -_MAX), _MAX)
    tl.store(out_ptr + offs, v.to(tl.float8e4nv), mask=mask)


@triton.jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x, BLOCK elements a program: Triton's own copy ceiling."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _tile_cast_kernel(
    x_ptr, m_ptr, out_ptr, rows, cols, BR: tl.constexpr, BC: tl.constexpr, COL: tl.constexpr
):
    """The cast of a BR x BC tile, m per row ([rows]) or, with COL, per column ([cols])."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    offs = r[:, None].to(tl.int64) * cols + c[None, :]
    if COL:  # a multiplier per column
        m = tl.load(m_ptr + c, mask=c < cols)[None, :]
    else:
        m = tl.load(m_ptr + r, mask=r < rows)[:, None]
    v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * m
    v = tl.minimum(tl.maximum(v, -_MAX), _MAX)
    tl.store(out_ptr + offs, v.to(tl.float8e4nv), mask=mask)


def scaled_cast(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The library's cast pass with a given multiplier and its clamp to ±448
    (`round_to_storage(x * m, "e4m3")`'s `torch.clamp`)."""
    return clamped_cast(x, m, torch.float8_e4m3fn)


def unclamped_cast(
    x: torch.Tensor, m: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """The cast without the clamp to the format's range: equal to the clamped one only where
    the conversion itself saturates (Triton's on sm_90 is `cvt.rn.satfinite`; ATen's gives NaN
    (E4M3) or inf (E5M2) past the range): see `satfinite_check`."""
    return (x.float() * m).to(dtype)


def clamped_cast(x: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The library's saturating cast to `dtype`: clamp to its range, then ATen's cast."""
    fmt_max = torch.finfo(dtype).max
    return (x.float() * m).clamp(-fmt_max, fmt_max).to(dtype)


def satfinite_check() -> dict:
    """Compiled `unclamped_cast` against eager `clamped_cast` (ATen's cast) per FP8 dtype, at
    the values where they could differ: the range's edge, past it, ±inf and NaN, and 4M random
    float32 bit patterns (NaN payloads and signs among them)."""
    result = {}
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), dtype=torch.int32, device="cuda")
    one = torch.ones(1, 1, device="cuda")
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        top = torch.finfo(dtype).max
        edge = [top, top * 1.01, top * 1.0625, top * 1.07, top * 2, 3.4e38, float("inf")]
        edge += [float("nan")]
        v = torch.tensor(edge + [-e for e in edge], device="cuda")
        v = torch.cat([v, bits.view(torch.float32)]).reshape(1, -1)
        torch._dynamo.reset()
        got = torch.compile(unclamped_cast, fullgraph=True)(v, one, dtype)
        want = clamped_cast(v, one, dtype)
        differ = got.view(torch.uint8) != want.view(torch.uint8)
        result[str(dtype).removeprefix("torch.")] = {
            "values": v.numel(), "differ": int(differ.sum()), "examples": v[differ][:6].tolist()
        }  # fmt: skip
    return result


def select_saturated_cast(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The clamped cast with each bound as one compare-select and no NaN test (a NaN fails both
    comparisons and passes through, -0.0 stays, ±inf goes to ±448): the clamp's bits by
    construction; its rows' "bytes" column compares them with `scaled_cast`'s (this probe's
    inputs stay within ±448; tests/test_operand.py checks a compiled saturating cast at the
    edges). Session 72 wrote `round_to_storage`'s bounds so, E2M1's `|q| <= 6` too; in training
    the compiled fp4 block then saved its E4M3 operands (+3.6 GiB at 1.3B), which E2M1's
    select alone causes on a CPU check (the FP8 bounds alone do not: branch `s72-fp8-select`,
    not timed), so the library keeps `torch.clamp` (docs/hopper_sessions.md, session 72)."""
    v = x.float() * m
    return torch.where(v > E4M3_MAX, E4M3_MAX, torch.where(v < -E4M3_MAX, -E4M3_MAX, v)).to(
        torch.float8_e4m3fn
    )


def occ_clamped_cast(x, lo, hi, m):
    """fold_probe's "x_q only, E4M3 cast" floor: OCC's clamp (`kernels/clip.clamp`: non-finite
    entries passed through), then the cast."""
    return scaled_cast(clip.clamp(x, lo, hi), m)


def bare_clamped_cast(x, lo, hi, m):
    """The same without the non-finite pass-through: `torch.clamp` by tensor bounds alone."""
    return scaled_cast(torch.clamp(x.float(), lo, hi), m)


def finite_cast(x, lo, hi, m):
    """The non-finite test alone (`partition_hints.finite`), no clamp."""
    xf = x.float()
    return scaled_cast(torch.where(finite(xf), xf, lo - lo), m)


def launch_geometry(fn, reps: int = 2) -> dict[str, list]:
    """{kernel name: [grid, block]} of the kernels `fn` launches, from the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    geometry = {}
    for e in events:
        if e.get("cat") == "kernel":
            args = e.get("args", {})
            geometry[e["name"][:80]] = [args.get("grid"), args.get("block")]
    return geometry


def variants(
    x: torch.Tensor, m_t: torch.Tensor, m_r: torch.Tensor, m_c: torch.Tensor
) -> tuple[list, torch.Tensor]:
    """([(name, fn, bytes per element, reference output or None, (function, args) compiled by
    inductor or None)], the E4M3 buffer the hand-written kernels write)."""
    n = x.numel()
    rows, cols = x.shape
    out16 = torch.empty_like(x)
    out8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    lo, hi = (torch.full((1, 1), v, device="cuda") for v in (-6.0, 6.0))
    found: list[tuple] = [
        ("copy bf16 (ATen)", lambda: out16.copy_(x), 4, None, None),
        ("cast (ATen)", lambda: out8.copy_(x), 3, None, None),
    ]
    compiled_forms = [
        ("inductor tensor m", scaled_cast, (x, m_t)),
        ("inductor row m", scaled_cast, (x, m_r)),
        ("inductor col m", scaled_cast, (x, m_c)),
        ("inductor row m, no ±448 clamp", unclamped_cast, (x, m_r)),
        ("inductor tensor m, ±448 by selects", select_saturated_cast, (x, m_t)),
        ("inductor row m, ±448 by selects", select_saturated_cast, (x, m_r)),
        ("inductor row m, OCC clamp", occ_clamped_cast, (x, lo, hi, m_r)),
        ("inductor row m, bare clamp", bare_clamped_cast, (x, lo, hi, m_r)),
        ("inductor row m, finite test", finite_cast, (x, lo, hi, m_r)),
    ]
    for name, function, call_args in compiled_forms:
        # the select form against the clamp's bytes; every other form against its own eager
        ref = (scaled_cast if function is select_saturated_cast else function)(*call_args)
        for opts, suffix in (({}, ""), ({"coordinate_descent_tuning": True}, ", coord. descent")):
            if suffix and not name.endswith(" m"):  # the plain casts only
                continue
            torch._dynamo.reset()
            c = torch.compile(function, fullgraph=True, options=opts)
            run = lambda c=c, a=call_args: c(*a)  # noqa: E731
            found.append((name + suffix, run, 3, ref, None if suffix else (function, call_args)))
    ref_t, ref_r = scaled_cast(x, m_t), scaled_cast(x, m_r)
    for block, warps in TRITON_CONFIGS:
        grid = (triton.cdiv(n, block),)
        cast = lambda g=grid, b=block, w=warps: _cast_kernel[g](  # noqa: E731
            x, m_t, out8, n, BLOCK=b, num_warps=w
        )
        copy = lambda g=grid, b=block, w=warps: _copy_kernel[g](  # noqa: E731
            x, out16, n, BLOCK=b, num_warps=w
        )
        found.append((f"triton cast {block}/{warps}", cast, 3, ref_t, None))
        found.append((f"triton copy {block}/{warps}", copy, 4, None, None))
    ref_c = scaled_cast(x, m_c)
    for (br, bc, warps), (label, m, ref) in itertools.product(
        ROW_TILES, (("row", m_r, ref_r), ("col", m_c, ref_c))
    ):
        grid = (triton.cdiv(rows, br), triton.cdiv(cols, bc))
        tile = lambda g=grid, a=br, b=bc, w=warps, m=m, col=label == "col": _tile_cast_kernel[g](  # noqa: E731
            x, m, out8, rows, cols, BR=a, BC=b, COL=col, num_warps=w
        )
        found.append((f"triton {label} cast {br}x{bc}/{warps}", tile, 3, ref, None))
    return found, out8


def run_shape(rows: int, cols: int, copy_gbs: float, dump: Path | None) -> list[dict]:
    """Every variant at one shape: records (printed as they come), sources dumped."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(rows, cols, generator=g) * 3.0).bfloat16().cuda()
    m_t = (E4M3_MAX / x.float().abs().amax()).reshape(1, 1)
    m_r = E4M3_MAX / x.float().abs().amax(dim=1, keepdim=True)
    records = []
    m_c = E4M3_MAX / x.float().abs().amax(dim=0, keepdim=True)
    found, out8 = variants(x, m_t, m_r, m_c)
    for name, fn, bytes_per, ref, source in found:
        result = fn()
        torch.cuda.synchronize()
        got = result if name.startswith("inductor") else out8
        exact = None if ref is None else same_bytes(got, ref)
        prof = kernel_profile(fn, reps=10, top=3)
        us = prof["kernel_ms"] * 1000.0
        gbs = bytes_per * x.numel() / (us * 1e3)
        rec = {
            "shape": f"{rows}x{cols}", "variant": name, "kernel_us": round(us, 1),
            "kernels": prof["kernels"], "gb_s": round(gbs),
            "vs_copy": round(gbs / copy_gbs, 3),
            "bytes_equal_reference": exact, "geometry": launch_geometry(fn),
        }  # fmt: skip
        records.append(rec)
        print(rec, flush=True)
        if dump is not None and source is not None:
            from torch._inductor.utils import run_and_get_code

            torch._dynamo.reset()
            _, code = run_and_get_code(torch.compile(source[0], fullgraph=True), *source[1])
            tag = name.replace(" ", "_").replace(",", "")
            (dump / f"{rows}x{cols}_{tag}.py").write_text("\n\n".join(code))
    return records


def main() -> None:
    """Every variant at every --shapes shape; the results file."""
    ap = probe_parser(__doc__)
    ap.add_argument("--shapes", default="16384:4096,16384:11008")
    ap.add_argument("--dump", default=None, help="write inductor's generated sources here")
    args = ap.parse_args()
    require_cuda("cast_probe.py")
    dump = Path(args.dump) if args.dump else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    copy_gbs = copy_bandwidth()
    check = satfinite_check()
    print("satfinite check:", check, flush=True)
    records = [{"satfinite_check": check}]
    for spec in args.shapes.split(","):
        rows, cols = (int(v) for v in spec.split(":"))
        records += run_shape(rows, cols, copy_gbs, dump)
    lines = [
        f"Copy bandwidth {copy_gbs:.0f} GB/s. GPU kernel time per call (profiler, 10 calls); "
        "GB/s = bytes (cast: 2 read + 1 written; copy: 2 + 2) over that time.",
        "",
        "| shape | variant | kernel us | kernels | GB/s | vs copy | bytes = inductor's "
        "| grid, block |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines.insert(
        0,
        "Compiled cast without the clamp to the format's range against eager clamp-then-cast: "
        + "; ".join(
            f"{k}: {c['differ']} of {c['values']} values differ (examples {c['examples']})"
            for k, c in check.items()
        )
        + ".\n",
    )
    for r in records[1:]:
        geometry = "; ".join(f"{g} x {b}" for g, b in r["geometry"].values())
        eq = {None: "", True: "yes", False: "**no**"}[r["bytes_equal_reference"]]
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['kernel_us']} | {r['kernels']:g} "
            f"| {r['gb_s']} | {100 * r['vs_copy']:.0f}% | {eq} | {geometry} |"
        )
    write_probe("cast_probe", args, records, "\n".join(lines))


if __name__ == "__main__":
    main()
