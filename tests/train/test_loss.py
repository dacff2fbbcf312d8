"""minifloat.train.loss: the compiled objective equals the eager one within the reduction-order
tolerance, saves no fp32 copy of the logits, and the trainer compiles it with the model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minifloat.train.config import TrainConfig
from minifloat.train.loss import TrainingObjective

# Compiled, the log-sum-exp and the mean are summed in another order than ATen's: the loss may
# differ in the last fp32 bits (measured: 4.8e-7 absolute on ~7) and a gradient element by one
# rounding of its dtype. The eager path is the formula itself; no looser tolerance is needed.
LOSS_RTOL = 1e-6


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles `objective` anew: dynamo's cache for its code is process-wide, and
    past the recompile limit the compiled objective runs eagerly (TrainingObjective's note)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(2, rows // 2, vocab, generator=gen)).to(dtype).requires_grad_()


def _run(fn, logits, targets):  # noqa: ANN001
    loss, total = fn(logits, targets)
    total.backward()
    grad, logits.grad = logits.grad, None
    return loss.detach(), total.detach(), grad


@pytest.mark.parametrize("z_loss_coef", [0.0, 1e-2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "vocab"), [(64, 1000), (30, 517)])
def test_compiled_objective_matches_eager(rows, vocab, dtype, z_loss_coef) -> None:
    logits = _logits(rows, vocab, dtype)
    targets = torch.randint(0, vocab, (2, rows // 2), generator=torch.Generator().manual_seed(1))
    eager = _run(TrainingObjective(z_loss_coef), logits, targets)
    compiled = _run(TrainingObjective(z_loss_coef, mode="compiled"), logits, targets)
    for got, want in zip(compiled[:2], eager[:2], strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0.0)
    assert compiled[2].dtype == eager[2].dtype == dtype
    torch.testing.assert_close(compiled[2], eager[2])  # the dtype's default tolerance
    if z_loss_coef == 0.0:
        assert torch.equal(eager[0], eager[1])
    # against the formulas written out: the mean cross entropy of the fp32 logits, plus the
    # z-loss (coef * mean(logsumexp^2)) only in what backward differentiates
    flat = logits.detach().float().flatten(0, 1)
    assert torch.equal(eager[0], F.cross_entropy(flat, targets.flatten()))
    z = z_loss_coef * torch.logsumexp(flat, dim=-1).pow(2).mean()
    torch.testing.assert_close(eager[1] - eager[0], z, rtol=1e-6, atol=0.0)


def _saved_bytes(fn, logits, targets) -> tuple[int, list[tuple]]:  # noqa: ANN001
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(logits, targets)
    others = [t for t in saved if t.data_ptr() != logits.data_ptr()]  # logits: alive anyway
    return sum(t.numel() * t.element_size() for t in others), [(t.shape, t.dtype) for t in others]


def _check_saves_no_fp32_logits(fn, rows: int = 256, vocab: int = 4096) -> None:  # noqa: ANN001
    logits = _logits(rows, vocab, torch.bfloat16)
    targets = torch.randint(0, vocab, (2, rows // 2))
    per_row_bound = 3 * 8 + 8  # three fp32/fp64 statistics and an int64 target a row, at most
    saved, shapes = _saved_bytes(fn, logits, targets)
    assert saved <= per_row_bound * rows + 64, shapes


@pytest.mark.parametrize("z_loss_coef", [0.0, 1e-4])
def test_compiled_objective_saves_no_fp32_copy_of_the_logits(z_loss_coef) -> None:
    _check_saves_no_fp32_logits(TrainingObjective(z_loss_coef, mode="compiled"))
    logits, targets = _logits(256, 4096, torch.bfloat16), torch.randint(0, 4096, (2, 128))
    eager, _ = _saved_bytes(TrainingObjective(z_loss_coef), logits, targets)
    assert eager >= 4 * 256 * 4096  # eagerly the fp32 log-softmax [rows, vocab] is saved


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"mode": "fused"}, "loss mode must be one of eager, compiled"),
     ({"z_loss_coef": -1.0}, "z-loss weight must be >= 0"),
     ({"z_loss_coef": float("nan")}, "z-loss weight must be >= 0")],
)  # fmt: skip
def test_bad_arguments_fail_in_one_line(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        TrainingObjective(**kwargs)


@pytest.mark.parametrize(("compile_", "mode"), [(False, "eager"), (True, "compiled")])
def test_the_trainer_compiles_its_objective_with_the_model(tmp_path, dataset, compile_, mode):
    from minifloat.train.trainer import Trainer

    config = TrainConfig(recipe="bf16", model="tiny", data="stdlib", device="cpu", steps=1,
                         model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
                         batch_size=2, seq_len=32, eval_every=0, z_loss=1e-4,
                         out_dir=str(tmp_path / "run"), compile=compile_)  # fmt: skip
    trainer = Trainer(config, dataset=dataset, progress=False)
    assert trainer.objective.mode == mode
    assert math.isfinite(trainer.train_step()["loss"])
    if compile_:  # really compiled: it saves no fp32 copy of the logits
        _check_saves_no_fp32_logits(trainer.objective)


def _peak_bytes(fn, logits, targets) -> int:  # noqa: ANN001
    """The most the loss's forward and backward allocated on the GPU beyond what was live."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(logits, targets)[1].backward()
    logits.grad = None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_objective_peak_memory_on_gpu() -> None:
    # 1/4 of a 1.3B step's logits (4096 x 32000 bf16, 250 MiB). Eagerly the loss's backward
    # holds ~12 bytes an element beyond the logits at once (the saved fp32 log-softmax, the
    # fp32 gradient into it and the one it writes); compiled, the bf16 gradient and a few
    # floats a row.
    logits = _logits(4096, 32000, torch.bfloat16).detach().cuda().requires_grad_()
    targets = torch.randint(0, 32000, (2, 2048), device="cuda")
    compiled = TrainingObjective(mode="compiled")
    _peak_bytes(compiled, logits, targets)  # compiles
    eager_peak = _peak_bytes(TrainingObjective(), logits, targets)
    compiled_peak = _peak_bytes(compiled, logits, targets)
    assert eager_peak >= 6 * logits.numel()
    assert compiled_peak <= 2.5 * logits.numel(), (compiled_peak, eager_peak)
