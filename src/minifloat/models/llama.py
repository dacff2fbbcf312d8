"""Reference LLaMA-2 decoder (RMSNorm, RoPE, SwiGLU, optional grouped-query attention).

The model is deliberately plain: no tensor/pipeline parallelism inside, attention through
``F.scaled_dot_product_attention(is_causal=True)``, and every matrix multiply is an ``nn.Linear``
so that ``minifloat.convert`` can swap them for ``QuantLinear`` (a subclass) without the model
noticing. Precision-sensitive pieces stay in fp32 even under autocast:

- RMSNorm upcasts its input to fp32 for the mean of squares, then casts back to the input dtype
  before multiplying by the weight (the LLaMA / Hugging Face convention).
- RoPE angles, cos and sin are computed in fp32 and the rotation is applied in fp32
  (models/rope.py: one autograd Function, whose compiled backward is one kernel).
- The attention softmax runs inside SDPA, whose kernels accumulate in fp32.
- The SwiGLU's silu(g)·u is computed in fp32 and rounded once (models/swiglu.py).

RoPE uses the *rotate-half* convention (dimension ``i`` is paired with ``i + head_dim/2``), the
same one Hugging Face ``LlamaForCausalLM`` uses, so exported q/k weights need no permutation.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minifloat.models.rope import apply_rope, rope_cos_sin
from minifloat.models.swiglu import swiglu

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "get_config",
    "rope_cos_sin",
]


# LlamaConfig fields that must be positive ints (n_kv_heads may also be None), and positive
# finite numbers (a zero norm_eps divides by zero on an all-zero row; a negative rope_theta
# gives NaN angles).
_INT_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
_POSITIVE_FLOAT_FIELDS = ("norm_eps", "rope_theta")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a LLaMA-2 model.

    ``n_kv_heads=None`` means plain multi-head attention (as many key/value heads as query
    heads); a smaller divisor of ``n_heads`` gives grouped-query attention.

    Checked at construction, each error one line naming the field: the sizes are positive ints
    (TypeError for a float such as ``1e3``, or a bool), ``norm_eps`` and ``rope_theta`` positive
    finite numbers (ValueError), ``dim`` divisible by ``n_heads`` into an even head_dim, and
    ``n_heads`` by ``n_kv_heads``.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    ffn_dim: int
    vocab_size: int = 8192
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        # Types and ranges first, field by field, so each error names its field (and a later
        # shape rule never divides by zero or builds a layer from a float).
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name == "n_kv_heads":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in _POSITIVE_FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} not divisible by n_kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used (``n_kv_heads`` or ``n_heads``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def layer_params(self) -> int:
        """Parameters of one TransformerBlock (attention, SwiGLU, two RMSNorm weights)."""
        kv_dim = self.kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        feed_forward = 3 * self.dim * self.ffn_dim
        return attention + feed_forward + 2 * self.dim

    def non_embedding_params(self) -> int:
        """All parameters except the token-embedding table (a lookup, which costs no FLOPs).

        The untied output head *is* counted: it is a real GEMM on every token.
        """
        return self.n_layers * self.layer_params() + self.dim + self.vocab_size * self.dim

    def num_params(self) -> int:
        """Exact parameter count of ``Llama(self)``, embeddings and head included."""
        return self.non_embedding_params() + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), the PaLM-style estimate used for MFU.

        ``6 * N + 12 * n_layers * dim * seq_len`` where N = ``non_embedding_params()``: each
        weight costs 2 FLOPs per token forward and 4 backward; the attention score and value
        products (QK^T and PV) add ``12 * n_layers * dim * seq_len``. The causal mask is not
        discounted, matching how PaLM and most MFU numbers are reported.
        """
        return 6 * self.non_embedding_params() + 12 * self.n_layers * self.dim * seq_len


# Preset names are nominal sizes, not the count at minifloat's default vocabulary. 125M, 350M,
# 1.3B, 7B and 13B are named for the parameter count (embedding + untied head included) at
# LLaMA's 32,000-token vocabulary, within +8 % / -4 %; 1.3B, 7B and 13B use that vocabulary by
# default. With minifloat's default BPE vocab of 8192 the small presets are smaller. 20M is named
# for its count at 8192. 50M fits neither vocabulary (-32 % at 8192, +17 % at 32000). Its shape
# stays as it is because the measured GPU results were taken with it.
#
#   preset   vocab 8192   vocab 32000        preset   vocab 8192   vocab 32000
#   tiny        2.90M        9.00M           350M       325.1M       373.9M
#   20M        20.5M        38.7M            1.3B      1.267B       1.364B  (default vocab)
#   50M        34.1M        58.5M            7B        6.543B       6.738B  (default vocab)
#   125M       97.5M       134.1M            13B      12.772B      13.016B  (default vocab)
#
# tests/test_llama.py checks every name except tiny and 50M to within 15 %.
PRESETS: dict[str, LlamaConfig] = {
    # CPU demo: ~2.9M parameters at vocab 8192 (2.1M of them in embedding + head).
    "tiny": LlamaConfig(dim=128, n_layers=4, n_heads=4, ffn_dim=352, max_seq_len=256),
    "20M": LlamaConfig(dim=384, n_layers=8, n_heads=6, ffn_dim=1024),
    "50M": LlamaConfig(dim=512, n_layers=8, n_heads=8, ffn_dim=1408),
    "125M": LlamaConfig(dim=768, n_layers=12, n_heads=12, ffn_dim=2048),
    "350M": LlamaConfig(dim=1024, n_layers=24, n_heads=16, ffn_dim=2816),
    # The FP4 paper's sizes, LLaMA-2 shapes and tokenizer size.
    "1.3B": LlamaConfig(
        dim=2048, n_layers=24, n_heads=16, ffn_dim=5632, vocab_size=32000, max_seq_len=4096
    ),
    "7B": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000, max_seq_len=4096
    ),
    "13B": LlamaConfig(
        dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, vocab_size=32000, max_seq_len=4096
    ),
}


