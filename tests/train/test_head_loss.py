"""minifloat.train.head_loss: the head and the cross entropy a chunk of tokens at a time equal the
unchunked head and `loss.objective` within stated tolerances, save no [tokens, vocab] tensor,
and the head is deferred in our Llama and in `transformers` models without changing parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from minifloat.models import Llama, LlamaConfig
from minifloat.train.head_loss import ChunkedHeadObjective, DeferredHead, defer_head
from minifloat.train.loss import TrainingObjective, objective

# The loss: the chunks' sums and the log-sum-exp run in another order than ATen's, and a
# chunk's GEMM (fewer rows) may use another kernel than the whole one's, rounding a logit
# differently (measured on AVX-512: the same logits, <= 1e-7 relative on ~7).
LOSS_RTOL = 1e-5
# Gradients: both paths round the logits and their gradient to the compute dtype; against
# float64 from the same rounded operands the chunked path's error is the unchunked one's
# (measured: 1.84e-3 against 1.84e-3 at bf16); 25 % more is allowed for another GEMM kernel's
# rounding (a wrong term would be off by orders of magnitude). In fp32 both are within
# FP32_GRAD_RTOL of float64.
GRAD_ERROR_RATIO = 1.25
FP32_GRAD_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _head(dim: int = 64, vocab: int = 1000, seed: int = 0) -> DeferredHead:
    torch.manual_seed(seed)
    return DeferredHead(nn.Linear(dim, vocab, bias=False))


def _inputs(tokens: int, dim: int, vocab: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens // 2, dim, generator=gen).requires_grad_()
    return hidden, torch.randint(0, vocab, (2, tokens // 2), generator=gen)


def _grads(fn, hidden, head, targets, autocast: bool):
    """(loss, total, dh, dW) of `fn(hidden, targets)` under bf16 autocast or in fp32."""
    hidden.grad, head.weight.grad = None, None
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, total = fn(hidden, targets)
    total.backward()
    return loss.detach(), total.detach(), hidden.grad.clone(), head.weight.grad.clone()


def _unchunked(head, z_loss_coef):
    return lambda hidden, targets: objective(head.logits(hidden), targets, z_loss_coef)


def _truth(hidden, head, targets, z_loss_coef, dtype):
    """dh, dW in float64 from the operands rounded to the compute dtype."""
    h = hidden.detach().to(dtype).double().requires_grad_()
    w = head.weight.detach().to(dtype).double().requires_grad_()
    objective(h @ w.t(), targets, z_loss_coef)[1].backward()
    return h.grad, w.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("z_loss_coef", [0.0, 1e-2])
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("tokens", "chunk"), [(256, 100), (256, 256), (64, 4096)])
def test_chunked_matches_the_unchunked_head_and_loss(tokens, chunk, autocast, z_loss_coef, mode):
    head = _head()
    hidden, targets = _inputs(tokens, 64, 1000)
    want = _grads(_unchunked(head, z_loss_coef), hidden, head, targets, autocast)
    fn = ChunkedHeadObjective(head, z_loss_coef, chunk_tokens=chunk, mode=mode)
    got = _grads(fn, hidden, head, targets, autocast)
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g, w, rtol=LOSS_RTOL, atol=0.0)
    assert got[2].dtype == hidden.dtype and got[3].dtype == head.weight.dtype == torch.float32
    truth = _truth(
        hidden, head, targets, z_loss_coef, torch.bfloat16 if autocast else torch.float32
    )
    for g, w, t in zip(got[2:], want[2:], truth, strict=True):
        if autocast:
            assert _rel(g, t) <= GRAD_ERROR_RATIO * _rel(w, t)
        else:
            assert _rel(g, t) <= FP32_GRAD_RTOL and _rel(w, t) <= FP32_GRAD_RTOL


def test_ignored_targets_as_in_cross_entropy():
    head = _head(vocab=300)
    hidden, targets = _inputs(128, 64, 300)
    targets[0, :10] = -100
    targets[1, 5] = -100
    want = _grads(_unchunked(head, 0.0), hidden, head, targets, autocast=False)
    got = _grads(
        ChunkedHeadObjective(head, chunk_tokens=50, mode="eager"), hidden, head, targets, False
    )
    torch.testing.assert_close(got[0], want[0], rtol=LOSS_RTOL, atol=0.0)
    assert _rel(got[2], want[2].double()) <= FP32_GRAD_RTOL
    assert _rel(got[3], want[3].double()) <= FP32_GRAD_RTOL
    assert torch.count_nonzero(got[2][0, :10]) == 0  # ignored tokens get no gradient


def test_no_tokens_by_vocab_tensor_is_saved():
    """What backward keeps: dh [N, D] and dW [V, D] in fp32, never the logits [N, V]."""
    tokens, dim, vocab = 256, 32, 2000
    head = _head(dim, vocab)
    hidden, targets = _inputs(tokens, dim, vocab)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        ChunkedHeadObjective(head, chunk_tokens=64)(hidden, targets)
    assert sorted(saved) == sorted([((tokens, dim), torch.bfloat16), ((vocab, dim), torch.float32)])
    # the unchunked head and eager cross entropy save [N, V] tensors (fp32 log-softmax)
    saved.clear()
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        _unchunked(head, 0.0)(hidden, targets)
    assert ((tokens, vocab), torch.float32) in saved


def test_all_targets_ignored_give_a_nan_loss_and_zero_gradients():
    """As F.cross_entropy: a NaN mean over no token, and no gradient from it (a padded batch
    must not poison the others' gradients)."""
    head = _head(vocab=300)
    hidden, targets = _inputs(64, 64, 300)
    targets.fill_(-100)
    got = _grads(ChunkedHeadObjective(head, chunk_tokens=50, mode="eager"), hidden, head,
                 targets, autocast=False)  # fmt: skip
    assert torch.isnan(got[0]) and torch.count_nonzero(got[2]) == 0
    assert torch.count_nonzero(got[3]) == 0


def test_backward_scales_in_fp32():
    """`objective / grad_accum` (the trainer's): the gradients scaled in fp32, not in bf16."""
    head = _head()
    hidden, targets = _inputs(128, 64, 1000)
    fn = ChunkedHeadObjective(head, chunk_tokens=50, mode="eager")
    base = _grads(fn, hidden, head, targets, autocast=True)
    hidden.grad, head.weight.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total = fn(hidden, targets)[1]
    (total / 3).backward()
    third = torch.tensor(1.0) / 3
    assert torch.equal(hidden.grad, base[2] * third)
    assert torch.equal(head.weight.grad, base[3] * third)


def test_backward_scales_by_the_incoming_gradient():
    head = _head()
    hidden, targets = _inputs(128, 64, 1000)
    fn = ChunkedHeadObjective(head, 1e-3, chunk_tokens=50, mode="eager")
    base = _grads(fn, hidden, head, targets, autocast=True)
    hidden.grad, head.weight.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, total = fn(hidden, targets)
    (total * 4.0).backward()  # a power of two: exact in every dtype
    assert torch.equal(hidden.grad, 4.0 * base[2]) and torch.equal(head.weight.grad, 4.0 * base[3])
    assert not loss.requires_grad and total.requires_grad


def test_without_grad_only_the_loss():
    """Under no_grad (evaluation) no chunk's gradient is made, though the inputs require grad."""
    head = _head()
    hidden, targets = _inputs(128, 64, 1000)
    fn = ChunkedHeadObjective(head, chunk_tokens=50, mode="eager")
    asked = []
    terms = fn._terms
    fn._terms = lambda *args: asked.append(args[-1]) or terms(*args)
    with torch.no_grad():
        loss, total = fn(hidden, targets)
    assert asked == [False, False, False]
    want = objective(head.logits(hidden.detach()), targets)[0]
    torch.testing.assert_close(loss, want, rtol=LOSS_RTOL, atol=0.0)
    assert torch.equal(loss, total) and not total.requires_grad


def _llama() -> Llama:
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=500, max_seq_len=64)
    model = Llama(cfg)
    model.init_weights(0)
    return model


