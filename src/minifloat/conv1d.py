"""QuantConv1D: GPT-2's `Conv1D` layer (from `transformers`) with quantized GEMMs.

`transformers.pytorch_utils.Conv1D(nf, nx)` is a linear layer that stores its weight transposed:
`y = x·W + b` with W [nx, nf] = [in_features, out_features]. QuantConv1D keeps that parameter
as it is (the same Parameter object after `from_conv1d`, so an optimizer built before the swap
still updates it, and the state_dict keeps its key and [in, out] shape) and computes
`y = x·(Wᵀ)ᵀ + b` with `QuantLinearFunction`, the one autograd Function of `QuantLinear`, on a
contiguous [out, in] copy of Wᵀ made inside forward. The copy is what `nn.Linear` would hold, so
every backend and recipe sees exactly the operand a QuantLinear of the same layer sees; autograd
transposes the weight gradient back to W's layout. The cost is one weight-sized copy per call,
kept for backward.

minifloat never imports `transformers`: `convert` recognizes a Conv1D through the already imported
`transformers.pytorch_utils` module (a model holding one has imported it).
"""

from __future__ import annotations

import torch
from torch import nn

from minifloat.linear import QuantizedGemmMixin
from minifloat.recipes import QuantRecipe

__all__ = ["QuantConv1D"]


class QuantConv1D(QuantizedGemmMixin, nn.Module):
    """GPT-2's `Conv1D` (weight [nx, nf] = [in, out], bias [nf]) with quantized GEMMs.

    Args:
        nf, nx: output and input features, in `Conv1D`'s order.
        recipe: a quantized recipe or its name (e.g. "fp4", "fp8-tensorwise").
        backend: "auto" (by the input's device), "emulated" or "hopper".
    Parameters, state_dict keys and call signature are those of `Conv1D` (plus the fp8-delayed
    amax history, as in `QuantLinear`).
    """

    def __init__(
        self,
        nf: int,
        nx: int,
        *,
        recipe: str | QuantRecipe,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)  # Conv1D's own initialization
        self._setup(recipe, backend, device)

    @classmethod
    def from_conv1d(
        cls, conv: nn.Module, recipe: str | QuantRecipe, *, backend: str = "auto"
    ) -> QuantConv1D:
        """A QuantConv1D sharing `conv`'s parameter objects (optimizers stay valid).

        `conv` is a `transformers` Conv1D: attributes `nf`, `nx`, `weight` [nx, nf], `bias` [nf].
        """
        if not all(hasattr(conv, name) for name in ("nf", "nx", "weight", "bias")):
            raise TypeError(
                f"from_conv1d expects a transformers Conv1D (nf, nx, weight, bias), "
                f"got {type(conv).__name__}"
            )
        weight = conv.weight
        if weight.dim() != 2 or tuple(weight.shape) != (conv.nx, conv.nf):
            raise ValueError(
                f"expected a Conv1D weight of shape [nx, nf] = [{conv.nx}, {conv.nf}], "
                f"got {tuple(weight.shape)}"
            )
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.nf, new.nx = conv.nf, conv.nx
        new.weight = weight
        new.bias = conv.bias
        new._setup(recipe, backend, weight.device)
        new.train(conv.training)
        return new

    @property
    def in_features(self) -> int:
        return self.nx

    @property
    def out_features(self) -> int:
        return self.nf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if not self.recipe.quantized:  # set_recipe("bf16"): Conv1D's own computation
            y = torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight)
            return y.reshape(*x.shape[:-1], self.nf)
        weight_nk = self.weight.t().contiguous()  # [out, in], nn.Linear's layout
        return self._quantized_gemm(x, weight_nk, self.bias, self.nf)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, recipe={self.recipe.name}, backend={self.backend}"
