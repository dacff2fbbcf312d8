"""Do the column- and block-scaled casts pay for loading their scales per element? (GPU probe)

    PYTHONPATH=src python benchmarks/nd_tiling_probe.py [--out-dir DIR] [--date D]
    python benchmarks/nd_tiling_probe.py --render RESULTS.json    # the table again, no GPU

The per-pass table of quantizer_bandwidth.py (kernels.py then; session 28) put the casts of
transposed row-scaled operands (one scale per column of x) at ~60-64 % of copy bandwidth against
~85-90 % for row-scaled casts with the same bytes. Inductor emits both as 1-D kernels, so the
column casts load their float64 reciprocal once per element (8 bytes from L1 for 2 read and 1
written), where a row's is one broadcast value. This times every memory pass of the row, column
and block quantizers at M = 16384 by inductor's default (1-D) tiling and with
`triton.prefer_nd_tiling`, whose 2-D tiles load a column's reciprocal once per tile column
(passes and bytes as in quantizer_bandwidth.py).
Results: benchmarks/results/nd_tiling_probe_<gpu>_<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quantizer_bandwidth as kernels  # noqa: E402
from common import copy_bandwidth, write_results  # noqa: E402
from minifloat.kernels import operand  # noqa: E402

SHAPES = ((16384, 4096), (16384, 5632), (16384, 2048))
CASES = ("row e4m3", "col e4m3, T", "col e5m2 prescale rows, T (wgrad fold)", "1x128 e4m3",
         "128x1 e4m3, T")  # fmt: skip


def probe() -> list[dict]:
    bw = copy_bandwidth()
    records = []
    for m, k in SHAPES:
        x, cases = kernels.shape_cases(m, k)
        for name in CASES:
            fn = functools.partial(operand.quantize_operand, **cases[name][0])
            for nd in (False, True):
                with torch._inductor.config.patch({"triton.prefer_nd_tiling": nd}):
                    passes = kernels.inductor_passes(fn, x)
                for kernel, ms, gb in passes:
                    records.append(dict(shape=f"{m}x{k}", case=name, nd=nd, kernel=kernel[:70],
                                        us=round(ms * 1e3, 1), mb=round(gb * 1e3, 1),
                                        frac=round(gb / ms * 1e3 / bw, 3)))  # fmt: skip
                    print(records[-1], flush=True)
    return records


def markdown(records: list[dict], command: str) -> str:
    """The passes that move at least 10 MB (the rest are scale arithmetic), 1-D against N-D."""
    big = [r for r in records if r["mb"] >= 10]
    by_key = {(r["shape"], r["case"], r["kernel"], r["nd"]): r for r in big}
    lines = [f"`{command}`", "",
             "Each memory pass of a compiled `quantize_operand` (bytes as inductor counts them, "
             "timed alone by its bandwidth profiler, L2 flushed), inductor's default tiling "
             "against `triton.prefer_nd_tiling`; % of a device-to-device copy's bandwidth.", "",
             "| shape | case | pass | 1-D us | 1-D % | N-D us | N-D % |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (shape, case, kernel, nd), r in by_key.items():
        other = by_key.get((shape, case, kernel, True))
        if nd or other is None:
            continue
        kind = "cast"
        if kernel.startswith(("triton_red", "triton_per")):  # reductions: the maxima pass
            kind = "maxima + scales" if "clamp" in kernel else "maxima"
        lines.append(f"| {shape} | {case} | {kind} | {r['us']} | {r['frac']:.0%} | "
                     f"{other['us']} | {other['frac']:.0%} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--date", default=None)
    ap.add_argument("--render", default=None, help="re-render the table of a results JSON")
    args = ap.parse_args()
    command = "benchmarks/nd_tiling_probe.py"
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text()), command))
        return
    records = probe()
    kw = {"day": args.date} | ({"out_dir": Path(args.out_dir)} if args.out_dir else {})
    md, _ = write_results("nd_tiling_probe", records, markdown(records, command), **kw)
    print(md.read_text())


if __name__ == "__main__":
    main()
