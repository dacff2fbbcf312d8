"""Per-layer quantization fidelity: the SQNR of every quantized operand of every quantized layer.

When a quantized run falls behind bf16, the question is which layers and which operands lose the
signal. `measure_layer_sqnr` runs one forward and backward pass of the loss on a probe batch and
measures, for each `QuantLinear` and `QuantConv1D` (GPT-2's layout, its weight read as
the [out, in] operand the layer multiplies), the SQNR in dB (`minifloat.sqnr.sqnr_db`) of:

- ``input``: x against what the fprop GEMM effectively multiplies, Q(x_c) plus, with OCC
  compensation, the clipped remainder Δx (the paper's activation-fidelity measure; the
  compensation term is multiplied by the unquantized weight);
- ``weight``: the master weight against Q(w);
- ``grad_output``: dy against dgrad's operand, dequantized (with the FP4 fold, Q(dy·diag(s_w))
  divided by s_w again);
- ``grad_output_t``: dy against wgrad's operand (quantized along the tokens; with the fold,
  Q((diag(s_x)·dy)ᵀ)ᵀ divided by s_x; with a random Hadamard transform R, rotated back:
  Q(dyᵀR)Rᵀ, whose error has the norm of the rotated operand's, R being orthogonal);
- ``output``: y against a float32 ``F.linear`` of the unquantized x, w and bias.

Everything is observed from outside: a forward hook sees x and y, a tensor hook on y sees dy, and
the quantizers are the reference backend's (bit-identical to the Hopper kernels), fed with the same
OCC thresholds, delayed scales and random draws (stochastic rounding, Hadamard signs) the layer
uses. The backward is ``torch.autograd.grad`` with respect to the parameters, so no ``.grad`` is
touched; RNG states, fp8-delayed amax histories and the layers' counter-based random states are
restored afterwards, so measuring does not change a training run (tested). A layer called
more than once per forward is measured at its first call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minifloat import counter_rng, delayed, hadamard, occ
from minifloat.amp import autocast_context, full_precision
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.linear import QuantizedGemmMixin, QuantLinear
from minifloat.recipes import QuantRecipe, Recipe
from minifloat.sqnr import sqnr_db

__all__ = ["OPERANDS", "layer_sqnr_record", "measure_layer_sqnr", "probe_batch", "summarize"]

OPERANDS = ("input", "weight", "grad_output", "grad_output_t", "output")
LayerSQNR = dict[str, dict[str, float | None]]
_BACKEND = EmulatedBackend()


def _db(ref: torch.Tensor, out: torch.Tensor) -> float | None:
    """SQNR rounded to 0.001 dB; None where it is undefined (a zero reference, non-finite
    values) or infinite (exact)."""
    try:
        value = sqnr_db(ref, out) if ref.double().norm().item() > 0 else math.nan
    except ValueError:  # log10(0): non-finite noise
        value = math.nan
    return round(value, 3) if math.isfinite(value) else None


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _LayerProbe:
    """Hooks of one quantized layer: forward-side SQNRs at its first call, gradient-side ones in a
    tensor hook on its output. Keeps only the row scales the backward folds need."""

    def __init__(self, layer: QuantizedGemmMixin, history: torch.Tensor | None) -> None:
        self.layer, self.recipe = layer, layer.recipe
        self.history = history  # amax history before the probe's forward (fp8-delayed)
        self.result: dict[str, float | None] = {}
        self.x_scale: torch.Tensor | None = None
        self.w_scale: torch.Tensor | None = None
        self.seeds: torch.Tensor | None = None  # the layer's draws of this step (dgrad, wgrad)
        self.called = False

    def _delayed(self, row: int, t: torch.Tensor, fmt: str) -> torch.Tensor | None:
        if self.recipe.delayed is None or self.history is None:
            return None
        return delayed.history_scale(self.history, row, delayed.amax(t), fmt, self.recipe.delayed)

    def forward_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.called or not args:  # measured at the first positional call only
            return
        self.called = True
        r: QuantRecipe = self.recipe
        x, w, b = args[0].detach(), module.weight.detach(), module.bias
        if not isinstance(module, QuantLinear):  # GPT-2's Conv1D keeps [in, out]
            w = w.t().contiguous()
        with torch.no_grad(), full_precision(x.device):
            x2 = x.reshape(-1, x.shape[-1])
            clip = occ.thresholds(x2, r.occ) if r.occ is not None else None
            s_x = self._delayed(delayed.INPUT, x2, r.fprop.lhs.fmt)
            x_q = _BACKEND.quantize(x2, r.fprop.lhs, clip=clip, scale=s_x)
            x_eff = x_q.dequantize()
            if clip is not None and r.occ.compensate:
                xf = x2.float()
                x_eff = x_eff + torch.where(xf.isfinite(), xf - occ.clamp(xf, *clip), 0.0)
            w_q = _BACKEND.quantize(
                w, r.fprop.rhs, scale=self._delayed(delayed.WEIGHT, w, r.fprop.rhs.fmt)
            )
            ref = F.linear(x.float(), w.float(), None if b is None else b.detach().float())
            self.result = {
                "input": _db(x2, x_eff),
                "weight": _db(w, w_q.dequantize()),
                "output": _db(ref, output.detach()),
            }
            self.x_scale, self.w_scale = x_q.scale, w_q.scale
            if module.rng_state is not None:
                rank = counter_rng.process_rank()  # the layer's own draws on this rank
                self.seeds = counter_rng.layer_seeds(module.rng_state, rank)
        if output.requires_grad:
            output.register_hook(self.grad_hook)

    def grad_hook(self, dy: torch.Tensor) -> None:
        r: QuantRecipe = self.recipe
        with torch.no_grad():
            dy2 = dy.detach().reshape(-1, dy.shape[-1])
            s_g = self._delayed(delayed.GRAD_OUTPUT, dy2, r.dgrad.lhs.fmt)
            seeds = [None, None] if self.seeds is None else self.seeds
            fold_w = self.w_scale.t() if r.folds("dgrad") else None
            g_q = _BACKEND.quantize(dy2, r.dgrad.lhs, prescale=fold_w, scale=s_g, seed=seeds[0])
            g_eff = g_q.dequantize() if fold_w is None else g_q.dequantize() / fold_w
            fold_x = self.x_scale if r.folds("wgrad") else None
            h_q = _BACKEND.quantize(
                dy2, r.wgrad.lhs, prescale=fold_x, transpose=True, scale=s_g, seed=seeds[1]
            )
            h_eff = _unrotated(h_q.dequantize(), r.wgrad.lhs.hadamard, seeds[1], dy2.shape[0]).t()
            h_eff = h_eff if fold_x is None else h_eff / fold_x
            self.result["grad_output"] = _db(dy2, g_eff)
            self.result["grad_output_t"] = _db(dy2, h_eff)


def _unrotated(q: torch.Tensor, size: int, seed: torch.Tensor | None, length: int) -> torch.Tensor:
    """A wgrad operand [rows, M'] rotated back along M (its first `length` columns)."""
    if not size:
        return q
    seed = torch.zeros((), dtype=torch.int64, device=q.device) if seed is None else seed
    signs = counter_rng.random_signs(counter_rng.derive(seed, "signs"), size, q.device)
    return hadamard.rotate(q, signs, dim=1, inverse=True)[:, :length]


def measure_layer_sqnr(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    recipe: Recipe,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> LayerSQNR:
    """SQNR (dB) of each quantized operand of every QuantLinear and QuantConv1D of `model`,
    on one batch.

    Args:
        model: the (unwrapped) model; left exactly as it was (parameters, .grad, buffers, RNG).
        inputs, targets: one batch on the model's device (token ids for the LM default loss).
        recipe: the run's recipe, for the autocast region of the forward pass.
        loss_fn: loss of (model output, targets); default: next-token cross entropy in fp32.
    Returns:
        {layer name: {operand: dB or None}} with the operands of `OPERANDS`; empty when the model
        holds no quantized layer with a quantized recipe. Gradient operands are missing for layers
        no gradient reaches.
    """
    if torch.is_inference_mode_enabled():  # an 18-frame error from the backward otherwise
        raise RuntimeError(
            "measure_layer_sqnr runs a backward pass: call it outside torch.inference_mode()"
        )
    # A layer switched to an autocast-only recipe (convert.set_recipe) quantizes nothing.
    layers = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, QuantizedGemmMixin) and m.recipe.quantized
    ]
    if not layers:
        return {}
    loss_fn = loss_fn or _lm_loss
    device = inputs.device
    snapshots = {n: None if m.amax_history is None else m.amax_history.clone() for n, m in layers}
    rng_states = {n: None if m.rng_state is None else m.rng_state.clone() for n, m in layers}
    probes = {n: _LayerProbe(m, snapshots[n]) for n, m in layers}
    handles = [m.register_forward_hook(probes[n].forward_hook) for n, m in layers]
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        rng_devices = [device] if device.type == "cuda" else []
        # Eager even where the model's blocks are compiled in place (train --compile-scope
        # block): the hooks must see every layer's tensors.
        eager = torch.compiler.set_stance("force_eager")
        with torch.random.fork_rng(devices=rng_devices), torch.enable_grad(), eager:
            with autocast_context(recipe, device):
                out = model(inputs)
            with full_precision(device):
                loss = loss_fn(out, targets)
            if params and loss.requires_grad:
                torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, layer in layers:
                if snapshots[name] is not None:
                    layer.amax_history.copy_(snapshots[name])
                if rng_states[name] is not None:
                    layer.rng_state.copy_(rng_states[name])
    return {name: probes[name].result for name, _ in layers if probes[name].called}


