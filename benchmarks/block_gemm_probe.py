"""Would a block-scaled GEMM of our own beat cuBLAS's for fp8-blockwise? Each GEMM shape of one
training block, cuBLAS's block-scaled kernel (`scaled_mm.scaled_mm_blocks`, what training runs
today) against a Triton kernel of this probe's own in each of its `--configs`.

    PYTHONPATH=src python benchmarks/block_gemm_probe.py [--model 1.3B] [--reps 30]
        [--configs 'promote,64,128,4,4;pair,64,128,4,4;ceiling,128,128,8,3']

Why (session 63): fp8-blockwise's GEMMs take 37.3 ms of a 6-layer 1.3B profile against
fp8-rowwise's 30.4; cuBLAS runs its fprop and dgrad (1x128 x 128x128) at ~930-1,170 TFLOPS and
its wgrad (1x128 x 1x128) at ~620-920 alone, where the row-scaled kernels reach ~1,250-1,450
(`gemm_orientation_1.3B_s63_block_*`). DeepSeek-V3's scheme, written plainly: each 128-wide step
of the contraction is one tensor-core product into a fresh float32 tile, multiplied by its two
scales and added to the running float32 sum (the "promotion", which also bounds the tensor
cores' reduced-precision accumulation to 128 products). Forms of the kernel:
- `promote`: one step a loop iteration, as above;
- `pair`: two steps an iteration, the second product issued before the first is scaled, so the
  tensor cores need not wait for the scaling (contractions of an even number of 128-steps);
- `ceiling`: the same loads and tensor-core products summed with no scaling at all: a wrong
  result, timed only, as the most any promotion could reach in this kernel.
A config is form,BLOCK_M,BLOCK_N,num_warps,num_stages.

Operands as the recipe lays them out (`RECIPES.md`, blockwise): fprop x[M,K]·w[N,K]ᵀ and dgrad
dy[M,N]·(wᵀ)[K,N]ᵀ with a 128x128-scaled rhs, wgrad (dyᵀ)[N,M]·(xᵀ)[K,M]ᵀ with both 1x128;
E4M3 values, scales in [0.5, 1.5). The forms of one shape are timed in alternation, each call
after an L2 flush (CUDA events; the median of `--reps`), so a change of clock between forms
lands on all of them. Each result but the ceiling's is checked against cuBLAS's (relative
Frobenius error below 1e-2, the bf16 output's rounding) before it is timed. Shapes that repeat
in a block (q, k, v, o) are timed once and counted for each linear in the block's sums.
Session 64 (`block_gemm_probe_1.3B_s64{,_forms}_*`): `promote` ran at 537-720 TFLOPS in its best
tile (64 x 128, 4 warps) against cuBLAS's 850-1,170 in the same call, 7.9 ms a block against
cuBLAS's 5.0; `pair` at 190-280 (three float32 tiles live at once; register spills are the
likely cause, not checked); `ceiling` at 930-1,230 in 128 x 256
tiles, so the loads and products are not what this kernel loses on, the scaling between the
products is (each product must be finished before it is scaled, where the ceiling chains them).
`--device cpu` runs the tiny preset's shapes once through Triton's interpreter
(TRITON_INTERPRET=1) against a float64 product (a smoke test). Writes
`block_gemm_probe_<model>[_<tag>]_<gpu>_<date>.{md,json}`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternating_ms, probe_parser, write_probe  # noqa: E402
from gemm_orientation import _block_operand  # noqa: E402
from step_gemms import linear_shapes  # noqa: E402
from train_e2e import PRESETS  # noqa: E402

# (a rows, b rows, contraction, rhs block, output dtype) of each GEMM of a linear [n, k], m tokens
GEMMS = {
    "fprop": lambda m, n, k: (m, n, k, (128, 128), torch.bfloat16),
    "dgrad": lambda m, n, k: (m, k, n, (128, 128), torch.bfloat16),
    "wgrad": lambda m, n, k: (n, k, m, (1, 128), torch.float32),
}


FORMS = {"promote": 0, "pair": 1, "ceiling": 2}
CONFIGS = ("promote,64,128,4,4;promote,128,64,4,4;pair,64,128,4,4;pair,128,128,8,3;"
           "ceiling,64,128,4,4;ceiling,128,128,8,3;ceiling,128,256,8,3")  # fmt: skip

try:  # CUDA machines have Triton; the CPU smoke run needs it too (its interpreter)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _scaled_product(x, y, sa_ptrs, sb_ptrs, kb, s_sa_k, s_sb_k):
        # one 128-step's tensor-core product times its two scales, float32
        s_a = tl.load(sa_ptrs + kb * s_sa_k)
        s_b = tl.load(sb_ptrs + kb * s_sb_k)
        return tl.dot(x, tl.trans(y)) * (s_a[:, None] * s_b[None, :])

    @triton.jit
    def _block_gemm_kernel(
        a, b, sa, sb, out, R, C, K, s_sa_r, s_sa_k, s_sb_c, s_sb_k,
        KB: tl.constexpr, B_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, FORM: tl.constexpr,
    ):  # fmt: skip
        BLOCK_K: tl.constexpr = 128
        pid = tl.program_id(0)
        num_m = tl.cdiv(R, BLOCK_M)
        num_n = tl.cdiv(C, BLOCK_N)
        # GROUP_M row tiles down one column of tiles before moving right, so that the b tiles
        # they share stay in L2 (Triton's matmul tutorial's ordering)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        group_rows = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_rows
        pid_n = (pid % width) // group_rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # rows past the edge read row 0 (in bounds) and are never stored: no row masks in loads
        rm_in = tl.where(rm < R, rm, 0)
        rn_in = tl.where(rn < C, rn, 0)
        a_ptrs = a + rm_in[:, None].to(tl.int64) * K + rk[None, :]
        b_ptrs = b + rn_in[:, None].to(tl.int64) * K + rk[None, :]
        sa_ptrs = sa + rm_in * s_sa_r
        sb_ptrs = sb + (rn_in // B_GROUP) * s_sb_c
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FORM == 1:  # pair (EVEN_K, KB even: the host checks)
            for kp in range(0, KB // 2):
                x0 = tl.load(a_ptrs)
                y0 = tl.load(b_ptrs)
                x1 = tl.load(a_ptrs + BLOCK_K)
                y1 = tl.load(b_ptrs + BLOCK_K)
                d0 = _scaled_product(x0, y0, sa_ptrs, sb_ptrs, 2 * kp, s_sa_k, s_sb_k)
                d1 = _scaled_product(x1, y1, sa_ptrs, sb_ptrs, 2 * kp + 1, s_sa_k, s_sb_k)
                acc += d0 + d1
                a_ptrs += 2 * BLOCK_K
                b_ptrs += 2 * BLOCK_K
        else:
            for kb in range(0, KB):
                if EVEN_K:
                    x = tl.load(a_ptrs)
                    y = tl.load(b_ptrs)
                else:  # a ragged last step reads zeros, which add nothing
                    k_in = rk[None, :] < K - kb * BLOCK_K
                    x = tl.load(a_ptrs, mask=k_in, other=0.0)
                    y = tl.load(b_ptrs, mask=k_in, other=0.0)
                if FORM == 2:  # ceiling: no scales
                    acc = tl.dot(x, tl.trans(y), acc)
                else:
                    acc += _scaled_product(x, y, sa_ptrs, sb_ptrs, kb, s_sa_k, s_sb_k)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        mask = (rm[:, None] < R) & (rn[None, :] < C)
        o_ptrs = out + rm[:, None].to(tl.int64) * C + rn[None, :]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=mask)


def block_gemm(a, a_scale, b, b_scale, b_block, *, out_dtype, config) -> torch.Tensor:
    """a @ bᵀ: a [R, K], b [C, K] row-major FP8; a_scale [R, ceil(K/128)] float32, b_scale
    [ceil(C/128), ceil(K/128)] for a (128, 128) rhs or [C, ceil(K/128)] for (1, 128);
    config (form, BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    form, block_m, block_n, warps, stages = config
    (r, k), c = a.shape, b.shape[0]
    kb = triton.cdiv(k, 128)
    if form == "pair" and (k % 128 or kb % 2):
        raise ValueError(f"the pair form takes an even number of whole 128-steps, not K = {k}")
    out = torch.empty((r, c), dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(r, block_m) * triton.cdiv(c, block_n),)
    _block_gemm_kernel[grid](
        a, b, a_scale, b_scale, out, r, c, k,
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        KB=kb, B_GROUP=b_block[0], BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8,
        EVEN_K=k % 128 == 0, FORM=FORMS[form], num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def parse_configs(text: str) -> list[tuple]:
    """'pair,64,128,4,4;...' -> [('pair', 64, 128, 4, 4), ...]."""
    out = []
    for item in text.split(";"):
        form, *nums = item.split(",")
        if form not in FORMS or len(nums) != 4:
            raise SystemExit(f"a config is form,BLOCK_M,BLOCK_N,warps,stages with form in "
                             f"{'/'.join(FORMS)}; got {item!r}")  # fmt: skip
        out.append((form, *(int(n) for n in nums)))
    return out


def operands(rows_a: int, rows_b: int, kc: int, b_block: tuple[int, int], device: str):
    """(a, a_scale, b, b_scale): E4M3 values and float32 scales in the recipe's layouts."""
    gen = torch.Generator(device=device).manual_seed(rows_a * 31 + rows_b * 7 + kc)
    a, sa = _block_operand(rows_a, kc, (1, 128), gen, device)
    b, sb = _block_operand(rows_b, kc, b_block, gen, device)
    return a, sa, b, sb


def reference(a, sa, b, sb, b_block) -> torch.Tensor:
    """a·bᵀ of the dequantized operands in float64."""
    ad = a.double() * sa.double().repeat_interleave(128, 1)[:, : a.shape[1]]
    sb_full = sb.double().repeat_interleave(128, 1)[:, : b.shape[1]]
    if b_block == (128, 128):
        sb_full = sb_full.repeat_interleave(128, 0)[: b.shape[0]]
    return ad @ (b.double() * sb_full).t()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def shapes(model: str, m: int) -> list[dict]:
    """The block's GEMMs as unique shapes, each with the linears that have it."""
    out: dict[tuple, dict] = {}
    for linear, n, k in linear_shapes(model):
        for gemm, dims in GEMMS.items():
            rows_a, rows_b, kc, b_block, dtype = dims(m, n, k)
            entry = out.setdefault(
                (gemm, rows_a, rows_b, kc),
                {"gemm": gemm, "shape": [rows_a, rows_b, kc], "b_block": b_block,
                 "dtype": dtype, "linears": []},
            )  # fmt: skip
            entry["linears"].append(linear)
    return list(out.values())


def measure(entry: dict, configs: list[tuple], device: str, reps: int) -> dict:
    """One shape: each config's error against cuBLAS (on the CPU: against float64) and, on
    CUDA, every form's median time."""
    from minifloat.kernels.scaled_mm import scaled_mm_blocks

    rows_a, rows_b, kc = entry["shape"]
    b_block, dtype = entry["b_block"], entry["dtype"]
    a, sa, b, sb = operands(rows_a, rows_b, kc, b_block, device)
    fns = {}
    if device == "cuda":
        fns["cublas"] = lambda: scaled_mm_blocks(a, sa, b, sb, b_block, out_dtype=dtype)
        want = fns["cublas"]()
    else:  # Triton's interpreter
        want = reference(a, sa, b, sb, b_block)
    errors = {}
    for cfg in configs:
        name = ",".join(map(str, cfg))

        def fn(cfg=cfg):
            return block_gemm(a, sa, b, sb, b_block, out_dtype=dtype, config=cfg)

        try:
            errors[name] = rel_err(fn(), want)
        except Exception as exc:  # a config Triton cannot build (shared memory): skipped
            print(f"{entry['gemm']} {entry['shape']} {name}: {type(exc).__name__}: {exc}"[:300])
            continue
        if errors[name] > 1e-2 and cfg[0] != "ceiling":
            raise SystemExit(
                f"{entry['gemm']} {entry['shape']} {name}: differs by {errors[name]:.2e}"
            )
        fns[name] = fn
    rec = {**entry, "dtype": str(dtype), "errors": errors}
    if device == "cuda":
        flop = 2.0 * rows_a * rows_b * kc
        rec["ms"] = alternating_ms(fns, reps=reps)
        rec["tflops"] = {k: flop / v / 1e9 for k, v in rec["ms"].items()}
        best = min(_scaled(rec["ms"]), key=rec["ms"].get)
        rec["best_triton"] = best
        print(f"{entry['gemm']} {entry['shape']}: cublas {rec['ms']['cublas']:.3f} ms, "
              f"{best} {rec['ms'][best]:.3f} ms", flush=True)  # fmt: skip
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--model", default="1.3B", choices=sorted(PRESETS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--configs", default=CONFIGS, help="';'-separated form,BLOCK_M,BLOCK_N,"
                    "warps,stages")  # fmt: skip
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    if triton is None:
        raise SystemExit("block_gemm_probe needs Triton (a CUDA build of torch, or its "
                         "interpreter: TRITON_INTERPRET=1)")  # fmt: skip
    configs = parse_configs(args.configs)
    cuda = args.device == "cuda"
    model = args.model if cuda else "tiny"
    # on the CPU 256 tokens: wgrad's contraction is two 128-steps, which the pair form takes
    m = PRESETS[args.model][0] * PRESETS[args.model][1] if cuda else 256
    records = [measure(e, configs, args.device, args.reps) for e in shapes(model, m)]
    if not cuda:
        print("cpu smoke run: every shape and config built, run once and checked")
        return
    write_probe(f"block_gemm_probe_{model}", args, records, _body(records, model, m))


def _scaled(ms: dict) -> list[str]:
    """The Triton forms that compute the product (all but cuBLAS and the ceiling)."""
    return [k for k in ms if k != "cublas" and not k.startswith("ceiling")]


def _body(records: list[dict], model: str, m: int) -> str:
    names = list(records[0]["ms"])
    lines = [f"One {model} block's fp8-blockwise GEMM shapes (M = {m} tokens) alone: ms (TFLOPS), "
             "median of the rounds, forms in alternation, L2 flushed. Triton configs are "
             "form,BLOCK_M,BLOCK_N,warps,stages; `ceiling` is timed only (it ignores the "
             "scales).", "",
             "| GEMM | a·bᵀ [R, C, K] | linears | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]  # fmt: skip
    for r in records:
        cells = [f"{r['ms'][n]:.3f} ({r['tflops'][n]:.0f})" for n in names]
        lines.append(f"| {r['gemm']} | {r['shape']} | {','.join(r['linears'])} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    lines += ["", "One block's sums, ms (each shape counted for each linear that has it):", ""]
    for gemm in (*dict.fromkeys(r["gemm"] for r in records), None):
        rows = [r for r in records if gemm is None or r["gemm"] == gemm]
        total = {n: sum(r["ms"][n] * len(r["linears"]) for r in rows) for n in names}
        best = sum(min(r["ms"][k] for k in _scaled(r["ms"])) * len(r["linears"]) for r in rows)
        faster = sum(min(r["ms"][k] for k in ("cublas", *_scaled(r["ms"]))) * len(r["linears"])
                     for r in rows)  # fmt: skip
        label = gemm or "all"
        per_config = ", ".join(f"{n} {v:.3f}" for n, v in total.items() if n != "cublas")
        lines.append(f"- {label}: cuBLAS {total['cublas']:.3f}; Triton, best config a shape "
                     f"{best:.3f}; the faster of cuBLAS and Triton a shape {faster:.3f}; "
                     f"per config {per_config}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
