"""Does FSDP2's quantized weight all-gather give the gradients of the plain all-gather, on this
device, under torch.compile? (Issue 17; the CPU test is tests/test_fsdp_quantized.py.)

    python benchmarks/qag_equality.py --model 1.3B --layers 2 --recipes fp8-tensorwise --steps 3
    torchrun --nproc-per-node 2 benchmarks/qag_equality.py ...     # every rank checks its own

The same model (train_e2e.build_model: fixed seed, fp32 weights), each block compiled in place,
sharded by `apply_fsdp` with and without `quantized_all_gather`, trains `--steps` steps on the
same batches (bf16 autocast, SGD-like update p -= lr * grad so that both runs move alike); at
every step every parameter's full gradient is compared bit for bit. DGE recipes' weight
gradients differ by fp32 rounding (the factor is applied after the reduce-scatter), so they are
compared by max relative error, and only at the first step. Writes `--out`/qag_equality.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_e2e  # noqa: E402
from minifloat import recipes  # noqa: E402
from minifloat.fsdp_quantized import precompute_weight_scales  # noqa: E402


def run(args: argparse.Namespace, recipe: str, quantized: bool) -> list[tuple[float, dict]]:
    """(loss, full gradients) of each step of one run."""
    torch._dynamo.reset()
    batch, seq, vocab = train_e2e.PRESETS[args.model]
    net = train_e2e.build_model(args.model, "ours", vocab, seq, args.device, args.layers)
    net = train_e2e.prepare(net, recipe)
    opts = argparse.Namespace(compile_scope="block", compile_mode=None)
    model = train_e2e.shard_model(net, opts, "qag" if quantized else "fsdp", torchao=False)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, seq + 1), generator=gen).to(args.device)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        out.append(
            (loss.item(), {n: p.grad.full_tensor().cpu() for n, p in net.named_parameters()})
        )
        with torch.no_grad():
            for p in net.parameters():
                p -= args.lr * p.grad
        if quantized:
            precompute_weight_scales(net)
        net.zero_grad(set_to_none=True)
    return out


def compare(recipe: str, plain: list, gathered: list) -> dict:
    dge = recipes.get(recipe).dge is not None
    steps = []
    for i, ((loss_a, ga), (loss_b, gb)) in enumerate(zip(plain, gathered, strict=True)):
        if dge and i > 0:
            break
        differ = [n for n in ga if not torch.equal(ga[n], gb[n])]
        worst = max(((gb[n] - ga[n]).abs().max() / ga[n].abs().max()).item() for n in ga)
        steps.append({"step": i, "loss_plain": loss_a, "loss_quantized": loss_b,
                      "params_differing": len(differ), "of": len(ga), "max_rel_err": worst,
                      "first_differing": differ[:3]})  # fmt: skip
    exact = all(s["params_differing"] == 0 for s in steps)
    return {"recipe": recipe, "bit_exact": exact, "steps": steps,
            "within_dge_tol": dge and all(s["max_rel_err"] <= 1e-5 for s in steps)}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.3B", choices=sorted(train_e2e.PRESETS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--recipes", default="fp8-tensorwise")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    rank, world = train_e2e.init_process_group(args.device)
    results = []
    for recipe in args.recipes.split(","):
        res = compare(recipe, run(args, recipe, False), run(args, recipe, True))
        results.append(res | {"model": args.model, "layers": args.layers, "world_size": world,
                              "device": args.device})  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "qag_equality.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
