"""Does FSDP2's quantized weight all-gather give the gradients of the plain all-gather, on this
device, under torch.compile? (Issue 17; the CPU test is tests/test_fsdp_quantized.py.)

    python benchmarks/qag_equality.py --model 1.3B --layers 2 --recipes fp8-tensorwise --steps 3
    torchrun --nproc-per-node 2 benchmarks/qag_equality.py ...     # every rank checks its own

The same model (train_e2e.build_model: fixed seed, fp32 weights), each block compiled in place
(`--no-compile`: eager), sharded by `apply_fsdp` with and without `quantized_all_gather`, trains
`--steps` steps on the same batches (bf16 autocast, SGD-like update p -= lr * grad so that both
runs move alike); at every step every parameter's full gradient is compared bit for bit. DGE
recipes' weight gradients differ by fp32 rounding (the factor is applied after the
reduce-scatter), so they are compared by max relative error, and only at the first step.

On the GPU the compiled model's gradients are not reproducible from one run to the next
unless `torch.use_deterministic_algorithms(True)` is set: the unsharded model against itself, in
one process, differed in 3 of 4 runs (15 of 21 gradients, up to 4.2 %; eagerly it never did;
inductor's `deterministic` option alone, or SDPA's math backend, did not make it reproducible;
`qag_equality_1.3B_2layers_s16_h200_2026-11-25.md`). So this script sets it (and cuBLAS's
workspace setting) by default; `--no-deterministic` shows the variation.

Diagnostics: `--modes` lists the runs, compared with the first (a mode may repeat): `none` (not
sharded, one rank only), `fsdp`, `qag`, and `qag-requantize` (the quantized all-gather quantizing
the shard at every all-gather, as before session 15, not once per step). With
`--check-payloads` every all-gather of the quantized runs records its bytes, and the report
says whether a shard's re-gather sent other bytes than its first all-gather of the same step.
Writes `--out`/qag_equality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_e2e  # noqa: E402
from minifloat import recipes  # noqa: E402
from minifloat.fsdp_quantized import precompute_quantized_weights  # noqa: E402
from minifloat.fsdp_weight import ShardedWeight  # noqa: E402


class _Payloads:
    """Records the bytes each quantized all-gather sends: per step, per shard, the calls."""

    def __init__(self) -> None:
        self.step = 0
        self.calls: dict[tuple[int, int], list[list[torch.Tensor]]] = {}

    def wrap(self, original, requantize: bool):  # noqa: ANN001, ANN202
        # FSDP2 checks the hook's signature: spelled out
        def pre_all_gather(shard, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001, ANN202
            if requantize:
                shard._quantized = None
            tensors, meta = original(shard, mesh, outer_size, outer_stride, module, mp_policy)
            key = (self.step, id(shard))
            self.calls.setdefault(key, []).append([t.detach().clone() for t in tensors])
            return tensors, meta

        return pre_all_gather

    def differing(self) -> list[dict]:
        """Shards whose later all-gathers in a step sent other bytes than the first."""
        out = []
        for (step, shard), calls in self.calls.items():
            for i, later in enumerate(calls[1:], 1):
                same = [torch.equal(a, b) for a, b in zip(calls[0], later, strict=True)]
                if not all(same):
                    out.append({"step": step, "shard": shard, "call": i, "tensors_equal": same})
        return out


def run(args: argparse.Namespace, recipe: str, mode: str) -> tuple[list, list]:
    """(loss, full gradients) of each step of one run, and the payload report."""
    torch._dynamo.reset()
    batch, seq, vocab = train_e2e.PRESETS[args.model]
    net = train_e2e.build_model(args.model, "ours", vocab, seq, args.device, args.layers)
    net = train_e2e.prepare(net, recipe)
    quantized = mode.startswith("qag")
    opts = argparse.Namespace(compile_scope="block" if args.compile else "none", compile_mode=None,
                              compile_options=None)  # fmt: skip
    if mode == "none":
        model = train_e2e.compile_model(net, "block", None) if args.compile else net
    else:
        model = train_e2e.shard_model(net, opts, "qag" if quantized else "fsdp", torchao=False)
    payloads = _Payloads()
    original = ShardedWeight.fsdp_pre_all_gather
    if quantized and (args.check_payloads or mode == "qag-requantize"):
        ShardedWeight.fsdp_pre_all_gather = payloads.wrap(original, mode == "qag-requantize")
    gen = torch.Generator().manual_seed(0)
    out = []
    try:
        for step in range(args.steps):
            payloads.step = step
            tokens = torch.randint(0, vocab, (args.batch, seq + 1), generator=gen).to(args.device)
            with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            full = {n: _full(p.grad).cpu() for n, p in net.named_parameters()}
            out.append((loss.item(), full))
            with torch.no_grad():
                for p in net.parameters():
                    p -= args.lr * p.grad
            if quantized:
                precompute_quantized_weights(net)
            net.zero_grad(set_to_none=True)
    finally:
        ShardedWeight.fsdp_pre_all_gather = original
    return out, payloads.differing()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(recipe: str, ref: list, other: list) -> dict:
    dge = recipes.get(recipe).dge is not None
    steps = []
    for i, ((loss_a, ga), (loss_b, gb)) in enumerate(zip(ref, other, strict=True)):
        if dge and i > 0:
            break
        differ = [n for n in ga if not torch.equal(ga[n], gb[n])]
        worst = max(((gb[n] - ga[n]).abs().max() / ga[n].abs().max()).item() for n in ga)
        steps.append({"step": i, "loss_ref": loss_a, "loss": loss_b,
                      "params_differing": len(differ), "of": len(ga), "max_rel_err": worst,
                      "differing": differ})  # fmt: skip
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
    ap.add_argument("--modes", default="fsdp,qag", help="runs, each compared with the first")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--check-payloads", action="store_true")
    ap.add_argument(
        "--emulate-precision-casts", action="store_true",
        help="inductor rounds fused bf16 intermediates as eager does (a whole-model drift test)",
    )  # fmt: skip
    ap.add_argument(
        "--deterministic", action=argparse.BooleanOptionalAction, default=True,
        help="torch.use_deterministic_algorithms (default; see the module docstring)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    # this process only: diagnostics, not the library's state
    if args.emulate_precision_casts:
        torch._inductor.config.emulate_precision_casts = True
    if args.deterministic:
        # cuBLAS reads this when it creates its handle, i.e. before the first GEMM
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    rank, world = train_e2e.init_process_group(args.device)
    modes = args.modes.split(",")
    if "none" in modes and world > 1:
        raise SystemExit("mode none (unsharded) needs one rank")
    results = []
    for recipe in args.recipes.split(","):
        ref, _ = run(args, recipe, modes[0])
        for mode in modes[1:]:  # a mode may repeat: `none,none` tests the comparison itself
            grads, payloads = run(args, recipe, mode)
            res = compare(recipe, ref, grads)
            res |= {"mode": mode, "reference": modes[0], "compiled": args.compile,
                    "regathers_differing": payloads, "model": args.model, "layers": args.layers,
                    "world_size": world, "device": args.device,
                    "deterministic": args.deterministic,
                    "emulate_precision_casts": args.emulate_precision_casts}  # fmt: skip
            results.append(res)
            print(json.dumps(res), flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "qag_equality.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
