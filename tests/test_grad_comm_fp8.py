"""The fused fp8 gradient all-reduce (grad_comm_fp8.py, distributed._mean_fp8) against the
unfused implementation it replaced, bit for bit: on 2 gloo ranks through the real collectives,
in one process for other world sizes, and compiled (inductor on CPU) against eager."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

from bits import bits_equal
from gloo_ranks import WORLD, spawn
from minifloat import grad_comm_fp8 as fp8c
from minifloat.distributed import GradCommState, _fp8_hook, reduce_mean

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Bucket sizes: tiny, odd (not divisible by the world size), a power of two, large and odd.
SIZES = [1, 3, 1000, 10_001, 65_536, 100_003]


# ---- the unfused implementation (minifloat.distributed before the fused passes), verbatim ----


def _old_quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (x / scale).clamp(-fmax, fmax).to(dtype).view(torch.uint8)


def _old_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))


def _old_mean_fp8(flat: torch.Tensor, fp8_format: str) -> tuple[torch.Tensor, float]:
    world = dist.get_world_size()
    dtype = FORMATS[fp8_format]
    numel = flat.numel()
    chunk = math.ceil(numel / world)
    hp = F.pad(flat.float() / world, (0, chunk * world - numel))
    amax = hp.abs().amax().reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    scale = _old_scale_from_amax(amax, dtype)
    payload = _old_quantize_fp8(hp, scale, dtype)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload)
    partial = received.view(dtype).float().view(world, chunk).sum(0) * scale
    chunk_scale = _old_scale_from_amax(partial.abs().amax().reshape(1), dtype)
    reduced = _old_quantize_fp8(partial, chunk_scale, dtype)
    chunks = [torch.empty_like(reduced) for _ in range(world)]
    scales = [torch.empty_like(chunk_scale) for _ in range(world)]
    dist.all_gather(chunks, reduced)
    dist.all_gather(scales, chunk_scale)
    out = torch.cat([c.view(dtype).float() * s for c, s in zip(chunks, scales, strict=True)])
    sent = 2.0 * (world - 1) / world * 4 + (world - 1) * chunk + (world - 1) * (chunk + 4)
    return out[:numel], sent


def _old_simulated(flats: list[torch.Tensor], fp8_format: str) -> torch.Tensor:
    """_old_mean_fp8 for len(flats) ranks in one process (its collectives done by hand)."""
    world, dtype, numel = len(flats), FORMATS[fp8_format], flats[0].numel()
    chunk = math.ceil(numel / world)
    hps = [F.pad(f.float() / world, (0, chunk * world - numel)) for f in flats]
    amax = torch.stack([hp.abs().amax() for hp in hps]).amax().reshape(1)
    scale = _old_scale_from_amax(amax, dtype)
    payloads = [_old_quantize_fp8(hp, scale, dtype).view(world, chunk) for hp in hps]
    out = []
    for r in range(world):
        received = torch.stack([p[r] for p in payloads])
        partial = received.view(dtype).float().sum(0) * scale
        chunk_scale = _old_scale_from_amax(partial.abs().amax().reshape(1), dtype)
        out.append(_old_quantize_fp8(partial, chunk_scale, dtype).view(dtype).float() * chunk_scale)
    return torch.cat(out)[:numel]


def _new_simulated(flats: list[torch.Tensor], fp8_format: str) -> torch.Tensor:
    """distributed._mean_fp8's passes for len(flats) ranks in one process."""
    world, numel = len(flats), flats[0].numel()
    chunk = math.ceil(numel / world)
    amax = torch.cat([fp8c.bucket_amax(f, world) for f in flats]).amax().reshape(1)
    payloads = [fp8c.encode(f, amax, world, fp8_format, chunk * world) for f in flats]
    gathered = torch.empty(world, chunk + fp8c.SCALE_BYTES, dtype=torch.uint8)
    for r in range(world):
        received = torch.stack([p.view(world, chunk)[r] for p in payloads])
        scale = fp8c.reduce_chunks_into(gathered[r], received, amax, fp8_format)
        gathered[r, chunk:] = scale.view(torch.uint8)
    scales = gathered[:, chunk:].contiguous().view(torch.float32)
    return fp8c.decode_into(torch.empty(numel), gathered, scales, fp8_format)


# ---- test data -----------------------------------------------------------------------------------