def test_defer_head_in_our_llama_keeps_parameters_and_trains_alike():
    model = _llama()
    deferred = copy.deepcopy(model)
    keys, weight = list(deferred.state_dict()), deferred.output.weight
    head = defer_head(deferred)
    assert deferred.output is head and head.weight is weight
    assert list(deferred.state_dict()) == keys
    assert defer_head(deferred) is head  # deferring twice is a no-op
    tokens = torch.randint(0, 500, (2, 33), generator=torch.Generator().manual_seed(0))
    fn = ChunkedHeadObjective(head, chunk_tokens=24, mode="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        # outside `deferring` the model is unchanged: its logits, bit for bit
        assert torch.equal(deferred(tokens[:, :-1]), logits) and not head.deferred
        with fn.deferring():
            hidden = deferred(tokens[:, :-1])
        assert not head.deferred
        loss, total = fn(hidden, tokens[:, 1:])
    assert hidden.shape == (2, 32, 64)
    want_loss, want_total = objective(logits, tokens[:, 1:])
    torch.testing.assert_close(loss, want_loss, rtol=LOSS_RTOL, atol=0.0)
    want_total.backward()
    total.backward()
    for (name, p), q in zip(model.named_parameters(), deferred.parameters(), strict=True):
        # every gradient within the bf16 rounding of the head's gradient
        assert _rel(q.grad, p.grad.double()) < 1e-2, name


def test_defer_head_in_transformers_models():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64)
    )  # fmt: skip
    tokens = torch.randint(0, 128, (2, 16))
    logits = llama(tokens).logits
    head = defer_head(llama)
    assert llama.lm_head is head
    assert torch.equal(llama(tokens).logits, logits)
    with ChunkedHeadObjective(head, mode="eager").deferring():
        assert llama(tokens).logits.shape == (2, 16, 64)  # the final hidden states
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    )
    tied = gpt2.transformer.wte.weight
    assert defer_head(gpt2).weight is tied  # a tied head keeps sharing the embedding's weight


