"""What does fp4's forward pass over x cost beyond its bytes? (issue 13, the fp4 layer at 7B shapes)

    PYTHONPATH=src python benchmarks/fold_probe.py [--out-dir DIR] [--date D] [--tag T]
        [--shapes M:K,...] [--device cuda|cpu] [--variants NAME;NAME...]

Under fp4 (OCC, E4M3 compensation) one compiled kernel reads the layer input x (bf16 [M, K])
and writes three FP8 operands: x_q = Q_E2M1(clamp(x)) (fprop), Δx_q = Q_E4M3(Δx) (the
compensation GEMM's) and z = Q_E4M3((x_q + Δx / s_x) / t) (wgrad's, occ.fold_remainder's
form by the quotient, fp4's until session 76, transposed). Profiled at 7B shapes (sessions 51
and 52) it moved its 5 bytes an element at ~1.9 TB/s, under half the copy bandwidth. This
probe times that kernel alone, its row scalars given, in forms that drop one piece at a time
(rows marked "inexact" are timing bounds whose bits differ from the library's definition):
- `library`: the library's arithmetic before session 76, z by the quotient Δx / s_x (z
  row-major; `library, z transposed`: as fp4 writes it);
  `..., E2M1 by products`: with the E2M1 rounding used before session 52 (same bits);
- `Δx inv`: Δx_q as round(Δx · m_Δ), a float32 product by an "inv" multiplier, rather than
  the float64 quotient by its fp32 scale (a definition change of the compensation operand);
- `Δx inv, z by m (inexact)`: also z = x_q + Δx · m_x in float32 (FMA contraction may make
  the compiled bits differ from eager; the count of differing bytes is reported);
- `z without Δx`, `x_q only`, `x_q only, E4M3 cast`, `three casts`: floors (no remainder in z;
  one output; a plain FP8 cast of one output; three scaled casts of x, none of OCC's
  arithmetic).
Session 52 (`fold_probe_s52{,_magic}_h200_2026-11-29.md`, where "library" is the products form
and "E2M1 by magic" today's): the float64 work and the transposed store cost little (`library`
0.164 ms at 16384 x 4096, `Δx inv` 0.164, `z by m` 0.158, z transposed +0.011); one output,
the `x_q only, E4M3 cast` floor, runs at 56-59 % of copy bandwidth and three at 71-75 %. That
floor clamps to OCC's bounds first, and the clamp's instructions are what cost: a scaled cast
without it runs at 90-100 % (session 58, `benchmarks/cast_probe.py`).
E2M1 by two additions was 1-2 % faster than by products in every shape.
- `fold_remainder`, `fold_remainder by the quotient` and `fold_remainder before session 71`:
  z alone as backward recomputes it (x_q again from x, then occ.fold_remainder). fp4's form
  since session 76 takes Δx·m_x on x_q's multiplier, one float32 product kept out of FMA
  contraction by the remainder's select (exact, unlike `z by m (inexact)` above); by the
  quotient, Δx / s_x in float64, is its form for scales without a multiplier and fp4's before
  session 76; before session 71 it also divided z by t in float64 (`div_rn_by_scale`) where
  it now multiplies by 1 / t in float32, the same bytes as the quotient form (the header's
  "gives its bytes before session 71"). The two forms of Δx differ by at most one float32
  ulp, rarely in an E4M3 byte of z (0 of 92M and 34M bytes in sessions 72 and 76); the count
  is reported.
Bits: every exact row is checked compiled against eager, and `library`'s z against
occ.fold_remainder by the quotient. Bandwidth = (2 bytes read + 1 per output) / kernel time, as
a share of the measured copy bandwidth. Writes `fold_probe[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import copy_bandwidth, kernel_profile, probe_parser, same_bytes, write_probe  # noqa: E402
from minifloat import formats, occ  # noqa: E402
from minifloat.exact import div_rn, div_rn_by_scale  # noqa: E402
from minifloat.formats import inv_scales  # noqa: E402
from minifloat.kernels.clip import clamp, remainder, remainder_row_amax  # noqa: E402
from minifloat.kernels.operand import round_to_storage  # noqa: E402

E2M1_MAX, E4M3_MAX = 6.0, 448.0


def make_inputs(m: int, k: int, device: str) -> dict[str, torch.Tensor]:
    """x (bf16, Student-t-like with outlier channels) and every row scalar the kernel reads,
    computed as the library computes them (eagerly: the probe times the elementwise pass)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g) / torch.rand(m, k, generator=g).clamp(min=0.05).sqrt()
    x[:, torch.randperm(k, generator=g)[: k // 64]] *= 8.0  # outlier channels
    x = x.bfloat16().to(device)
    sample = x.float().flatten()[::97]
    lo, hi = (torch.quantile(sample, q).reshape(1, 1) for q in (0.01, 0.99))
    # bf16-representable bounds, as the sampled quantile gives (an element of x)
    lo, hi = lo.bfloat16().float(), hi.bfloat16().float()
    xc, delta = clamp(x, lo, hi), remainder(x, lo, hi)
    m_x, s_x = inv_scales(xc.abs().amax(dim=1, keepdim=True), E2M1_MAX)
    d_amax = delta.abs().amax(dim=1, keepdim=True)
    m_d, s_d = inv_scales(d_amax, E4M3_MAX)
    bound = (E2M1_MAX + (d_amax.double() / s_x.double()).float()).amax()
    t = 2.0 ** torch.ceil(torch.log2((bound / E4M3_MAX).clamp(min=1.0)))
    return {
        "x": x, "lo": lo, "hi": hi, "m_x": m_x, "s_x": s_x, "m_d": m_d,
        "r_x": s_x.double().reciprocal(), "r_d": s_d.double().reciprocal(),
        "inv_t": (1.0 / t).reshape(1, 1),
    }  # fmt: skip


def e2m1_by_products(q: torch.Tensor) -> torch.Tensor:
    """The E2M1 rounding of `round_to_storage` before session 52, the same bits: |q| times
    1/spacing, rounded to an integer (`torch.round`), times the spacing (both powers of two
    from the exponent bits). Session 52 replaced it by two additions (`_e2m1_magnitude`)."""
    mag = q.abs().clamp(max=E2M1_MAX)
    step, inv_step = formats.get("e2m1").spacings(mag)
    return torch.copysign(torch.round(mag * inv_step) * step, q).to(torch.float8_e4m3fn)


def e2m1(q: torch.Tensor) -> torch.Tensor:
    return round_to_storage(q, "e2m1")


def e4m3(q: torch.Tensor) -> torch.Tensor:
    return round_to_storage(q, "e4m3")


def _xq(xf, lo, hi, m_x, rounding=e2m1):
    return rounding(clamp(xf, lo, hi) * m_x)


def library(
    x, lo, hi, m_x, r_x, m_d, r_d, inv_t, transposed=False, delta_inv=False, rounding=e2m1
):  # fmt: skip
    xf = x.float()
    xv = _xq(xf, lo, hi, m_x, rounding)
    d = remainder(xf, lo, hi)
    d64 = d.double()
    dq = (d * m_d) if delta_inv else (d64 * r_d).float()
    z = xv.float() + (d64 * r_x).float()
    zq = e4m3(z * inv_t)
    return xv, e4m3(dq), zq.t().contiguous() if transposed else zq


def z_by_m(x, lo, hi, m_x, r_x, m_d, r_d, inv_t):
    xf = x.float()
    xv = _xq(xf, lo, hi, m_x)
    d = remainder(xf, lo, hi)
    zq = e4m3((xv.float() + d * m_x) * inv_t)
    return xv, e4m3(d * m_d), zq


def z_without_delta(x, lo, hi, m_x, r_x, m_d, r_d, inv_t):
    xf = x.float()
    xv = _xq(xf, lo, hi, m_x)
    d = remainder(xf, lo, hi)
    return xv, e4m3(d * m_d), e4m3(xv.float() * inv_t)


def xq_only(x, lo, hi, m_x, r_x, m_d, r_d, inv_t, rounding=e2m1):
    return (_xq(x.float(), lo, hi, m_x, rounding),)


def three_casts(x, lo, hi, m_x, r_x, m_d, r_d, inv_t):
    xf = x.float()
    return tuple(e4m3(xf * s) for s in (m_x, m_d, inv_t))


def fold_before_s71(x, lo, hi, x_values, x_scale, x_multiplier, values_max):
    """occ.fold_remainder as it was before session 71: Δx / s_x and z / t as float64 quotients
    (`x_multiplier` unused)."""
    delta_max = div_rn(remainder_row_amax(x, lo, hi), x_scale.float())
    z = x_values.float() + div_rn_by_scale(remainder(x, lo, hi), x_scale.float())
    bound = (values_max + delta_max).amax()
    bounds = E4M3_MAX * 2.0 ** torch.arange(
        occ._FOLD_EXPONENTS, device=z.device, dtype=torch.float32
    )
    t = torch.where(bound > bounds, 2.0, 1.0).prod().reshape(1, 1)
    return round_to_storage(div_rn_by_scale(z, t), "e4m3"), t


def backward_z(x, lo, hi, m_x, s_x, fold=occ.fold_remainder, by_multiplier=True):
    """z as fp4's backward recomputes it: x_q from x, then the fold (values only), with Δx on
    x_q's multiplier m_x (fp4's form) or by the quotient Δx / s_x (`by_multiplier=False`)."""
    m = m_x if by_multiplier else None
    return (fold(x, lo, hi, _xq(x.float(), lo, hi, m_x), s_x, m, E2M1_MAX)[0],)


VARIANTS: list[tuple[str, Callable, bool]] = [  # (name, function, exact: compiled == eager)
    ("library", library, True),
    ("library, z transposed", lambda *a: library(*a, transposed=True), True),
    ("Δx inv", lambda *a: library(*a, delta_inv=True), True),
    ("Δx inv, z transposed", lambda *a: library(*a, transposed=True, delta_inv=True), True),
    ("Δx inv, z by m (inexact)", z_by_m, False),
    ("z without Δx (floor)", z_without_delta, True),
    ("x_q only (floor)", xq_only, True),
    ("x_q only, E2M1 by products", lambda *a: xq_only(*a, rounding=e2m1_by_products), True),
    ("x_q only, E4M3 cast (floor)", lambda *a: xq_only(*a, rounding=e4m3), True),
    ("library, E2M1 by products", lambda *a: library(*a, rounding=e2m1_by_products), True),
    (
        "library, E2M1 by products, z transposed",
        lambda *a: library(*a, transposed=True, rounding=e2m1_by_products),
        True,
    ),
    ("three casts (floor)", three_casts, True),
]


def select_variants(variants: list, args) -> list:
    """The variants named in --variants (';'-separated), all without it; an unknown name is an
    error."""
    if not args.variants:
        return variants
    names = args.variants.split(";")
    unknown = set(names) - {name for name, _, _ in variants}
    if unknown:
        raise SystemExit(f"fold_probe.py: unknown --variants {sorted(unknown)}")
    return [v for v in variants if v[0] in names]


def _differing_bytes(a: tuple, b: tuple) -> int:
    return sum(
        int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) for x, y in zip(a, b, strict=True)
    )


def _shape_checks(inp: dict, call_args: list, fold_args: tuple) -> dict:
    """One shape's equalities between the probe's forms and the library's (eager)."""
    eager_lib = library(*call_args)
    folded, _ = occ.fold_remainder(
        inp["x"], inp["lo"], inp["hi"], eager_lib[0], inp["s_x"], None, E2M1_MAX
    )
    # the same bytes at these inputs' t (1 here) and with one entry large enough for t > 1
    big = inp["x"].clone()
    big[0, 0] = 3e4
    same_as_before = all(
        same_bytes(backward_z(*a, by_multiplier=False), backward_z(*a, fold=fold_before_s71))
        for a in (fold_args, (big, *fold_args[1:]))
    )
    return {
        "library_z_is_fold_remainder": same_bytes(folded, eager_lib[2]),
        "products_is_library": same_bytes(
            library(*call_args, rounding=e2m1_by_products), eager_lib
        ),
        "fold_same_bytes_as_before": same_as_before,
        "fold_by_m_differing_bytes": _differing_bytes(
            backward_z(*fold_args), backward_z(*fold_args, by_multiplier=False)
        ),
    }


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--shapes", default="16384:4096,16384:11008,16384:2048")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default=None, help="';'-separated names (default: all)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("fold_probe.py needs a CUDA GPU (or --device cpu for a check)")
    copy_gbs = copy_bandwidth() if cuda else float("nan")
    records, lines = [], []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split(":"))
        inp = make_inputs(m, k, args.device)
        keys = ("x", "lo", "hi", "m_x", "r_x", "m_d", "r_d", "inv_t")
        call_args = [inp[key] for key in keys]
        fold_args = (inp["x"], inp["lo"], inp["hi"], inp["m_x"], inp["s_x"])
        checks = _shape_checks(inp, call_args, fold_args)
        folds = {
            "fold_remainder": lambda *_, a=fold_args: backward_z(*a),
            "fold_remainder by the quotient": lambda *_, a=fold_args: backward_z(
                *a, by_multiplier=False
            ),
            "fold_remainder before session 71": lambda *_, a=fold_args: backward_z(
                *a, fold=fold_before_s71
            ),
        }
        variants = select_variants(VARIANTS + [(n, fn, True) for n, fn in folds.items()], args)
        for name, fn, exact in variants:
            torch._dynamo.reset()
            compiled = torch.compile(fn)
            out = compiled(*call_args)
            diff = _differing_bytes(out, fn(*call_args))
            rec = {"m": m, "k": k, "variant": name, "exact": exact, "compiled_vs_eager_bytes": diff,
                   **checks}  # fmt: skip
            if cuda:
                prof = kernel_profile(functools.partial(compiled, *call_args), reps=10, top=3)
                nbytes = m * k * (2 + len(out))
                gbs = nbytes / prof["kernel_ms"] / 1e6
                rec.update(kernel_ms=prof["kernel_ms"], kernels=prof["kernels"], gbs=gbs,
                           copy_share=gbs / copy_gbs, top=prof["top_kernels"])  # fmt: skip
            records.append(rec)
            ms = rec.get("kernel_ms", float("nan"))
            lines.append(
                f"| {m} x {k} | {name} | {ms:.3f} | {rec.get('gbs', float('nan')):.0f} "
                f"({rec.get('copy_share', float('nan')):.0%}) | {diff} |"
            )
            print(lines[-1], flush=True)
    first = [r for r in records if r["variant"] == records[0]["variant"]]  # one per shape
    body = (
        f"copy bandwidth {copy_gbs:.0f} GB/s; `library`'s z equals occ.fold_remainder by the "
        "quotient: "
        f"{all(r['library_z_is_fold_remainder'] for r in records)}; E2M1 by products gives "
        f"`library`'s bytes: {all(r['products_is_library'] for r in records)}; "
        "`fold_remainder by the quotient` gives its bytes before session 71: "
        f"{all(r['fold_same_bytes_as_before'] for r in records)}; `fold_remainder` (Δx·m_x) "
        "differs from it in "
        + ", ".join(f"{r['fold_by_m_differing_bytes']} of {r['m'] * r['k']}" for r in first)
        + " bytes\n\n"
        "| M x K | variant | kernel ms | GB/s (share of copy) "
        "| compiled vs eager: differing bytes |\n"
        "|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )
    write_probe("fold_probe", args, records, body)


if __name__ == "__main__":
    main()
