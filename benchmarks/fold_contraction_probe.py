"""Does a compiler contract OCC's fold into an FMA? (issue 13: the fold by x_q's multiplier)

    PYTHONPATH=src:tests python benchmarks/fold_contraction_probe.py [--device cuda|cpu]
        [--out-dir DIR] [--date D] [--tag T]

occ.fold_remainder takes z = x_q + Δx·m_x, the float32 product and the sum each rounded, as eager
computes them. A compiler that contracts the two into a fused multiply-add rounds once and may
give another E4M3 byte of z. On inputs crafted so that it does in every clipped entry
(tests/test_occ.py `_inputs_a_contraction_would_change`), this compiles two forms and counts
the entries whose bytes differ from eager's two roundings, and those equal to one rounding's:
- `plain`: the remainder, times m_x, plus x_q (the form session 72 committed and reverted);
- `behind_select`: the library's, the product taken inside the remainder's select
  (`clip.remainder` with its multiplier).
On CUDA, inductor's Triton kernels allow FMA contraction; on the CPU inductor's C++ does not by
default, so `--device cpu` turns it on (`cpp.enable_floating_point_contract_flag`). Writes
`fold_contraction_probe[_<tag>]_<gpu or cpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import probe_parser, write_probe  # noqa: E402
from minifloat.kernels.clip import remainder  # noqa: E402
from minifloat.kernels.operand import round_to_storage  # noqa: E402
from test_occ import _inputs_a_contraction_would_change  # noqa: E402


def plain(x, lo, hi, x_values, m_x):
    return round_to_storage(x_values.float() + remainder(x, lo, hi) * m_x, "e4m3")


def behind_select(x, lo, hi, x_values, m_x):
    return round_to_storage(x_values.float() + remainder(x, lo, hi, m_x), "e4m3")


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fold_contraction_probe.py needs a CUDA GPU (or --device cpu)")
    x, lo, hi, x_values, _, m_x = _inputs_a_contraction_would_change()
    delta = remainder(x, lo, hi)
    twice = plain(x, lo, hi, x_values, m_x).view(torch.uint8)
    fused = (x_values.double() + delta.double() * m_x.double()).float()
    once = round_to_storage(fused, "e4m3").view(torch.uint8)
    clipped = delta != 0
    contract = {"cpp.enable_floating_point_contract_flag": "fast"} if args.device == "cpu" else {}
    records, lines = [], []
    for fn in (plain, behind_select):
        torch._dynamo.reset()
        with torch._inductor.config.patch(contract):
            inputs = (v.to(args.device) for v in (x, lo, hi, x_values, m_x))
            got = torch.compile(fn)(*inputs).cpu().view(torch.uint8)
        rec = {
            "form": fn.__name__,
            "device": args.device,
            "entries": got.numel(),
            "clipped": int(clipped.sum()),
            "one_rounding_differs": int((once != twice)[clipped].sum()),
            "differ_from_two_roundings": int((got != twice).sum()),
            "equal_to_one_rounding_where_it_differs": int(((got == once) & (once != twice)).sum()),
        }
        records.append(rec)
        lines.append(
            f"| {rec['form']} | {rec['clipped']} | {rec['one_rounding_differs']} "
            f"| {rec['differ_from_two_roundings']} "
            f"| {rec['equal_to_one_rounding_where_it_differs']} |"
        )
        print(lines[-1], flush=True)
    body = (
        f"Compiled on {args.device}. Entries {records[0]['entries']}.\n\n"
        "| form | clipped entries | of them, one rounding's byte differs | compiled differs "
        "from eager's two roundings | compiled equals one rounding (where it differs) |\n"
        "|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )
    write_probe("fold_contraction_probe", args, records, body)


if __name__ == "__main__":
    main()