def test_bad_heads_and_arguments_fail_in_one_line():
    with pytest.raises(ValueError, match="exactly one output head"):
        defer_head(nn.Sequential(nn.Linear(4, 4)))
    biased = nn.Module()
    biased.lm_head = nn.Linear(4, 8)
    with pytest.raises(ValueError, match="has a bias"):
        defer_head(biased)

    class OwnLinear(nn.Linear):  # e.g. minifloat's QuantLinear: a quantized head
        pass

    quantized = nn.Module()
    quantized.lm_head = OwnLinear(4, 8, bias=False)
    with pytest.raises(ValueError, match="is a OwnLinear; it takes a plain nn.Linear"):
        defer_head(quantized)
    head = _head()
    with pytest.raises(TypeError, match="DeferredHead"):
        ChunkedHeadObjective(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="mode must be one of"):
        ChunkedHeadObjective(head, mode="fused")
    with pytest.raises(ValueError, match="z-loss weight"):
        ChunkedHeadObjective(head, -1.0)
    for chunk in (0, 1.5, True):
        with pytest.raises(ValueError, match="chunk_tokens"):
            ChunkedHeadObjective(head, chunk_tokens=chunk)
    fn = ChunkedHeadObjective(head, mode="eager")
    hidden, targets = _inputs(64, 64, 1000)
    with pytest.raises(ValueError, match="do not match"):
        fn(hidden, targets[:, :-1])
    with pytest.raises(ValueError, match="at least one token"):
        fn(hidden[:, :0], targets[:, :0])
    with pytest.raises(ValueError, match="fp16"), torch.autocast("cpu", dtype=torch.float16):
        fn(hidden, targets)
    with pytest.raises(ValueError, match="fp16"):
        ChunkedHeadObjective(head, dtype=torch.float16)