def _grad(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Heavy-tailed values over many binades, zeros of both signs and a few fp32 subnormals."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=gen) * torch.exp(3 * torch.randn(numel, generator=gen))
    g[::17] = 0.0
    g[1::31] = -0.0
    g[5::97] = 1e-40
    return g.to(dtype)


def _cases(rank: int) -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's bucket) for every bit-exactness case."""
    cases = [(f"n={n}", _grad(n, 10 * n + rank)) for n in SIZES]
    cases.append(("bf16", _grad(10_001, 7 + rank, torch.bfloat16)))
    cases.append(("zeros", torch.zeros(4097)))
    cases.append(("tiny", _grad(999, 3 + rank) * 1e-40))  # subnormal amax and scales
    one_rank_zero = _grad(513, 11) if rank == 0 else torch.zeros(513)
    cases.append(("zeros-on-rank-1", one_rank_zero))
    bad_entries = (("inf", math.inf, 1), ("-inf", -math.inf, 0), ("nan", math.nan, 1),
                   ("nan-on-rank-0", math.nan, 0))  # fmt: skip
    for name, value, where in bad_entries:
        bad = _grad(2049, 5 + rank)
        if rank == where:
            bad[1500] = value  # in the second rank's chunk
        cases.append((name, bad))
    return cases


# ---- 2 gloo ranks: the fused path equals the unfused one ---------------------------------------


def _equals_unfused_worker(rank: int) -> None:
    for fmt in FORMATS:
        for name, flat in _cases(rank):
            want, want_sent = _old_mean_fp8(flat, fmt)
            fut, sent = reduce_mean(flat, "fp8", fp8_format=fmt)
            got = fut.wait()
            assert got.dtype == torch.float32 and got.shape == flat.shape, (fmt, name)
            assert bits_equal(got, want), (fmt, name)
            assert sent == want_sent, (fmt, name)
            both = [torch.empty_like(got) for _ in range(WORLD)]
            dist.all_gather(both, got)
            assert bits_equal(both[0], both[1]), (fmt, name)  # identical on every rank
            if name in ("inf", "-inf"):  # documented: the whole bucket decodes to NaN
                assert got.isnan().all(), (fmt, name)
            elif name.startswith(
                "nan"
            ):  # NaN never becomes finite (the MAX all-reduce may drop it)
                assert got.isnan().any(), (fmt, name)
            elif name == "zeros":
                assert bits_equal(got, torch.zeros_like(got)), fmt
    _hook_writes_bucket(rank)


def _hook_writes_bucket(rank: int) -> None:
    """The DDP hook decodes into the bucket (fp32 or bf16) what the unfused hook copied there,
    and counts the same bytes."""
    for dtype in (torch.float32, torch.bfloat16):
        state = GradCommState(kind="fp8")
        sent_total = 0.0
        for step, n in enumerate((10_001, 64)):
            bucket = _grad(n, 100 * step + rank, dtype)
            want, sent = _old_mean_fp8(bucket, "e4m3")
            sent_total += sent
            fut = _fp8_hook(state, bucket)
            assert fut.wait() is bucket and bits_equal(bucket, want.to(dtype)), (dtype, n)
        assert (state.calls, state.elements, state.bytes_sent) == (2, 10_065, sent_total)
        assert state.bytes_sent_fp32 == pytest.approx(4 * state.bytes_sent, rel=0.01)


def test_fused_fp8_mean_equals_unfused_bit_for_bit():
    spawn(_equals_unfused_worker)


# ---- one process: other world sizes, compiled against eager ------------------------------------


@pytest.mark.parametrize("world", [3, 4, 8])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fused_passes_equal_unfused_for_other_world_sizes(world, fmt):
    # E5M2 sums of 3+ chunks round (E4M3 ones are exact): the rank-order chain must add them
    # as the unfused sum(0) did.
    for numel in (1, 10_001, 4096 + world - 1):
        flats = [_grad(numel, 31 * r + numel) for r in range(world)]
        assert bits_equal(_new_simulated(flats, fmt), _old_simulated(flats, fmt)), numel


def _pass_inputs(numel: int, fmt: str, dtype: torch.dtype) -> dict:
    """Arguments of every pass for one bucket of 2 simulated ranks."""
    world, chunk = 2, math.ceil(numel / 2)
    flat = _grad(numel, numel, dtype)
    amax = fp8c.bucket_amax(flat, world)
    payload = fp8c.encode(flat, amax, world, fmt, chunk * world)
    gathered = torch.randint(0, 256, (world, chunk + fp8c.SCALE_BYTES), dtype=torch.uint8)
    gathered[:, :chunk] = payload.view(world, chunk)  # valid fp8 values, NaN codes included
    scales = torch.tensor([[3e-3], [0.5]])
    return {
        fp8c.bucket_amax: lambda: (flat, world),
        fp8c.encode: lambda: (flat, amax, world, fmt, chunk * world),
        fp8c.reduce_chunks_into: lambda: (
            torch.zeros(chunk + 4, dtype=torch.uint8),
            payload.view(world, chunk),
            amax,
            fmt,
        ),
        fp8c.decode_into: lambda: (torch.empty(numel, dtype=dtype), gathered, scales, fmt),
    }


@pytest.mark.slow
def test_compiled_passes_equal_eager_bit_for_bit():
    """The compiled twins CUDA runs, here on CPU (inductor's C++): not a bit may change, for
    every pass, bucket size and dtype, with one dynamic graph per pass and configuration.
    ~25 s to compile on 2 cores with a cold inductor cache."""
    torch._dynamo.reset()
    counters.clear()
    for fmt, dtype in (("e4m3", torch.float32), ("e5m2", torch.bfloat16)):
        for numel in (10_001, 4096, 777):
            passes = _pass_inputs(numel, fmt, dtype)
            received = passes[fp8c.reduce_chunks_into]()[1]
            if fmt == "e4m3":  # sums of -0 and -0, which must come out +0 as in eager
                assert ((received[0] == 0x80) & (received[1] == 0x80)).any()
            for fn, make_args in passes.items():
                eager_args, compiled_args = make_args(), make_args()
                want = fn(*eager_args)
                got = fp8c.twin(fn)(*compiled_args)
                assert bits_equal(got.view(-1).float(), want.view(-1).float()), (fn, numel)
                for a, b in zip(eager_args, compiled_args, strict=True):  # written outputs
                    if isinstance(a, torch.Tensor):
                        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), fn
    assert counters["stats"]["unique_graphs"] == 8, dict(counters["stats"])  # 4 passes x 2
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_passes_equal_cpu_eager_bit_for_bit():
    """What the DDP hook runs on CUDA (the compiled twins, through `kernel`) against the CPU
    eager passes: the same bits."""
    for fmt, dtype in (("e4m3", torch.float32), ("e5m2", torch.bfloat16)):
        for numel in (6_553_601, 4096):
            for fn, make_args in _pass_inputs(numel, fmt, dtype).items():
                cpu_args = make_args()
                cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu_args]
                want = fn(*cpu_args)
                got = fp8c.kernel(fn, cuda_args[0])(*cuda_args)
                assert bits_equal(got.view(-1).float(), want.view(-1).float()), (fn, numel)
                for a, b in zip(cpu_args, cuda_args, strict=True):
                    if isinstance(a, torch.Tensor):
                        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), fn


