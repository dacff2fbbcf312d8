"""What a compiled LLaMA block saves for backward, and where AOTAutograd's partitioner banned a
recomputation for a long fusible chain, on the CPU with the Hopper GEMM path forced.

The partitioner decides on the graph, not on the device: `torch._scaled_mm` runs tensor- and
row-scaled FP8 on the CPU too, so forcing minifloat's GPU code path there (as
tests/test_transpose.py's `force_hopper_path` does) gives the graph the H200 compiles, in
minutes and without a GPU. Block-scaled GEMMs (fp8-blockwise) do not run on the CPU.

    PYTHONPATH=src python benchmarks/partition_probe.py --recipes fp8-rowwise,fp4-dge \
        [--width 1.3B|small] [--tokens 2048] [--tag s23]

Per recipe: the bytes saved for backward (parameters left out, each storage once), by dtype,
the quantized tensors among them, and each "too long" ban the partitioner logged (chain start
-> banned node, with their forward positions; a ban on a view changes nothing). Session 23 used
it to find why computing the scales' reciprocals in the graph saved the SwiGLU's E2M1 output at
1.3B (docs/hopper_sessions.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from minifloat.convert import convert
from minifloat.kernels import scaled_mm as smm
from minifloat.kernels import select
from minifloat.models.llama import Llama, get_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

_QUANTIZED = ("float8", "uint8")
_VOCAB = 1000


def scaled_mm_runs_on_cpu(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`scaled_mm.supported` on the CPU: FP8 operands `torch._scaled_mm` takes there."""
    return a.dtype in smm.FP8_DTYPES and b.dtype in smm.FP8_DTYPES and b.shape[0] % 16 == 0


@contextlib.contextmanager
def hopper_path_on_cpu():
    """minifloat's GPU code path on the CPU (FP8 `torch._scaled_mm` where it runs there)."""
    saved = select._fp8_gemm_available, smm.supported
    select._fp8_gemm_available = lambda *args: True
    smm.supported = scaled_mm_runs_on_cpu
    try:
        yield
    finally:
        select._fp8_gemm_available, smm.supported = saved


def one_block_llama(
    recipe: str,
    width: str = "small",
    max_seq_len: int = 128,
    *,
    preset: str = "1.3B",
    device: str = "cpu",
    compile_block: bool = True,
) -> Llama:
    """A one-block LLaMA of `preset`'s config, vocab 1000, on `device`, converted to `recipe`
    (unless bf16), its block compiled (unless `compile_block` is False); `width` "small": dim
    256, FFN 704, 4 heads, any other value: the preset's own widths."""
    cfg = dataclasses.replace(
        get_config(preset, vocab_size=_VOCAB, max_seq_len=max_seq_len), n_layers=1
    )
    if width == "small":
        cfg = dataclasses.replace(cfg, dim=256, ffn_dim=704, n_heads=4, n_kv_heads=4)
    torch.manual_seed(0)
    net = Llama(cfg)
    net.init_weights(0)
    net = net.to(device)
    if recipe != "bf16":
        convert(net, recipe)
    for block in net.layers if compile_block else ():
        block.compile()
    return net


def saved_for_backward(
    net: Llama, tokens: torch.Tensor
) -> dict[int, tuple[int, torch.dtype, tuple[int, ...]]]:
    """Storage -> (bytes, dtype, shape) of what one bf16-autocast step of `net` on `tokens`
    saves for backward, parameters left out, each storage once. `net` returns logits, or an
    output with `.logits` (a `transformers` model)."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, tuple[int, torch.dtype, tuple[int, ...]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(tokens)
        loss = getattr(out, "logits", out).float().square().mean()
    loss.backward()
    return seen


class _Partitioned(Exception):
    """Raised by `forward_saves`' recorder once the partitioned forward graph is recorded."""