def test_an_explicit_dtype_outside_autocast_equals_autocasts():
    """dtype=bf16 called outside autocast (as the trainer calls it, in its fp32 island) gives
    what the call under bf16 autocast gives."""
    head = _head()
    hidden, targets = _inputs(128, 64, 1000)
    want = _grads(ChunkedHeadObjective(head, chunk_tokens=50, mode="eager"), hidden, head,
                  targets, autocast=True)  # fmt: skip
    fn = ChunkedHeadObjective(head, chunk_tokens=50, mode="eager", dtype=torch.bfloat16)
    got = _grads(fn, hidden, head, targets, autocast=False)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("z_loss_coef", [0.0, 1e-2])
def test_chunked_matches_the_unchunked_head_and_loss_on_gpu(z_loss_coef):
    """On CUDA each chunk's dW product is added in the GEMM's fp32 epilogue (`out_dtype`)."""
    head = _head(256, 5000).cuda()
    hidden, targets = _inputs(3000, 256, 5000)
    hidden, targets = hidden.detach().cuda().requires_grad_(), targets.cuda()
    want = _grads(_unchunked(head, z_loss_coef), hidden, head, targets, autocast=True)
    fn = ChunkedHeadObjective(head, z_loss_coef, chunk_tokens=1024)
    got = _grads(fn, hidden, head, targets, autocast=True)
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g, w, rtol=LOSS_RTOL, atol=0.0)
    truth = _truth(hidden, head, targets, z_loss_coef, torch.bfloat16)
    for g, w, t in zip(got[2:], want[2:], truth, strict=True):
        assert _rel(g, t) <= GRAD_ERROR_RATIO * _rel(w, t)


def _peak_bytes(fn, hidden, head, targets) -> int:
    """The most allocated above what was allocated before, over forward and backward."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        total = fn(hidden, targets)[1]
    total.backward()
    hidden.grad, head.weight.grad = None, None
    del total
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_head_peak_memory_grows_without_the_vocabulary_on_gpu() -> None:
    """From 4096 to 16384 tokens (a 1.3B step's) at d 2048 and a 32000 vocabulary, the chunked
    peak grows by the hidden states' tensors only (bf16 copy, dh, its fp32 cast: < 16 bytes a
    token x d); the unchunked head and compiled loss's by >= 2 x 2 bytes a token x vocab (the
    bf16 logits and their gradient, alive at once)."""
    dim, vocab = 2048, 32000
    torch.manual_seed(0)
    head = DeferredHead(nn.Linear(dim, vocab, bias=False)).cuda()
    chunked = ChunkedHeadObjective(head, chunk_tokens=2048)
    compiled = TrainingObjective(mode="compiled")

    def unchunked(h, t):
        return compiled(head.logits(h), t)

    peaks = {}
    for tokens in (4096, 16384):
        hidden = torch.randn(tokens, dim, device="cuda", requires_grad=True)
        targets = torch.randint(0, vocab, (tokens,), device="cuda")
        for name, fn in (("chunked", chunked), ("unchunked", unchunked)):
            _peak_bytes(fn, hidden, head, targets)  # compiles
            peaks[name, tokens] = _peak_bytes(fn, hidden, head, targets)
        del hidden
    grown = {name: peaks[name, 16384] - peaks[name, 4096] for name in ("chunked", "unchunked")}
    more = 16384 - 4096
    assert grown["unchunked"] >= 2 * 2 * more * vocab, peaks
    assert grown["chunked"] <= 16 * more * dim, peaks


def _trainer(tmp_path, dataset, name: str, **changes):
    from minifloat.train.config import TrainConfig
    from minifloat.train.trainer import Trainer

    changes = {"recipe": "bf16", **changes}
    config = TrainConfig(model="tiny", data="stdlib", device="cpu", steps=3,
                         model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
                         batch_size=2, seq_len=32, eval_every=0, eval_batches=1, z_loss=1e-4,
                         out_dir=str(tmp_path / name), **changes)  # fmt: skip
    return Trainer(config, dataset=dataset, progress=False)


def test_the_trainer_chunks_its_head_and_loss(tmp_path, dataset):
    """`loss_chunk`: the trainer defers the head in training steps only (evaluation sees the
    logits) and its losses follow the whole head's within the bf16 rounding of its gradient."""
    plain = _trainer(tmp_path, dataset, "plain")
    chunked = _trainer(tmp_path, dataset, "chunked", loss_chunk=24)  # 64 tokens: 24 + 24 + 16
    objective, head = chunked.objective, chunked.raw_model.output
    assert isinstance(objective, ChunkedHeadObjective) and objective.chunk_tokens == 24
    assert objective.dtype == torch.bfloat16 and objective.head is head
    want = [plain.train_step()["loss"] for _ in range(3)]
    got = [chunked.train_step()["loss"] for _ in range(3)]
    assert not head.deferred
    assert got == pytest.approx(want, rel=1e-3)
    assert chunked._evaluate() == pytest.approx(plain._evaluate(), rel=1e-3)


