"""SASS instruction counts of one inductor-generated Triton kernel, compiled here for sm_90.

Many of the fast path's fused quantization kernels are bound by their instructions, not their
bytes (docs/hopper.md, "Closing the gaps, sessions 58-66"): the instructions an element are
what a change to them must cut. This compiles one kernel from an inductor code dump
(`profile_trees.sh` brings those back, `code/<TREE>/*.py`) with Triton's own ptxas and
disassembles it with its nvdisasm: no GPU needed, so a change can be sized before device time
is spent on it. Variants are textual edits of the kernel's source (what inductor would emit for
a changed expression, written by hand):

    python benchmarks/sass_count.py CODE.py KERNEL --blocks XBLOCK=1024 --warps 4 \\
        --variant 'no round trip:tmp56 = tmp55 * tmp30=>tmp56 = tmp53 * tmp30'

KERNEL: the kernel's name, or a unique part of it. --blocks: its tile constexprs (XBLOCK,
YBLOCK, R0_BLOCK, as inductor's launch picked them; the counts a thread change with them, the
counts an element much less). Writes `sass_count[_<tag>]_<gpu>_<date>.{md,json}` (<gpu> "cpu"
on a machine without one): per variant the instructions a thread (the listing's NOP padding
and closing self-branch left out) and, for pointwise kernels, an element, and the opcode
counts. The pointer and size arguments take the divisibility hints recorded in the dump
(`triton_meta`'s configs). Needs Triton (a CUDA build of torch carries it; on a CPU machine
`pip install triton` into a folder on PYTHONPATH).

An estimate, not a timing: an instruction-bound kernel's time follows its instructions only
roughly (session 77: the SwiGLU forward that writes the down projection's joint operand, 407
SASS instructions for 8 elements a thread, ran at ~81 % of the issue rate that count allows).
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import probe_parser, write_probe  # noqa: E402

_KERNEL = r"(\w+) = async_compile\.triton\('\w+', '''(.*?)''', device_str"
_SASS_LINE = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
_TILES = ("XBLOCK", "YBLOCK", "ZBLOCK")


def kernel_source(code: str, kernel: str) -> tuple[str, str]:
    """(name, source) of the kernel in an inductor code dump named `kernel`, else of the one
    whose name contains it."""
    kernels = re.findall(_KERNEL, code, re.S)
    found = [(n, s) for n, s in kernels if n == kernel] or [
        (n, s) for n, s in kernels if kernel in n
    ]
    if len(found) != 1:
        names = ", ".join(n for n, _ in found[:5]) or "none"
        raise SystemExit(f"{len(found)} kernels match {kernel!r} (want one): {names}")
    return found[0]


def parse_variant(text: str) -> tuple[str, list[tuple[str, str]]]:
    """'NAME:OLD=>NEW;OLD2=>NEW2' -> (NAME, [(OLD, NEW), (OLD2, NEW2)])."""
    name, sep, edits = text.partition(":")
    pairs = [e.split("=>", 1) for e in edits.split(";") if e]
    if not sep or not name or not pairs or any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--variant takes 'NAME:OLD=>NEW[;OLD=>NEW...]', got {text!r}")
    return name, [(old, new) for old, new in pairs]


def edited(source: str, edits: list[tuple[str, str]]) -> str:
    """`source` with each OLD replaced by NEW; each OLD must occur exactly once."""
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"{old!r} occurs {source.count(old)} times in the kernel (want 1)")
        source = source.replace(old, new)
    return source


def compile_sass(name: str, source: str, blocks: dict[str, int], warps: int, arch: int) -> str:
    """The kernel's SASS for sm_`arch`: its inductor decorator dropped, its arguments with the
    divisibility hints the dump records (`triton_meta`'s configs: those of inductor's launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta = re.search(r"'signature': (\{.*?\})", source, re.S)
    hints = re.search(r"'configs': \[(\{.*?\})\]", source, re.S)
    source, n = re.subn(
        r"@triton_heuristics\.\w+\(.*?\n\)\n@triton\.jit", "@triton.jit", source, flags=re.S
    )
    if meta is None or n != 1:
        raise SystemExit("no inductor decorator with a signature before the kernel (not a dump?)")
    signature = ast.literal_eval(meta.group(1))
    source = source.replace("triton_helpers.set_driver_to_gpu()", "")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("sass_count_kernel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        missing = [k for k, v in signature.items() if v == "constexpr" and k not in blocks]
        if missing:
            raise SystemExit(f"--blocks needs {', '.join(missing)}")
        constexprs = {k: blocks[k] for k, v in signature.items() if v == "constexpr"}
        attrs = ast.literal_eval(hints.group(1)) if hints else {}
        src = ASTSource(
            getattr(module, name), signature=signature, constexprs=constexprs, attrs=attrs
        )
        compiled = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
        )
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
        if not nvdisasm.is_file():
            raise SystemExit(f"no nvdisasm in this Triton ({nvdisasm})")
        run = subprocess.run(
            [os.fspath(nvdisasm), "-c", os.fspath(cubin)], capture_output=True, text=True
        )
    if run.returncode:
        raise SystemExit(f"nvdisasm failed: {' '.join(run.stderr.split())}")
    return run.stdout


def opcode_counts(sass: str) -> collections.Counter:
    """Instructions by opcode (modifiers dropped: FSETP.GT.AND -> FSETP), without the listing's
    NOP padding and the self-branch after the last EXIT (neither runs)."""
    ops = [m.group(1) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    end = len(ops) - ops[::-1].index("EXIT") if "EXIT" in ops else len(ops)
    return collections.Counter(op for op in ops[:end] if op != "NOP")


def parse_blocks(text: str) -> dict[str, int]:
    """'XBLOCK=1024,R0_BLOCK=64' -> {'XBLOCK': 1024, 'R0_BLOCK': 64}."""
    try:
        return {k: int(v) for k, v in (b.split("=") for b in text.split(",") if b)}
    except ValueError:
        raise SystemExit(f"--blocks takes KEY=INT[,KEY=INT...], got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("code", help="an inductor code dump (.py)")
    ap.add_argument("kernel", help="the kernel's name, or a unique part of it")
    ap.add_argument("--blocks", default="XBLOCK=1024", help="tile constexprs, KEY=VALUE[,...]")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--variant", action="append", default=[], help="NAME:OLD=>NEW[;OLD=>NEW]")
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("sass_count.py needs Triton (pip install triton; no GPU needed)") from None
    blocks = parse_blocks(args.blocks)
    name, source = kernel_source(Path(args.code).read_text(), args.kernel)
    # a pointwise kernel's elements a thread; a reduction's depend on its loop (not counted)
    reduction = any(k.startswith("R") for k in blocks)
    tiles = math.prod(v for k, v in blocks.items() if k in _TILES)
    per_thread = None if reduction else tiles / (32 * args.warps)
    records, lines = [], []
    for label, edits in [("as dumped", [])] + [parse_variant(v) for v in args.variant]:
        counts = opcode_counts(
            compile_sass(name, edited(source, edits), blocks, args.warps, args.arch)
        )
        total = sum(counts.values())
        records.append({"kernel": name, "variant": label, "edits": edits, "blocks": blocks,
                        "warps": args.warps, "arch": args.arch, "sass_per_thread": total,
                        "elements_per_thread": per_thread, "opcodes": dict(counts)})  # fmt: skip
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(12))
        each = "n/a" if per_thread is None else f"{total / per_thread:.1f}"
        lines.append(f"| {label} | {total} | {each} | {top} |")
        print(lines[-1], flush=True)
    body = (
        f"`{name}` for sm_{args.arch}, {args.warps} warps, {blocks}: "
        + ("a reduction" if per_thread is None else f"{per_thread:g} elements a thread")
        + ".\n\n"
        "| variant | SASS a thread | an element | top opcodes |\n|---|---|---|---|\n"
        + "\n".join(lines) + "\n"
    )  # fmt: skip
    write_probe("sass_count", args, records, body)


if __name__ == "__main__":
    sys.exit(main())