def probe_batch(
    tokens: Any, batch_size: int, seq_len: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first sequential batch of `tokens` (e.g. the validation split): a fixed probe, so
    measurements compare across steps and recipes."""
    from minifloat.data import BatchIterator

    inputs, targets = BatchIterator(tokens, batch_size, seq_len, mode="sequential").next()
    return inputs.to(device), targets.to(device)


def layer_sqnr_record(
    model: nn.Module,
    tokens: Any,
    batch_size: int,
    seq_len: int,
    device: torch.device | str,
    *,
    step: int,
    recipe: Recipe,
) -> dict[str, Any] | None:
    """The metrics.jsonl record ``{"step": step, "layer_sqnr": {...}}`` measured on the probe
    batch of `tokens`; None when the model has no quantized layer (nothing to measure)."""
    inputs, targets = probe_batch(tokens, batch_size, seq_len, device)
    layers = measure_layer_sqnr(model, inputs, targets, recipe=recipe)
    return {"step": step, "layer_sqnr": layers} if layers else None


def summarize(layers: LayerSQNR) -> dict[str, dict[str, Any]]:
    """Per operand: mean and minimum SQNR over the layers, and the worst layer's name."""
    summary: dict[str, dict[str, Any]] = {}
    for operand in OPERANDS:
        values = {n: v[operand] for n, v in layers.items() if v.get(operand) is not None}
        if not values:
            continue
        worst = min(values, key=values.get)
        summary[operand] = {
            "mean_db": round(sum(values.values()) / len(values), 3),
            "min_db": values[worst],
            "worst_layer": worst,
        }
    return summary
