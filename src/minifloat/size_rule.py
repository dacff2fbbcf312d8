"""SizeRule: keep the linear layers too small for quantization to pay in high precision.

A quantized layer pays for its quantization passes (reading the input, weight and gradient and
writing their low-precision copies) with faster GEMMs. The passes scale with M·(K + N) and the
GEMM saving with M·K·N, so below some K and N the layer is slower quantized than in bf16: at
125M (every projection 768 x 768 to 768 x 2048) with every projection quantized, fp8-rowwise and
the fp4 recipes train at 0.67-0.88x bf16 on an H200, and at 0.90-1.00x with the rule 1024:4096
(only the FFN down-projections quantized); fp8-tensorwise's casts are cheap enough that it runs
at 1.01x without a rule and 0.99x with that one (session 46, docs/hopper_sessions.md).
torchao float8 keeps such layers in bf16 by fixed rules measured on an H100; `SizeRule` has the
same form, a union of boxes in (in_features, out_features), with the bounds as data, so bounds
measured end to end (`benchmarks/train_e2e.py` rows RECIPE@IN:OUT) can replace them.

`convert(model, recipe, size_rule=...)` applies a rule and reports each kept layer with the
reason; the trainer takes `--size-rule IN:OUT[,IN:OUT...]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SizeRule", "TORCHAO_ROWWISE", "TORCHAO_TENSORWISE"]

Box = tuple[float, float]  # (max in_features, max out_features); math.inf: no bound


@dataclass(frozen=True, kw_only=True)
class SizeRule:
    """Keep a linear layer in high precision when its (in_features, out_features) lies in one
    of `boxes`, i.e. in_features <= max_in and out_features <= max_out for some box.

    Attributes:
        boxes: (max_in, max_out) pairs; math.inf leaves a dimension unbounded.
        source: where the bounds come from (a results file, a peer's rule), for the report.
    """

    boxes: tuple[Box, ...]
    source: str = "user"

    def __post_init__(self) -> None:
        # A single box or text, e.g. boxes=(1024, 4096), would fail below on len() of an int.
        if not isinstance(self.boxes, (tuple, list)) or not all(
            isinstance(box, (tuple, list)) for box in self.boxes
        ):
            raise TypeError(
                f"SizeRule boxes is a tuple of (max_in, max_out) pairs, e.g. ((1024, 4096),) "
                f"(SizeRule.parse reads text), got {self.boxes!r}"
            )
        if not self.boxes:
            raise ValueError("SizeRule needs at least one (max_in, max_out) box")
        # lists as tuples: a list box made the frozen rule unhashable and unequal to its tuple form
        object.__setattr__(self, "boxes", tuple(tuple(box) for box in self.boxes))
        for box in self.boxes:
            if len(box) != 2 or any(_bad_bound(v) for v in box):
                raise ValueError(
                    f"SizeRule box must be (max_in, max_out) of integers >= 0 or math.inf, "
                    f"got {box!r}"
                )

    def reason(self, in_features: int, out_features: int) -> str | None:
        """Why a layer of these dims stays in high precision, or None to convert it."""
        for max_in, max_out in self.boxes:
            if in_features <= max_in and out_features <= max_out:
                return (
                    f"too small for quantization to pay: in {in_features} <= {_fmt(max_in)} "
                    f"and out {out_features} <= {_fmt(max_out)} (size rule: {self.source})"
                )
        return None

    @classmethod
    def parse(cls, text: str) -> SizeRule:
        """'IN:OUT[,IN:OUT...]', '*' for no bound (e.g. '4096:1024' or '2048:*,*:1024')."""
        if not isinstance(text, str):
            raise TypeError(
                f"SizeRule.parse takes text 'IN:OUT[,IN:OUT...]', got {type(text).__name__}: "
                f"{text!r} (or build SizeRule(boxes=((IN, OUT),)))"
            )
        boxes = []
        for part in text.split(","):
            bounds = part.strip().split(":")
            # isascii: str.isdigit also takes "²" and "٣", which int() refuses or reads as 3
            digits = all(b == "*" or (b.isascii() and b.isdigit()) for b in bounds)
            if len(bounds) != 2 or not digits:
                raise ValueError(
                    f"size rule must be IN:OUT[,IN:OUT...] with integers or '*', e.g. "
                    f"4096:1024, got {text!r}"
                )
            boxes.append(tuple(math.inf if b == "*" else int(b) for b in bounds))
        return cls(boxes=tuple(boxes), source=f"--size-rule {text}")


def _bad_bound(value: object) -> bool:
    if value == math.inf:
        return False
    return isinstance(value, bool) or not isinstance(value, int) or value < 0


def _fmt(bound: float) -> str:
    return "inf" if bound == math.inf else str(bound)


# torchao float8's rules (torchao/float8/float8_linear_utils.py, `_auto_filter_for_recipe`,
# benchmarked on an H100; the same in torchao 0.17 and 0.18). They read `N, K = weight.shape`,
# i.e. N = out_features and K = in_features, the GEMM's (M, K) x (K, N) names.
# tensorwise: keep when in <= 4096 and out <= 1024 ("K <= 4096 and N <= 1024").
TORCHAO_TENSORWISE = SizeRule(boxes=((4096, 1024),), source="torchao float8 tensorwise (H100)")
# rowwise: keep when out <= 2048, or in <= 1024, or (in <= 2048 and out <= 4096)
# ("N <= 2048", "K <= 1024", "N <= 4096 and K <= 2048").
TORCHAO_ROWWISE = SizeRule(
    boxes=((math.inf, 2048), (1024, math.inf), (2048, 4096)),
    source="torchao float8 rowwise (H100)",
)
# Until session 46 both constants held these rules transposed (in and out swapped): every
# `RECIPE@torchao` benchmark row before then measured `1024:4096` (at 125M: only the FFN
# down-projections quantized), not torchao's rule (docs/hopper_sessions.md, session 46).
