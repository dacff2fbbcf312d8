"""torch.compile graph breaks of one QuantLinear step (forward + backward) per recipe.

Counted with `torch._dynamo.explain` on the emulated backend, so it runs on a CPU; the Hopper
backend shares linear.py, the OCC thresholds and DGE's grid, and adds custom ops that trace
without breaks. Writes benchmarks/results/compile_breaks_cpu_<date>.md.

    python benchmarks/compile_breaks.py
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from minifloat import recipes
from minifloat.linear import QuantLinear

VARIANTS = ["fp4:occ.compensate=off", "fp4:occ.compensation_format=e4m3"]


def count(name: str) -> tuple[int, list[str]]:
    """(graph breaks, distinct 'reason @ file:line') of one forward + backward."""
    layer = QuantLinear(64, 32, bias=False, recipe=name, backend="emulated")
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    torch._dynamo.reset()
    # .backward() inside the traced function is itself one break; it is not the layer's.
    explained = torch._dynamo.explain(lambda t: layer(t).sum().backward())(x)
    reasons = set()
    for b in explained.break_reasons:
        frame = b.user_stack[-1] if b.user_stack else None
        where = f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"
        reasons.add(f"{str(b.reason).splitlines()[0][:60]} @ {where}")
    own = [r for r in sorted(reasons) if "Tensor.backward" not in r]
    return explained.graph_break_count, own


def main() -> None:
    names = [n for n in recipes.names() if recipes.get(n).quantized] + VARIANTS
    day = datetime.date.today().isoformat()
    lines = [
        f"# torch.compile graph breaks per QuantLinear step, {day}",
        "",
        f"CPU, torch {torch.__version__}, emulated backend, x [48, 64], w [32, 64]; "
        "`torch._dynamo.explain` of forward + backward (`python benchmarks/compile_breaks.py`).",
        "",
        "| recipe | graph breaks | where (besides the traced .backward() call) |",
        "|---|---|---|",
    ]
    for name in names:
        breaks, reasons = count(name)
        lines.append(f"| {name} | {breaks} | {'; '.join(reasons) or '—'} |")
        print(lines[-1], flush=True)
    out = Path(__file__).parent / "results" / f"compile_breaks_cpu_{day}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