def forward_saves(
    net: torch.nn.Module, tokens: torch.Tensor, blocks: Iterable[torch.nn.Module] | None = None
) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of every tensor the partitioned forward graph of `net`'s compiled
    blocks (`blocks`, by default `net.layers`) hands to backward, without running the graph:
    inductor's own partition, then the forward's code generation replaced by a recorder that
    stops the step. So it also covers graphs that cannot run on the CPU (fp8-blockwise's
    block-scaled `torch._scaled_mm`), and it skips what costs most on the CPU: inductor's code
    generation and C++ compilation of both graphs (tests/test_transpose.py's one-block fp4
    LLaMA at 1.3B width: 42 s against 114 s compiled and run, cold caches, 2-core CPU).
    Parameters and inputs passed through are included (names `primals_*`). The blocks stay
    compiled with the recorder: build a fresh model to train."""
    from torch._inductor.compile_fx import compile_fx

    found: list[tuple[str, torch.dtype, tuple]] = []

    def record(gm: torch.fx.GraphModule, example_inputs, **kwargs):  # noqa: ANN001
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in out[1:]:  # out[0]: the block's output
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(val, torch.Tensor):
                found.append((node.name, val.dtype, tuple(val.shape)))
        raise _Partitioned

    def backend(gm: torch.fx.GraphModule, example_inputs):  # noqa: ANN001
        return compile_fx(gm, example_inputs, inner_compile=record)

    for block in net.layers if blocks is None else blocks:
        block.compile(backend=backend)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(tokens)
    except Exception as exc:  # dynamo wraps the backend's exception (BackendCompilerFailed)
        if not isinstance(getattr(exc, "inner_exception", exc), _Partitioned):
            raise
    finally:
        torch._dynamo.reset()
    return found


class _Bans(logging.Handler):
    """Collects the partitioner's "too long" log records (its long-fusible-chain rule)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.bans: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("too long"):
            cur, start, cur_pos, start_pos = record.args
            self.bans.append(f"{start}@{start_pos} -> {cur}@{cur_pos}")


def probe(recipe: str, width: str, tokens: int) -> dict:
    """One compiled block under `recipe`: saved bytes by dtype, quantized tensors, bans."""
    torch._dynamo.reset()
    net = one_block_llama(recipe, width, tokens)
    handler = _Bans()
    log = logging.getLogger("torch._functorch.partitioners")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        seen = saved_for_backward(net, torch.randint(0, _VOCAB, (1, tokens)))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    by_dtype = collections.Counter()
    for nbytes, dtype, _ in seen.values():
        by_dtype[str(dtype).removeprefix("torch.")] += nbytes
    quantized = sorted(
        (shape, name)
        for _, dtype, shape in seen.values()
        if (name := str(dtype).removeprefix("torch.")).startswith(_QUANTIZED)
    )
    return {
        "recipe": recipe, "width": width, "tokens": tokens,
        "saved_bytes": sum(by_dtype.values()), "saved_by_dtype": dict(by_dtype),
        "quantized_saved": [f"{d} {list(s)}" for s, d in quantized], "bans": handler.bans,
    }  # fmt: skip


def markdown(records: list[dict], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "One LLaMA block (1.3B config, one layer; `width` small = dim 256, FFN 704), compiled,"
        " bf16 autocast, 1 x `tokens` tokens, Hopper GEMM path forced on the CPU. Bytes saved"
        " for backward without parameters; bans: the partitioner's long-fusible-chain rule,"
        " chain start -> banned node with their forward positions.",
        "",
        "| recipe | width | tokens | saved bytes | quantized tensors saved | bans |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        quantized = ", ".join(r["quantized_saved"]) or "none"
        bans = "; ".join(r["bans"]) or "none"
        lines.append(f"| {r['recipe']} | {r['width']} | {r['tokens']} | {r['saved_bytes']:,} |"
                     f" {quantized} | {bans} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="fp8-tensorwise,fp8-rowwise,fp4-direct,fp4-dge,fp4")
    ap.add_argument("--width", default="1.3B", choices=("1.3B", "small"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--date", default=None)
    args = ap.parse_args()
    records = []
    with hopper_path_on_cpu():
        for recipe in args.recipes.split(","):
            rec = probe(recipe, args.width, args.tokens)
            quantized = rec["quantized_saved"] or "none"
            print(f"{recipe}: {rec['saved_bytes']:,} bytes saved, quantized: {quantized},"
                  f" bans: {rec['bans']}", flush=True)  # fmt: skip
            records.append(rec)
    command = "benchmarks/partition_probe.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, "")
    )
    name = "partition_probe" + (f"_{args.tag}" if args.tag else "")
    kwargs = {"out_dir": args.out_dir} if args.out_dir else {}
    md, _ = write_results(name, records, markdown(records, command), day=args.date, **kwargs)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
