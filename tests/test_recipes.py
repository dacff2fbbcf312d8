"""Recipe registry and the recipe dataclasses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minifloat import recipes
from minifloat.recipes import (
    DelayedScaling,
    DGEConfig,
    GemmSpec,
    OCCConfig,
    OperandSpec,
    QuantRecipe,
)

EXPECTED = [
    "fp32",
    "fp16",
    "bf16",
    "fp8-tensorwise",
    "fp8-rowwise",
    "fp8-blockwise",
    "fp8-delayed",
    "fp4",
    "fp4-direct",
    "fp4-dge",
    "fp4-occ",
    "fp4-w4a8",
    "fp4-w8a4",
    "nvfp4",
    "mxfp4",
]


def test_names_and_get():
    assert recipes.names() == EXPECTED
    for name in EXPECTED:
        r = recipes.get(name)
        assert r.name == name
        assert recipes.get(r) is r
        assert r.quantized == name.startswith(("fp8", "fp4", "nvfp4", "mxfp4"))


def test_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="fp8-rowwise") as err:
        recipes.get("fp3")
    assert "fp3" in str(err.value)
    with pytest.raises(TypeError, match=r"a recipe is a name or a Recipe, got list: \['fp4'\]"):
        recipes.get(["fp4"])


def test_register_duplicate_raises():
    with pytest.raises(ValueError, match="already registered"):
        recipes.register(recipes.get("fp4"))


@pytest.mark.parametrize("name", [n for n in EXPECTED if recipes.get(n).quantized])
def test_quantized_recipes_use_bf16_autocast(name):
    r = recipes.get(name)
    assert isinstance(r, QuantRecipe)
    assert r.autocast_dtype == torch.bfloat16 and not r.loss_scaling


def test_frozen_and_keyword_only():
    r = recipes.get("fp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        OperandSpec("e2m1", "row")  # type: ignore[misc]


def test_replace_makes_variants():
    base = recipes.get("fp4")
    k3 = dataclasses.replace(base, name="fp4-k3", dge=DGEConfig(k=3.0))
    assert k3.dge.k == 3.0 and base.dge.k == 5.0
    assert k3.fprop == base.fprop and k3.occ == base.occ
    no_comp = dataclasses.replace(base, occ=dataclasses.replace(base.occ, compensate=False))
    assert not no_comp.occ.compensate
    assert "no compensation" in no_comp.describe()["fprop"]


def test_fp4_matches_paper():
    r = recipes.get("fp4")
    # per-token x and per-channel w scales ("inv": the fp32 scales formed by multiplication)
    assert r.fprop.lhs == OperandSpec(fmt="e2m1", granularity="row", scale_format="inv")
    assert r.fprop.rhs == OperandSpec(fmt="e2m1", granularity="row", scale_format="inv")
    assert r.dgrad.lhs.fmt == "e5m2" and r.wgrad.lhs.fmt == "e5m2"
    assert r.dgrad.rhs.reuse and r.wgrad.rhs.reuse
    assert r.folds("dgrad") and r.folds("wgrad")
    assert r.dge == DGEConfig(k=5.0, cap=3.0)
    assert r.occ.alpha == 0.99 and r.occ.compensate
    direct = recipes.get("fp4-direct")
    assert direct.dge is None and direct.occ is None
    assert recipes.get("fp4-dge").occ is None and recipes.get("fp4-dge").dge is not None
    assert recipes.get("fp4-occ").dge is None and recipes.get("fp4-occ").occ is not None
    assert recipes.get("fp4-w4a8").fprop.lhs.fmt == "e4m3"
    assert recipes.get("fp4-w4a8").fprop.rhs.fmt == "e2m1"
    assert recipes.get("fp4-w8a4").fprop.rhs.fmt == "e4m3"


def test_describe_words():
    words = recipes.get("fp4").describe()
    assert set(words) == {"fprop", "dgrad", "wgrad"}
    assert words["fprop"].startswith("E2M1 (row) x E2M1 (row)")
    assert "OCC" in words["fprop"] and "DGE (k=5" in words["wgrad"]
    assert words["dgrad"].startswith("E5M2 (row, x w_scale) x E2M1 (fprop values)")
    assert recipes.get("fp8-blockwise").describe()["fprop"] == "E4M3 (1x128) x E4M3 (128x128)"
    assert "delayed" in recipes.get("fp8-delayed").describe()["wgrad"]
    assert recipes.get("bf16").describe() == {"fprop": "bf16", "dgrad": "bf16", "wgrad": "bf16"}


@pytest.mark.parametrize(
    ("name", "tagged"),
    [
        ("fp8-tensorwise", {"dgrad": "fast accum"}),
        ("fp4-dge", {"dgrad": "fast accum", "wgrad": "fast accum"}),
        ("fp8-rowwise", {"dgrad": "fast accum"}),
        ("fp4", {"dgrad": "fast accum"}),
        ("fp4-occ", {"dgrad": "fast accum"}),
        ("fp8-blockwise", {}),
        (
            "fp8-rowwise:fast_accum=off:dgrad_fast_accum=off:wgrad_fast_accum=on",
            {"fprop": "promoted accum", "wgrad": "fast accum"},
        ),
    ],
)
def test_describe_names_accumulation_that_departs_from_the_rule(name, tagged):
    """fprop fast and dgrad/wgrad promoted go unsaid; each departure is named."""
    words = recipes.get(name).describe()
    for gemm, text in words.items():
        tag = tagged.get(gemm)
        assert text.endswith(", " + tag) if tag else "accum" not in text, (gemm, text)


def test_fp8_specs():
    tw = recipes.get("fp8-tensorwise")
    assert tw.fprop.lhs.fmt == "e4m3" and tw.dgrad.lhs.fmt == "e5m2"
    assert tw.fprop.lhs.granularity == "tensor"
    rw = recipes.get("fp8-rowwise")
    for g in ("fprop", "dgrad", "wgrad"):
        spec = getattr(rw, g)
        assert spec.lhs.granularity == spec.rhs.granularity == "row"
        assert spec.lhs.fmt == spec.rhs.fmt == "e4m3" and not spec.rhs.reuse
    bw = recipes.get("fp8-blockwise")
    assert bw.fprop.rhs.granularity == (128, 128) and bw.wgrad.rhs.granularity == (1, 128)
    d = recipes.get("fp8-delayed")
    assert d.delayed == DelayedScaling(history_len=16, margin=0)
    longer = dataclasses.replace(d, delayed=DelayedScaling(history_len=1024, margin=1))
    assert longer.delayed.history_len == 1024


def test_validation():
    op = OperandSpec(fmt="e4m3", granularity="row")
    with pytest.raises(ValueError, match="granularity"):
        OperandSpec(fmt="e4m3", granularity="diagonal")
    with pytest.raises(ValueError, match="element format"):
        OperandSpec(fmt="e9m9")
    with pytest.raises(ValueError, match="fprop format"):
        QuantRecipe(
            name="bad",
            fprop=GemmSpec(lhs=op, rhs=op),
            dgrad=GemmSpec(lhs=op, rhs=OperandSpec(fmt="e2m1", reuse=True)),
            wgrad=GemmSpec(lhs=op, rhs=op),
        )
    with pytest.raises(ValueError, match="delayed"):
        dataclasses.replace(recipes.get("fp8-rowwise"), delayed=DelayedScaling())
    with pytest.raises(ValueError, match="alpha"):
        OCCConfig(alpha=0.3)
    with pytest.raises(ValueError):
        DGEConfig(k=0.0)


def test_unsuitable_dims():
    assert recipes.get("fp4").unsuitable(64, 32) is None
    # the reason names only the dims that do not fit
    assert recipes.get("fp4").unsuitable(60, 32) == (
        "in_features=60 is not a multiple of 16 (needed by recipe fp4)"
    )
    assert recipes.get("fp8-blockwise").unsuitable(256, 128) is None
    assert (
        recipes.get("fp8-blockwise")
        .unsuitable(256, 64)
        .startswith("out_features=64 is not a multiple of 128")
    )
    assert (
        recipes.get("fp8-blockwise")
        .unsuitable(100, 64)
        .startswith("in_features=100 and out_features=64 are not multiples of 128")
    )


def test_occ_defaults_and_sample_size():
    cfg = OCCConfig()
    assert (cfg.threshold, cfg.compensation_format, cfg.sample_size) == ("sampled", "e4m3", 65536)
    assert recipes.get("fp4:occ.sample_size=4096").occ.sample_size == 4096
    for bad in (100, 1.5e4):
        with pytest.raises(ValueError, match="sample_size must be an integer >= 1024"):
            OCCConfig(sample_size=bad)
    with pytest.raises(ValueError, match="non-negative integer"):
        recipes.get("fp4:occ.sample_size=1e5")


# ---- bad input: one-line errors at construction --------------------------------------------


def _one_line(error: type[Exception], match: str, make) -> None:
    with pytest.raises(error, match=match) as info:
        make()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # the string form refuses inf ("fp4:dge.k=inf"); k = inf zeroed every weight gradient
        (dict(k=float("inf")), ValueError, "dge.k must be a finite number, got inf"),
        (dict(k=float("nan")), ValueError, "dge.k must be a finite number, got nan"),
        (dict(cap=float("inf")), ValueError, "dge.cap must be a finite number, got inf"),
        (dict(k="3"), TypeError, "dge.k must be a finite number, got str: '3'"),
        (dict(cap=None), TypeError, "dge.cap must be a finite number, got NoneType"),
        (dict(k=True), TypeError, "dge.k must be a finite number, got bool"),
    ],
)
def test_dge_config_needs_finite_numbers(kwargs, error, match):
    _one_line(error, match, lambda: DGEConfig(**kwargs))


@pytest.mark.parametrize(
    ("alpha", "error", "match"),
    [
        ("0.9", TypeError, "occ.alpha must be a finite number, got str"),
        (True, TypeError, "occ.alpha must be a finite number, got bool"),
        (float("nan"), ValueError, "occ.alpha must be a finite number, got nan"),
    ],
)
def test_occ_alpha_must_be_a_finite_number(alpha, error, match):
    _one_line(error, match, lambda: OCCConfig(alpha=alpha))


def test_numeric_fields_keep_accepting_ints_and_numpy_floats():
    np = pytest.importorskip("numpy")
    assert DGEConfig(k=3) == DGEConfig(k=3.0) and DGEConfig(k=np.float64(3.0)).k == 3.0
    assert OCCConfig(alpha=np.float32(0.75)).alpha == 0.75


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(history_len=2.5), TypeError, "delayed history_len must be an int, got float"),
        (dict(history_len=True), TypeError, "delayed history_len must be an int, got bool"),
        (dict(margin=1.0), TypeError, "delayed margin must be an int, got float"),
        (dict(margin="1"), TypeError, "delayed margin must be an int, got str"),
        (dict(history_len=0), ValueError, r"history_len >= 1 and margin in \[0, 127\]"),
        (dict(margin=-1), ValueError, r"margin in \[0, 127\]"),
        # 2**128 overflows float32: every delayed scale inf, every output NaN
        (dict(margin=128), ValueError, r"margin in \[0, 127\] \(2\*\*margin finite in float32\)"),
        (dict(margin=200), ValueError, r"got history_len=16, margin=200"),
    ],
)
def test_delayed_scaling_refuses_bad_fields(kwargs, error, match):
    _one_line(error, match, lambda: DelayedScaling(**kwargs))


def test_delayed_scaling_bounds_are_accepted():
    assert DelayedScaling(history_len=1, margin=127).margin == 127
    assert torch.isfinite(torch.tensor(2.0**127, dtype=torch.float32))


def test_recipe_refuses_an_autocast_dtype_it_cannot_run():
    match = r"autocast_dtype must be None \(fp32\), torch.bfloat16 or torch.float16, got torch.int8"
    _one_line(ValueError, match, lambda: recipes.Recipe(name="x", autocast_dtype=torch.int8))
    # and through a quantized recipe, which runs Recipe's check too
    fp4 = recipes.get("fp4")
    f32 = lambda: dataclasses.replace(fp4, autocast_dtype=torch.float32)  # noqa: E731
    _one_line(ValueError, "autocast_dtype must be", f32)
    assert recipes.Recipe(name="x", autocast_dtype=None).describe()["fprop"] == "fp32"


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, "min_multiple must be a positive int, got 0"),  # was ZeroDivisionError
        (-16, ValueError, "min_multiple must be a positive int, got -16"),
        (16.0, TypeError, "min_multiple must be a positive int, got float"),
        (True, TypeError, "min_multiple must be a positive int, got bool"),
    ],
)
def test_min_multiple_must_be_a_positive_int(value, error, match):
    _one_line(error, match, lambda: dataclasses.replace(recipes.get("fp4"), min_multiple=value))


def test_register_takes_a_recipe():
    _one_line(TypeError, "register takes a Recipe .*, got str: 'myrecipe'",
              lambda: recipes.register("myrecipe"))  # fmt: skip
    assert "myrecipe" not in recipes.names()


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        # the strings "no"/"off" are truthy: accepted before, they ran the "on" behaviour
        (lambda: recipes.OCCConfig(compensate="no"), TypeError,
         "occ.compensate must be True or False, got str: 'no'"),
        (lambda: recipes.OCCConfig(one_gemm="off"), TypeError,
         "occ.one_gemm must be True or False"),
        (lambda: recipes.OperandSpec(fmt="e4m3", reuse="no"), TypeError,
         "reuse must be True or False"),
        (lambda: dataclasses.replace(recipes.get("fp4"), fprop_fast_accum="no"), TypeError,
         "fprop_fast_accum must be True or False"),
        (lambda: dataclasses.replace(recipes.get("fp4"), wgrad_fast_accum=1), TypeError,
         "wgrad_fast_accum must be True or False, got int"),
        (lambda: recipes.Recipe(name="x", loss_scaling="yes"), TypeError,
         "recipe 'x': loss_scaling must be True or False"),
        # wrong config types failed at the first forward or backward, deep in the layer
        (lambda: dataclasses.replace(recipes.get("fp4"), dge=3.0), TypeError,
         "dge must be a DGEConfig or None, got float: 3.0"),
        (lambda: dataclasses.replace(recipes.get("fp4"), occ=True), TypeError,
         "occ must be an OCCConfig or None, got bool"),
        (lambda: dataclasses.replace(recipes.get("fp8-tensorwise"), delayed=16), TypeError,
         "delayed must be a DelayedScaling or None"),
        (lambda: dataclasses.replace(recipes.get("fp4"), fprop="e2m1"), TypeError,
         "fprop must be a GemmSpec, got str"),
        (lambda: recipes.GemmSpec(lhs="e4m3", rhs=recipes.OperandSpec(fmt="e4m3")), TypeError,
         "lhs must be an OperandSpec, got str"),
        (lambda: dataclasses.replace(recipes.get("fp4"), keep_last_blocks=1.5), TypeError,
         "keep_last_blocks must be an int, got float"),
        (lambda: dataclasses.replace(recipes.get("fp4"), keep_last_blocks=None), TypeError,
         "keep_last_blocks must be an int, got NoneType"),
        (lambda: dataclasses.replace(recipes.get("fp4"), keep_last_blocks=-1), ValueError,
         "keep_last_blocks must be >= 0, got -1"),
        (lambda: recipes.Recipe(name=5), TypeError, "recipe name must be a str, got int"),
    ],
)  # fmt: skip
def test_fields_of_the_wrong_type_are_refused(build, error, match):
    _one_line(error, match, build)


def test_operand_formats_are_stored_by_their_canonical_names():
    """The kernels compare `fmt == "e2m1"` and `scale_format == "inv"`: an upper-case name that
    validates must not take other paths."""
    spec = recipes.OperandSpec(fmt="E2M1", granularity="row", scale_format="INV")
    assert (spec.fmt, spec.scale_format) == ("e2m1", "inv")
    assert spec == recipes.OperandSpec(fmt="e2m1", granularity="row", scale_format="inv")
    from minifloat import formats

    assert recipes.OperandSpec(fmt=formats.get("e4m3")).fmt == "e4m3"


@pytest.mark.parametrize("name", ["fp4:dge=on", "a,b", "fp4+switch", "a/b", "my recipe", ""])
def test_register_refuses_names_that_cannot_be_looked_up(name):
    recipe = dataclasses.replace(recipes.get("fp4"), name=name)
    _one_line(ValueError, "a recipe name is letters, digits", lambda: recipes.register(recipe))
    assert name not in recipes.names()
