"""torch.compile graph breaks of one training step (forward + backward) per recipe.

Two levels, counted with `torch._dynamo.explain`:
- layer: one QuantLinear, x [48, 64] (on CPU the emulated backend; on CUDA the backend the
  trainer picks, i.e. Hopper on sm_89+), under the recipe's autocast as in training;
- model: the `tiny` LLaMA preset converted to the recipe, tokens [2, 64] → mean logit.

    python benchmarks/compile_breaks.py                 # CPU → compile_breaks_cpu_<date>.md
    python benchmarks/compile_breaks.py --device cuda   # → compile_breaks_<gpu>_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gpu_tag  # noqa: E402
from minifloat import convert, recipes  # noqa: E402
from minifloat.amp import autocast_context  # noqa: E402
from minifloat.linear import QuantLinear  # noqa: E402
from minifloat.models.llama import Llama, get_config  # noqa: E402

VARIANTS = ["fp4:occ.compensate=off", "fp4:occ.compensation_format=fp32"]


def _explain(fn, *args) -> tuple[int, list[str]]:
    """(graph breaks, distinct 'reason @ file:line') of `fn(*args)`, which calls .backward()."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    reasons = set()
    for b in explained.break_reasons:
        frame = b.user_stack[-1] if b.user_stack else None
        where = f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"
        reasons.add(f"{str(b.reason).splitlines()[0][:60]} @ {where}")
    # .backward() inside the traced function is itself one break; it is not the recipe's.
    own = [r for r in sorted(reasons) if "Tensor.backward" not in r]
    return explained.graph_break_count, own


def count_layer(name: str, device: str) -> tuple[int, list[str]]:
    backend = "emulated" if device == "cpu" else "auto"
    layer = QuantLinear(64, 32, bias=False, recipe=name, backend=backend, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(48, 64, generator=gen, device=device, requires_grad=True)

    def step(t):
        with autocast_context(recipes.get(name), device):
            y = layer(t)
        y.float().sum().backward()

    return _explain(step, x)


def count_model(name: str, device: str) -> tuple[int, list[str]]:
    model = Llama(get_config("tiny", vocab_size=256)).to(device)
    model.init_weights(0)
    recipe = recipes.get(name)
    convert(model, recipe)
    tokens = torch.randint(0, 256, (2, 64), device=device)

    def step(t):
        with autocast_context(recipe, device):
            logits = model(t)
        logits.float().mean().backward()

    return _explain(step, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    names = [n for n in recipes.names() if recipes.get(n).quantized] + VARIANTS
    day = datetime.date.today().isoformat()
    where = "CPU, emulated backend" if args.device == "cpu" else f"{gpu_tag()}, auto backend"
    lines = [
        f"# torch.compile graph breaks per training step, {day}",
        "",
        f"{where}, torch {torch.__version__}; `torch._dynamo.explain` of forward + backward "
        f"(`python benchmarks/compile_breaks.py --device {args.device}`). Layer: one QuantLinear, "
        "x [48, 64]; model: the `tiny` preset, tokens [2, 64].",
        "",
        "| recipe | layer breaks | model breaks | where (besides the traced .backward() call) |",
        "|---|---|---|---|",
    ]
    for name in names:
        layer_breaks, layer_reasons = count_layer(name, args.device)
        model_breaks, model_reasons = count_model(name, args.device)
        reasons = sorted(set(layer_reasons) | set(model_reasons))
        lines.append(f"| {name} | {layer_breaks} | {model_breaks} | {'; '.join(reasons) or '—'} |")
        print(lines[-1], flush=True)
    tag = "cpu" if args.device == "cpu" else gpu_tag()
    out = Path(__file__).parent / "results" / f"compile_breaks_{tag}_{day}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
