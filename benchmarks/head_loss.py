"""The output head with its cross entropy, forward and backward: unchunked (the head's bf16 GEMM,
then `loss.TrainingObjective` eager or compiled) against `head_loss.ChunkedHeadObjective` at
several chunk sizes; GPU time and the peak memory above the inputs.

    PYTHONPATH=src python benchmarks/head_loss.py [--tokens 16384] [--dim 2048] [--vocab 32000] \
        [--chunks 1024,2048,4096,8192] [--out-dir DIR] [--tag NAME]

The defaults are a 1.3B step's head (8 x 2048 tokens, d 2048, vocab 32000). Under bf16 autocast,
hidden states fp32 and the head's weight fp32 (as the trainer's master weights); each variant's
time is `common.time_ms` of forward + backward (L2 flushed, median of 20) and its peak the most
allocated above what was allocated before it, gradients included. Results:
`head_loss[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import probe_parser, require_cuda, time_ms, write_probe  # noqa: E402
from minifloat.train.head_loss import ChunkedHeadObjective, DeferredHead  # noqa: E402
from minifloat.train.loss import TrainingObjective  # noqa: E402


def variants(head: DeferredHead, chunks: list[int]) -> dict:
    """name -> objective(hidden, targets) -> (loss, total)."""
    out = {}
    for mode in ("eager", "compiled"):
        loss = TrainingObjective(mode=mode)
        out[f"unchunked, {mode} loss"] = lambda h, t, loss=loss: loss(head.logits(h), t)
    for chunk in chunks:
        out[f"chunked {chunk}"] = ChunkedHeadObjective(head, chunk_tokens=chunk)
    return out


def step(fn, hidden: torch.Tensor, head: DeferredHead, targets: torch.Tensor) -> None:
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        total = fn(hidden, targets)[1]
    total.backward()
    hidden.grad, head.weight.grad = None, None


def peak_gib(fn, hidden, head, targets) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(fn, hidden, head, targets)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    args = ap.parse_args(argv)
    require_cuda("head_loss.py")
    chunks = [int(c) for c in args.chunks.split(",")]
    torch.manual_seed(0)
    head = DeferredHead(nn.Linear(args.dim, args.vocab, bias=False)).cuda()
    hidden = torch.randn(args.tokens, args.dim, device="cuda", requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    records = []
    for name, fn in variants(head, chunks).items():
        run = lambda fn=fn: step(fn, hidden, head, targets)  # noqa: E731
        ms = time_ms(run)  # its warm-up compiles
        rec = {"variant": name, "ms": ms, "peak_gib": peak_gib(fn, hidden, head, targets),
               "tokens": args.tokens, "dim": args.dim, "vocab": args.vocab}  # fmt: skip
        print(f"{name}: {ms:.2f} ms, {rec['peak_gib']:.2f} GiB", flush=True)
        records.append(rec)
    rows = "\n".join(f"| {r['variant']} | {r['ms']:.2f} | {r['peak_gib']:.2f} |" for r in records)
    body = (
        f"Head {args.dim} -> {args.vocab} on {args.tokens} tokens, bf16 autocast, forward + "
        "backward of head and cross entropy; peak above the inputs, gradients included.\n\n"
        f"| variant | ms | peak GiB |\n|---|---|---|\n{rows}"
    )
    write_probe("head_loss", args, records, body)


if __name__ == "__main__":
    main()