def test_the_trainer_refuses_a_chunked_head_under_fp16(tmp_path, dataset):
    from minifloat.train.errors import ConfigError

    with pytest.raises(ConfigError, match="loss-chunk needs one bf16 or fp32 compute dtype"):
        _trainer(tmp_path, dataset, "fp16", recipe="fp16", loss_chunk=24)


def _fsdp_worker(rank: int, root: str, compiled: bool) -> None:
    """FSDP2 on two gloo ranks, fp32 parameters built on the meta device, eager or each block
    compiled: the chunked head's gradient reaches the sharded weight (reduce-scattered) as the
    whole head's does."""
    from minifloat.train.config import TrainConfig
    from minifloat.train.trainer import Trainer

    trainers = {}
    for name, chunk in (("plain", 0), ("chunked", 24)):
        config = TrainConfig(
            recipe="bf16", model="tiny", data="stdlib", tokenizer="byte", device="cpu",
            model_overrides={"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64},
            data_max_bytes=100_000, cache_dir=f"{root}/cache{rank}", out_dir=f"{root}/{name}",
            parallel="fsdp", steps=3, batch_size=2, seq_len=32, eval_every=0, eval_batches=1,
            z_loss=1e-4, loss_chunk=chunk, save_checkpoints=False, compile=compiled,
        )  # fmt: skip
        trainers[name] = Trainer(config, progress=False)
    plain, chunked = trainers["plain"], trainers["chunked"]
    assert isinstance(chunked.raw_model.output, DeferredHead)
    blocks_compiled = [b._compiled_call_impl is not None for b in chunked.raw_model.layers]
    assert blocks_compiled == [compiled] * len(blocks_compiled)
    start = plain.raw_model.output.weight.full_tensor().clone()
    assert torch.equal(chunked.raw_model.output.weight.full_tensor(), start)  # initialized alike
    want = [plain.train_step()["loss"] for _ in range(3)]
    got = [chunked.train_step()["loss"] for _ in range(3)]
    assert got == pytest.approx(want, rel=1e-3)
    moved = plain.raw_model.output.weight.full_tensor() - start
    apart = chunked.raw_model.output.weight.full_tensor() - start - moved
    assert moved.norm() > 0 and apart.norm() < 0.05 * moved.norm(), (apart.norm(), moved.norm())
    assert chunked._evaluate() == pytest.approx(plain._evaluate(), rel=1e-3)
    if compiled:
        return
    # Deferred after sharding, FSDP would gather onto the swapped-out head: refused.
    from minifloat.distributed import apply_fsdp

    sharded = apply_fsdp(
        Llama(LlamaConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64, vocab_size=64))
    )
    with pytest.raises(ValueError, match="already sharded; call defer_head before fully_shard"):
        defer_head(sharded)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_chunked_head_under_fsdp(tmp_path, compiled):
    from gloo_ranks import spawn

    spawn(_fsdp_worker, str(tmp_path), compiled)
