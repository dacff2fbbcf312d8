"""Compile one LLaMA block per recipe with fullgraph=True under bf16 autocast and run fwd+bwd:
any graph break inside the quantized layers fails loudly here (a diagnostic for GPU runs).

    PYTHONPATH=src python benchmarks/compile_check.py [--recipes fp8-tensorwise,fp4-dge] \
        [--device cuda]
"""

from __future__ import annotations

import argparse
import traceback

import torch

from minifloat.convert import convert
from minifloat.models.llama import Llama, get_config


def check(recipe: str, device: str) -> bool:
    torch._dynamo.reset()
    cfg = get_config("tiny", dim=256, n_layers=1, n_heads=4, ffn_dim=512, vocab_size=256)
    net = Llama(cfg)
    net.init_weights(0)
    net = net.to(device)
    if recipe != "bf16":
        convert(net, recipe)
    block = torch.compile(net.layers[0], fullgraph=True)
    x = torch.randn(2, 64, 256, device=device, requires_grad=True)
    cos, sin = net._rope_tables(64, torch.device(device))
    try:
        with torch.autocast(device, dtype=torch.bfloat16):
            y = block(x, cos, sin)
        y.float().sum().backward()
        print(f"{recipe}: ok", flush=True)
        return True
    except Exception:
        print(f"{recipe}: FAILED", flush=True)
        traceback.print_exc()
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="fp8-tensorwise,fp8-rowwise,fp4-dge")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    results = [check(r, args.device) for r in args.recipes.split(",")]
    raise SystemExit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
