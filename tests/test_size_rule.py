"""SizeRule (size_rule.py) and convert(size_rule=...): which layers stay in high precision."""

from __future__ import annotations

import math

import pytest
from torch import nn

import minifloat
from minifloat import TORCHAO_ROWWISE, TORCHAO_TENSORWISE, SizeRule
from minifloat.linear import QuantLinear


def _torchao_tensorwise_keeps(in_features: int, out_features: int) -> bool:
    # torchao float8's `_auto_filter_for_tensorwise` (0.17, 0.18), written with its own names:
    # `N, K = mod.weight.shape` = (out_features, in_features); "if K <= 4096 and N <= 1024:
    # return False" (not converted)
    n, k = out_features, in_features
    return k <= 4096 and n <= 1024


def _torchao_rowwise_keeps(in_features: int, out_features: int) -> bool:
    n, k = out_features, in_features  # `_auto_filter_for_rowwise`, same names
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


DIMS = [768, 1024, 1536, 2048, 3072, 4096, 5504, 8192]
# (ours, torchao's rule restated, torchao's recipe name)
RULES = [
    (TORCHAO_TENSORWISE, _torchao_tensorwise_keeps, "tensorwise"),
    (TORCHAO_ROWWISE, _torchao_rowwise_keeps, "rowwise"),
]


@pytest.mark.parametrize(("rule", "reference", "name"), RULES, ids=["tensorwise", "rowwise"])
def test_torchao_rules_match_torchao(rule: SizeRule, reference, name: str) -> None:
    for k in DIMS:
        for n in DIMS:
            assert (rule.reason(k, n) is not None) == reference(k, n), (k, n)
    # not symmetric in (in, out): a rule read with the dims swapped (as these constants were
    # until session 46) fails here
    assert any(reference(k, n) != reference(n, k) for k in DIMS for n in DIMS)


@pytest.mark.parametrize(("rule", "reference", "name"), RULES, ids=["tensorwise", "rowwise"])
def test_torchao_rules_match_torchaos_own_filter(rule: SizeRule, reference, name: str) -> None:
    """Against torchao's filter itself, where torchao is installed (a dev dependency)."""
    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    converts = utils._auto_filter_for_recipe(name, [])
    for k in DIMS:
        for n in DIMS:
            linear = nn.Linear(k, n, device="meta")
            assert (rule.reason(k, n) is None) == converts(linear, "layer"), (k, n)


def test_bounds_are_inclusive_and_the_reason_names_them() -> None:
    rule = SizeRule(boxes=((1024, 4096),), source="test")
    assert rule.reason(1024, 4096) == (
        "too small for quantization to pay: in 1024 <= 1024 and out 4096 <= 4096 (size rule: test)"
    )
    assert rule.reason(1025, 16) is None and rule.reason(16, 4097) is None


@pytest.mark.parametrize(
    ("text", "boxes"),
    [
        ("1024:4096", ((1024, 4096),)),
        ("2048:*, *:1024", ((2048, math.inf), (math.inf, 1024))),
        ("0:0", ((0, 0),)),
    ],
)
def test_parse(text: str, boxes: tuple) -> None:
    rule = SizeRule.parse(text)
    assert rule.boxes == boxes and rule.source == f"--size-rule {text}"


@pytest.mark.parametrize("text", ["", "1024", "1024:", "a:b", "1:2:3", "-1:5", "1.5:2", "1:2,"])
def test_parse_refuses_malformed_text_in_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="size rule must be IN:OUT") as info:
        SizeRule.parse(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("boxes", [(), ((1, 2, 3),), ((-1, 5),), ((1.5, 2),), ((True, 2),)])
def test_bad_boxes_are_refused(boxes: tuple) -> None:
    with pytest.raises(ValueError, match="SizeRule"):
        SizeRule(boxes=boxes)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(64, 64)
        self.wide = nn.Linear(64, 256)
        self.deep = nn.Linear(256, 64)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp4"])
def test_convert_keeps_what_the_rule_names_and_reports_it(recipe: str) -> None:
    model = nn.Sequential(_Block(), _Block())
    seen: list[str] = []

    def spy(module: nn.Module, fqn: str) -> bool:  # called only for layers still converted
        seen.append(fqn)
        return True

    rule = SizeRule(boxes=((64, 64), (math.inf, 32)), source="test")
    _, report = minifloat.convert(model, recipe, size_rule=rule, module_filter_fn=spy,
                                  backend="emulated", return_report=True)  # fmt: skip
    expected = [f"{i}.{name}" for i in range(2) for name in ("wide", "deep")]
    assert report.converted == expected and seen == expected
    kept = dict(report.skipped)
    assert kept["0.small"].startswith("too small for quantization to pay: in 64 <= 64")
    assert type(model[1].small) is nn.Linear and isinstance(model[1].wide, QuantLinear)


def test_convert_refuses_a_size_rule_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="size_rule must be a minifloat.SizeRule"):
        minifloat.convert(nn.Sequential(nn.Linear(64, 64)), "fp8-tensorwise", size_rule="64:64")


@pytest.mark.parametrize("boxes", [(1024, 4096), "1024:4096", 1024, ((1, 2), 3)])
def test_a_single_box_or_text_for_boxes_is_refused_in_one_line(boxes) -> None:
    with pytest.raises(TypeError, match=r"boxes is a tuple of \(max_in, max_out\) pairs") as info:
        SizeRule(boxes=boxes)
    assert "\n" not in str(info.value) and "((1024, 4096),)" in str(info.value)


def test_boxes_as_a_list_stay_accepted() -> None:
    assert SizeRule(boxes=[(1, 2), [math.inf, 3]]).reason(1, 2) is not None


@pytest.mark.parametrize("value", [1024, None, (1024, 4096)])
def test_parse_refuses_what_is_not_text(value: object) -> None:
    with pytest.raises(TypeError, match="SizeRule.parse takes text 'IN:OUT"):
        SizeRule.parse(value)


def test_list_boxes_are_stored_as_tuples():
    """A list box made the frozen rule unhashable and unequal to the same rule in tuples."""
    rule = SizeRule(boxes=[[10, 20]])
    assert rule == SizeRule(boxes=((10, 20),)) and hash(rule) == hash(SizeRule(boxes=((10, 20),)))


@pytest.mark.parametrize("text", ["²:5", "٣:5"])
def test_parse_takes_ascii_digits_only(text: str) -> None:
    with pytest.raises(ValueError, match="size rule must be IN:OUT"):
        SizeRule.parse(text)