def test_codec_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/grad_comm_codec.py: every pass timed, the bucket total summed, JSON written."""
    import json

    from scripts import load_benchmark

    module = load_benchmark("grad_comm_codec")
    module.main(["--device", "cpu", "--numel", "1001", "--world", "3", "--modes", "eager",
                 "--dtypes", "bfloat16", "--repeats", "2", "--out", str(tmp_path)])  # fmt: skip
    (js,) = tmp_path.glob("grad_comm_codec_*.json")
    records = json.loads(js.read_text())
    assert [r["pass"] for r in records] == [*module.PASSES, "bucket total"]
    assert all(r["ms"] > 0 and r["min_bytes"] > 0 for r in records)
    assert records[-1]["min_bytes"] == sum(r["min_bytes"] for r in records[:-1])


# ---- bad arguments: one-line errors, eager and through the compiled twins ---------------------


def _bad_calls() -> list[tuple[str, object, type[Exception], str]]:
    flat, amax = torch.randn(10), torch.tensor([1.0])
    received = torch.zeros(2, 5, dtype=torch.uint8)
    send, out = torch.zeros(9, dtype=torch.uint8), torch.empty(10)
    gathered, scales = torch.zeros(2, 9, dtype=torch.uint8), torch.ones(2, 1)
    return [
        # F.pad with a negative pad cropped 6 of the 10 values silently
        ("padded<numel", lambda: (fp8c.encode, (flat, amax, 2, "e4m3", 4)), ValueError,
         r"padded must be an int >= flat.numel\(\) = 10, got 4"),
        ("padded-float", lambda: (fp8c.encode, (flat, amax, 2, "e4m3", 10.0)), ValueError,
         "padded must be an int"),
        ("world=0", lambda: (fp8c.bucket_amax, (flat, 0)), ValueError, "world must be >= 1"),
        ("world=-2", lambda: (fp8c.bucket_amax, (flat, -2)), ValueError, "world must be >= 1"),
        ("world-float", lambda: (fp8c.bucket_amax, (flat, 2.0)), TypeError, "world must be an int"),
        ("encode-world=0", lambda: (fp8c.encode, (flat, amax, 0, "e4m3", 10)), ValueError,
         "world must be >= 1"),
        ("encode-fmt", lambda: (fp8c.encode, (flat, amax, 2, "E4M3", 10)), ValueError,
         "fmt must be one of e4m3, e5m2, got 'E4M3'"),
        ("reduce-fmt", lambda: (fp8c.reduce_chunks_into, (send, received, amax, "e3m4")),
         ValueError, "fmt must be one of e4m3, e5m2"),
        # fp8 bit patterns written into a float32 buffer as numbers
        ("reduce-send-f32", lambda: (fp8c.reduce_chunks_into,
                                     (send.float(), received, amax, "e4m3")),
         ValueError, "send must be a uint8 buffer .*got torch.float32"),
        ("reduce-send-fp8", lambda: (fp8c.reduce_chunks_into,
                                     (send.view(torch.float8_e4m3fn), received, amax, "e4m3")),
         ValueError, "send must be a uint8 buffer"),
        ("decode-fmt", lambda: (fp8c.decode_into, (out, gathered, scales, None)), ValueError,
         "fmt must be one of e4m3, e5m2, got None"),
    ]  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "twin"])
@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_bad_arguments_are_refused_in_one_line(case, compiled):
    _, make, error, match = _bad_calls()[case]
    fn, args = make()
    run = fp8c.twin(fn) if compiled else fn  # the twin checks before it compiles anything
    with pytest.raises(error, match=match) as info:
        run(*args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fmt", ["e8m0", "E5M2", 4])
def test_shared_scale_refuses_unknown_formats(fmt):
    with pytest.raises(ValueError, match="fmt must be one of e4m3, e5m2"):
        fp8c.shared_scale(torch.tensor([1.0]), fmt)


def test_encode_pads_and_keeps_every_value_at_the_bound():
    flat = _grad(10, 0)
    amax = fp8c.bucket_amax(flat, 1)
    exact = fp8c.encode(flat, amax, 1, "e4m3", 10)
    padded = fp8c.encode(flat, amax, 1, "e4m3", 12)
    assert torch.equal(padded[:10], exact) and not padded[10:].any()


def test_bucket_amax_refuses_an_empty_bucket():
    with pytest.raises(ValueError, match="non-empty flat"):
        fp8c.bucket_amax(torch.empty(0), 2)


@pytest.mark.parametrize(
    ("send", "received", "match"),
    [
        (torch.zeros(9, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8), "received must"),
        (torch.zeros(9, dtype=torch.uint8), torch.zeros(2, 5), "received must"),
        (torch.zeros(9, dtype=torch.uint8), torch.zeros(0, 5, dtype=torch.uint8), "received"),
        (torch.zeros(3, dtype=torch.uint8), torch.zeros(2, 5, dtype=torch.uint8), "send must"),
    ],
    ids=["1-D", "float", "no-rank", "short-send"],
)
def test_reduce_chunks_into_refuses_bad_buffers(send, received, match):
    # a 1-D `received` was summed as ten one-byte "ranks", silently
    with pytest.raises(ValueError, match=match):
        fp8c.reduce_chunks_into(send, received, torch.tensor([1.0]), "e4m3")


@pytest.mark.parametrize(
    ("out", "gathered", "scales", "match"),
    [
        (torch.empty(10), torch.zeros(2, 9), torch.ones(2, 1), "gathered must"),
        (torch.empty(10, dtype=torch.long), torch.zeros(2, 9, dtype=torch.uint8),
         torch.ones(2, 1), "out must"),
        (torch.empty(12), torch.zeros(2, 9, dtype=torch.uint8), torch.ones(2, 1), "out must"),
        (torch.empty(2), torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2, 1), "chunk"),
        (torch.empty(10), torch.zeros(2, 9, dtype=torch.uint8), torch.ones(2), "scales"),
    ],
    ids=["float-gathered", "int-out", "long-out", "short-rows", "1-D-scales"],
)  # fmt: skip
def test_decode_into_refuses_bad_buffers(out, gathered, scales, match):
    # float32 bytes were read as fp8 codes and an int64 `out` truncated the mean, silently
    with pytest.raises(ValueError, match=match):
        fp8c.decode_into(out, gathered, scales, "e4m3")
