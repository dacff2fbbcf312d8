"""The output head and the cross entropy together, in chunks of tokens: no [tokens, vocab] logits.

At 1.3B (8 x 2048 tokens, a 32000 vocabulary) the head's logits are 1 GiB in bf16 and their
gradient another 1 GiB; both are alive at the step's peak, when backward starts with every
activation still saved. Here the model's head can be deferred (`defer_head` swaps in a
`DeferredHead`: inside `ChunkedHeadObjective.deferring()` the model returns its final hidden
states, elsewhere its logits as before, for evaluation, generation and diagnostics) and
`ChunkedHeadObjective` applies it a chunk of tokens at a time: each chunk's logits give the
chunk's loss and, in the same pass, its gradient, from which the head's two backward GEMMs run
at once; the chunk's logits are then dropped. Backward only scales the
two gradients kept (hidden states' and the head weight's) by the objective's incoming gradient.

    fprop  logits_c = h_c · Wᵀ                       (a chunk of tokens at a time)
    dgrad  dh_c     = dlogits_c · W
    wgrad  dW       = Σ_c dlogits_cᵀ · h_c          (each chunk's product added in fp32)

Numerics: the formulas are `loss.objective`'s (fp32 cross entropy from logits in the compute
dtype, PaLM's z-loss over every token), with the gradient written out: dlogits = p · (valid /
n_valid + 2 · z_coef · lse / n) − onehot(target) · valid / n_valid, p the softmax, rounded to the
compute dtype as autocast's backward rounds it. Against autograd through the unchunked head the
sums run in another order, so values differ in the last bits. dW is summed in fp32 over chunks
(the unchunked GEMM rounds it to bf16 once): on CUDA each chunk's product is added in the GEMM's
fp32 epilogue, on the CPU rounded to the compute dtype first (ATen has no fp32 output for bf16
operands there). `tests/train/test_head_loss.py` states the tolerances. Measured on the H200
(session 55, `benchmarks/head_loss.py`, a 1.3B step's head: 16384 tokens, 2048 -> 32000): 1.22
GiB at its peak against the compiled loss's 2.14, in 11.30 against 10.67 ms (chunks of 4096);
in 1.3B training 1.0-1.1 GiB less at the step's peak at the same step time.
The gradient is made in forward, before a loss scaler's scale: fp16 compute is refused (it would
underflow), bf16 and fp32 are exact enough. Targets equal to -100 are ignored, as in
`F.cross_entropy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from minifloat.convert import is_output_head

__all__ = ["HEAD_LOSS_MODES", "ChunkedHeadObjective", "DeferredHead", "defer_head"]

HEAD_LOSS_MODES = ("eager", "compiled")
_FP16 = (
    "the chunked head loss makes its gradient in forward, before a loss scale: fp16 would "
    "underflow; use bf16 or fp32"
)
IGNORE_INDEX = -100  # F.cross_entropy's default


class DeferredHead(nn.Module):
    """Stands in for a model's output head: the head itself, or, while `deferred` is set
    (`ChunkedHeadObjective.deferring()`), the identity on the final hidden states.

    The head's weight stays here, the same Parameter under the same state_dict key (so
    optimizers, checkpoints and tied embeddings see no change), for `ChunkedHeadObjective`.
    """

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.weight = head.weight
        self.in_features, self.out_features = head.in_features, head.out_features
        self.deferred = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.deferred else self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits for `hidden`, as the head computed them."""
        return F.linear(hidden, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


def defer_head(model: nn.Module) -> DeferredHead:
    """Swap `model`'s output head for a `DeferredHead` (in place) and return it; the model
    computes as before outside a `ChunkedHeadObjective.deferring()` region.

    The head is found as `minifloat.convert` finds it: the one `nn.Linear` named lm_head, output
    or head outside any repeated block. A model compiled whole (`torch.compile(model)`) may be
    passed: it traces the head in each state it meets (one graph each).
    """
    found = [
        (name, module)
        for name, module in model.named_modules()
        if is_output_head(name) and isinstance(module, (nn.Linear, DeferredHead))
    ]
    if len(found) != 1:
        names = ", ".join(name for name, _ in found) or "none"
        raise ValueError(
            f"defer_head needs exactly one output head (lm_head/output/head), found {names}"
        )
    name, head = found[0]
    if isinstance(head, DeferredHead):
        return head
    if type(head) is not nn.Linear:
        raise ValueError(
            f"defer_head: the output head {name!r} is a {type(head).__name__}; it takes a plain "
            "nn.Linear head (keep the head in high precision)"
        )
    if head.bias is not None:
        raise ValueError(f"defer_head: the output head {name!r} has a bias, which is not supported")
    if isinstance(head.weight, DTensor):  # FSDP would keep gathering onto the swapped-out head
        raise ValueError(
            f"defer_head: the output head {name!r} is already sharded; call defer_head before "
            "fully_shard / apply_fsdp"
        )
    parent_name, _, attr = name.rpartition(".")
    deferred = DeferredHead(head)
    setattr(model.get_submodule(parent_name), attr, deferred)
    return deferred


def _chunk_terms(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ce_weight: torch.Tensor,
    z_weight: float,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's (sum of cross entropies, sum of lse², d objective / d logits or None).

    logits [n, vocab] in the compute dtype, targets [n]; ce_weight: 1 / valid tokens (0-d fp32),
    z_weight: 2 · z_coef / tokens. The gradient is in the logits' dtype.
    """
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    picked = x.gather(1, safe[:, None])[:, 0]
    ce_sum = torch.where(valid, lse - picked, 0.0).sum()
    z_sum = lse.square().sum()
    if not with_grad:
        return ce_sum, z_sum, None
    ce_row = valid.float() * ce_weight
    p = torch.exp(x - lse[:, None])
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == safe[:, None]
    grad = p * (ce_row + z_weight * lse)[:, None] - torch.where(onehot, ce_row[:, None], 0.0)
    return ce_sum, z_sum, grad.to(logits.dtype)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a · b in acc's dtype (fp32 for 16-bit operands): on CUDA in the GEMM's epilogue
    (`out_dtype`: no product in the operands' dtype, no pass to add it); elsewhere the product
    rounded to the operands' dtype, then added (ATen's CPU GEMM has no fp32 output for bf16
    operands)."""
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and acc.dtype == torch.float32:
        return torch.addmm(acc, a, b, out_dtype=acc.dtype)
    return acc.add_(a @ b)


class _ChunkedHeadLoss(torch.autograd.Function):
    """(loss, objective) of hidden [N, D] through the head weight [V, D] against targets [N].

    Shapes: hidden [N, D] (any float dtype), weight [V, D], targets [N] int64; computed in
    `dtype` (cast here, as autocast would). GEMMs per chunk c of `chunk` tokens, in forward:
    fprop logits_c = h_c · Wᵀ, dgrad dh_c = dlogits_c · W, wgrad dW += dlogits_cᵀ · h_c.
    Backward scales dh and dW by the objective's gradient (in fp32); the loss output is not
    differentiable (backward goes through the objective). `grad_on`: grad mode at the call
    (forward runs without it, and `needs_input_grad` follows requires_grad alone).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, dtype, chunk, z_loss_coef, terms, grad_on):
        needs_dh, needs_dw = (grad_on and needed for needed in ctx.needs_input_grad[:2])
        with_grad = needs_dh or needs_dw
        n = hidden.shape[0]
        h, w = hidden.to(dtype), weight.to(dtype)
        n_valid = (targets != IGNORE_INDEX).sum().float()
        # no valid target: the loss is NaN (as F.cross_entropy's) and the gradient zero
        ce_weight = 1.0 / n_valid.clamp(min=1.0)
        z_weight = 2.0 * z_loss_coef / n
        dh = torch.empty_like(h) if needs_dh else None
        acc_dtype = torch.promote_types(dtype, torch.float32)
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if needs_dw else None
        ce_sum = z_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            h_c = h[start : start + chunk]
            logits = h_c @ w.t()
            ce_c, z_c, grad = terms(
                logits, targets[start : start + chunk], ce_weight, z_weight, with_grad
            )
            ce_sum, z_sum = ce_sum + ce_c, z_sum + z_c
            del logits
            if needs_dh:
                torch.mm(grad, w, out=dh[start : start + chunk])
            if needs_dw:
                dw = _add_product(dw, grad.t(), h_c)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        loss = ce_sum / n_valid
        total = loss + z_loss_coef * z_sum / n if z_loss_coef > 0 else loss.clone()
        ctx.mark_non_differentiable(loss)
        return loss, total

    @staticmethod
    def backward(ctx, _grad_loss, grad_total):
        dh, dw = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        if dh is not None:
            dh = (dh.float() * grad_total).to(hidden_dtype)
        if dw is not None:
            dw = (dw * grad_total).to(weight_dtype)
        return dh, dw, None, None, None, None, None, None


class ChunkedHeadObjective:
    """`loss.objective` for a model whose head `defer_head` swapped: called on the model's
    output inside `deferring()` (its final hidden states [..., D]) and the targets [...], it
    returns (loss, objective) as `TrainingObjective` does, with no [tokens, vocab] tensor alive.
    Backward goes through the objective only (the loss is returned detached, even without a
    z-loss). Call it under the model's autocast, or give `dtype`: the head computes in it.

        head = defer_head(model)
        objective = ChunkedHeadObjective(head)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with objective.deferring():
                hidden = model(tokens)
            loss, total = objective(hidden, targets)
        total.backward()

    Under FSDP2, call `defer_head` before `fully_shard` (FSDP records each parameter's
    module) and keep the root's parameters gathered after its forward
    (`model.set_reshard_after_forward(False, recurse=False)`): the objective reads the head's
    weight after the model's forward, and its gradient is reduce-scattered after backward.

    Args:
        head: the `DeferredHead` that `defer_head(model)` returned.
        z_loss_coef: weight of PaLM's z-loss; 0 leaves it out.
        chunk_tokens: tokens per chunk: each chunk's logits and their gradient are alive at
            once (2 x 250 MiB at 4096 tokens and a 32000 vocabulary in bf16).
        mode: the per-chunk loss and gradient eager or compiled (`torch.compile`, static
            shapes: one graph for full chunks, one for a shorter last chunk).
        dtype: the head's compute dtype; None: autocast's where the call runs under autocast
            (as the head's own GEMM would), else the hidden states'.
    """

    def __init__(
        self,
        head: DeferredHead,
        z_loss_coef: float = 0.0,
        *,
        chunk_tokens: int = 4096,
        mode: str = "compiled",
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(head, DeferredHead):
            raise TypeError(
                f"head must be the DeferredHead from defer_head(model), got {type(head).__name__}"
            )
        if mode not in HEAD_LOSS_MODES:
            raise ValueError(
                f"head loss mode must be one of {', '.join(HEAD_LOSS_MODES)}, got {mode!r}"
            )
        if not z_loss_coef >= 0.0:
            raise ValueError(f"z-loss weight must be >= 0, got {z_loss_coef}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        if dtype == torch.float16:
            raise ValueError(_FP16)
        self.head, self.z_loss_coef = head, float(z_loss_coef)
        self.chunk_tokens, self.mode, self.dtype = chunk_tokens, mode, dtype
        self._terms = (
            torch.compile(_chunk_terms, dynamic=False) if mode == "compiled" else _chunk_terms
        )

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside it, the model's forward returns its final hidden states (the head deferred)."""
        previous, self.head.deferred = self.head.deferred, True
        try:
            yield
        finally:
            self.head.deferred = previous

    def __call__(
        self, hidden: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if targets.numel() == 0:
            raise ValueError("the chunked head loss needs at least one token")
        if hidden.shape[-1] != self.head.in_features or hidden.shape[:-1] != targets.shape:
            raise ValueError(
                f"hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)} "
                f"and the head's {self.head.in_features} input features"
            )
        device = hidden.device.type
        dtype = self.dtype
        if dtype is None:
            autocast = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
        if dtype == torch.float16:
            raise ValueError(_FP16)
        with torch.autocast(device, enabled=False):
            return _ChunkedHeadLoss.apply(
                hidden.reshape(-1, hidden.shape[-1]),
                self.head.weight,
                targets.reshape(-1),
                dtype,
                self.chunk_tokens,
                self.z_loss_coef,
                self._terms,
                torch.is_grad_enabled(),
            )