def get_config(name: str, **overrides: object) -> LlamaConfig:
    """Return preset ``name`` with fields replaced by ``overrides`` (e.g. ``vocab_size=257``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    """Root-mean-square norm whose reduction always runs in fp32 (also under autocast)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with RoPE and optional grouped-query attention."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # Key/value head j serves query heads [j*rep, (j+1)*rep), as in Hugging Face.
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x), the SiLU and product in one float32 Function
    (models/swiglu.py: one sigmoid, which compiled quantized recipes recompute cheaply)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """LLaMA-2 decoder-only language model: ``forward(tokens [B, T]) -> logits [B, T, vocab]``.

    Constructed weights are only PyTorch's defaults; call ``init_weights(seed)`` for the
    deterministic LLaMA initialisation. Building under ``torch.device("meta")`` allocates
    nothing (for counting parameters or for FSDP); materialise with ``to_empty`` then
    ``init_weights``.
    """

    def __init__(self, config: LlamaConfig) -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(
                f"Llama takes a LlamaConfig (e.g. get_config('tiny')), got {type(config).__name__}"
            )
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Derived state, not part of the checkpoint; rebuilt whenever it no longer fits.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def _rope_tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.rope_cos
        stale = (
            cos.dim() != 2
            or cos.shape[0] < seq_len
            or cos.device != device
            or cos.dtype != torch.float32  # model.to(bf16) casts float buffers
        )
        if stale:
            length = max(seq_len, self.config.max_seq_len)
            self.rope_cos, self.rope_sin = rope_cos_sin(
                length, self.config.head_dim, self.config.rope_theta, device
            )
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(
                f"tokens must be [batch, seq] with at least one of each, got {tuple(tokens.shape)}"
            )
        cos, sin = self._rope_tables(tokens.shape[1], tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def num_params(self) -> int:
        """Parameters actually held by the module (equals ``config.num_params()``)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic LLaMA init: N(0, 0.02) weights, wo/w2 scaled by 1/sqrt(2*n_layers),
        norm weights 1.

        Every weight gets its own generator seeded from (seed, parameter name), so the result
        does not depend on module order and is identical for the same seed on the same device
        type. Works when linear layers are subclasses of nn.Linear (e.g. QuantLinear).
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for module_name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            # self.output: whatever stands in for the head too (train/head_loss.DeferredHead)
            elif isinstance(module, nn.Linear | nn.Embedding) or module is self.output:
                is_out_proj = module_name.endswith(("attention.wo", "feed_forward.w2"))
                _normal_(module.weight, out_std if is_out_proj else std, seed, module_name)
            # converted layers (minifloat.convert): the fp8-delayed history and the random
            # state at their start, not the memory `to_empty` left them (meta-device builds)
            if callable(getattr(module, "reset_buffers", None)):
                module.reset_buffers()
        self.reset_rope_tables()

    def reset_rope_tables(self) -> None:
        """Build the rope tables (fp32, `max_seq_len` rows) on the model's device.

        `init_weights` calls it; call it again after `model.to(dtype)`, which casts them. Built
        by the first forward instead, a table made inside a compiled forward changes the
        buffers' rank between the first call and the second, and the second recompiles.
        """
        device = self.output.weight.device
        # Always replaced, never kept: after to_empty they hold garbage of the right shape.
        if device.type == "meta":
            self.rope_cos, self.rope_sin = (torch.empty(0, device=device) for _ in range(2))
        else:
            c = self.config
            self.rope_cos, self.rope_sin = rope_cos_sin(
                c.max_seq_len, c.head_dim, c.rope_theta, device
            )


def _normal_(weight: torch.Tensor, std: float, seed: int, name: str) -> None:
    if weight.is_meta:
        raise RuntimeError("init_weights on meta tensors: call model.to_empty(device=...) first")
    sharded = hasattr(weight, "full_tensor")  # an FSDP2 / DTensor shard
    device = torch.device(weight.device_mesh.device_type) if sharded else weight.device
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if not sharded:
        weight.normal_(0.0, std, generator=generator)
        return
    # Draw the whole matrix on every rank, then keep this rank's shard: the values equal an
    # unsharded init with the same seed, whatever the mesh.
    from torch.distributed.tensor import distribute_tensor

    full = torch.empty(weight.shape, dtype=weight.dtype, device=device)
    full.normal_(0.0, std, generator=generator)
    weight.copy_(distribute_tensor(full, weight.device_mesh, weight.placements))
