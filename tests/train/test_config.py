"""Tests for minifloat.train.config: settings, their types, model overrides, fingerprints."""

from __future__ import annotations

import pytest

from minifloat.train.config import ConfigError, TrainConfig, check_model_overrides
from minifloat.train.stability import StepGuardConfig


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"steps": "abc"}, "steps must be an integer, got 'abc'"),
        ({"steps": 2.5}, "steps must be an integer, got 2.5"),
        ({"steps": True}, "steps must be an integer, got True"),
        ({"batch-size": "8"}, "batch-size must be an integer, got '8'"),
        ({"lr": "fast"}, "lr must be a number, got 'fast'"),
        ({"compile": "yes"}, "compile must be true or false, got 'yes'"),
        ({"recipe": 4}, "recipe must be a string, got 4"),
        ({"betas": [0.9]}, "betas must be a list of 2 numbers, got [0.9]"),
        ({"betas": [0.9, "x"]}, "betas must be a list of 2 numbers"),
        ({"model_overrides": 3}, "model-overrides must be a table of KEY = VALUE, got 3"),
        ({"cache_dir": 1}, "cache-dir must be a string, got 1"),
    ],
)
@pytest.mark.parametrize("source", ["toml", "python"])
def test_wrong_types_name_the_setting_and_type(values: dict, message: str, source: str) -> None:
    """The same one-line error from a TOML table and from TrainConfig(...) in Python (where
    steps=2.5 used to run without its checkpoint and steps="3" to fail with a TypeError)."""
    with pytest.raises(ConfigError) as info:
        if source == "toml":
            TrainConfig.from_dict(values)
        else:
            TrainConfig(**{k.replace("-", "_"): v for k, v in values.items()})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_python_values_are_converted_to_the_field_types(tmp_path) -> None:
    config = TrainConfig(steps=3.0, lr=1, betas=[0.9, 0.99], out_dir=tmp_path, ckpt_at=[1, 0.5])
    assert config.steps == 3 and type(config.steps) is int
    assert config.lr == 1.0 and type(config.lr) is float
    assert config.betas == (0.9, 0.99) and config.ckpt_at == (1.0, 0.5)
    assert config.out_dir == str(tmp_path)  # a pathlib.Path is taken as its string


def test_values_are_converted_to_the_field_types() -> None:
    # TOML writes 2e9 as a float and lr = 1 as an int.
    config = TrainConfig.from_dict({"tokens": 2e9, "lr": 1, "betas": [0.9, 0.99], "seed": 7.0})
    assert config.tokens == 2_000_000_000 and type(config.tokens) is int
    assert config.lr == 1.0 and type(config.lr) is float
    assert config.betas == (0.9, 0.99) and config.seed == 7 and type(config.seed) is int


def test_model_override_keys_may_use_dashes() -> None:
    config = TrainConfig.from_dict({"model-overrides": {"ffn-dim": 64, "n_layers": 1}})
    assert config.model_overrides == {"ffn_dim": 64, "n_layers": 1}


def test_stored_config_round_trips() -> None:
    # A resume rebuilds the run's settings from a checkpoint's to_dict() through from_dict().
    config = TrainConfig(
        recipe="fp4", model_overrides={"dim": 32}, steps=9, seed=4, grad_norm_spike_k=3.0
    ).resolved()
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"foo": 1}, "unknown model override 'foo'; valid keys: dim, n_layers"),
        ({"dim": "abc"}, "model override dim must be an integer, got 'abc'"),
        ({"norm_eps": "tiny"}, "model override norm_eps must be a number"),
        ({"dim": 30}, "model 'tiny' does not accept these overrides: dim=30 is not divisible"),
        ({"n_layers": 0}, "n_layers must be positive"),
    ],
)
def test_bad_model_overrides_raise_config_error(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_model_overrides("tiny", overrides)
    assert message in str(info.value)


def test_good_model_overrides_pass() -> None:
    check_model_overrides("tiny", {"dim": 64, "n_kv_heads": 2, "rope_theta": 5000, "n_heads": 4})


def test_loss_chunk_enters_the_fingerprint_only_when_on() -> None:
    # the chunked head's loss differs from the whole head's in the last bits: a trajectory
    # setting when on; off, checkpoints from before the setting still resume
    assert "loss_chunk" not in TrainConfig().trajectory_fields(1)
    assert TrainConfig(loss_chunk=4096).trajectory_fields(1)["loss_chunk"] == 4096


def test_grad_norm_spike_k_default_and_fingerprint() -> None:
    assert TrainConfig().grad_norm_spike_k == StepGuardConfig().grad_norm_spike_k == 0.0
    # Off, it stays out of the fingerprint: checkpoints from before the setting still resume.
    assert "grad_norm_spike_k" not in TrainConfig().trajectory_fields(1)
    assert TrainConfig(grad_norm_spike_k=4.0).trajectory_fields(1)["grad_norm_spike_k"] == 4.0
    with pytest.raises(ConfigError, match="grad-norm-spike-k must be >= 0"):
        TrainConfig(grad_norm_spike_k=-1.0)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # Each of these was accepted and trained into NaN weights (issue 14).
        ({"lr": INF}, "lr must be positive and finite, got inf"),
        ({"weight_decay": NAN}, "weight-decay must be >= 0 and finite, got nan"),
        ({"grad_clip": NAN}, "grad-clip must be >= 0 and finite (0: off), got nan"),
        ({"z_loss": NAN}, "z-loss must be >= 0 and finite (0: off), got nan"),
        ({"z_loss": INF}, "z-loss must be >= 0 and finite"),
        ({"eps": 0.0}, "eps must be positive and finite, got 0.0"),
        ({"eps": NAN}, "eps must be positive and finite"),
        ({"spike_k": NAN}, "spike-k must be >= 0 and finite (0: off), got nan"),
        ({"spike_k": INF}, "spike-k must be >= 0 and finite"),
        ({"grad_norm_spike_k": INF}, "grad-norm-spike-k must be >= 0 and finite"),
        ({"grad_clip": INF}, "grad-clip must be >= 0 and finite (0: off)"),
        ({"min_lr_ratio": NAN}, "min-lr-ratio must be in [0, 1] and finite"),
        ({"embed_grad_shrink": NAN}, "embed-grad-shrink must be in (0, 1] and finite"),
        ({"betas": (NAN, 0.95)}, "betas must be two numbers in [0, 1)"),
        ({"lr": 20.0}, "lr x weight-decay must be below 1"),
        ({"keep_checkpoints": 0}, "keep-checkpoints must be at least 1, got 0"),
        ({"max_skip_fraction": 1.5}, "max-skip-fraction must be in [0, 1] and finite, got 1.5"),
        ({"max_skip_fraction": NAN}, "max-skip-fraction must be in [0, 1] and finite"),
        ({"resume": True, "overwrite": True}, "either resume or overwrite"),
        ({"loss_chunk": -1}, "loss-chunk must be >= 0"),
    ],
)
def test_non_finite_and_out_of_range_values_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**changes)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_same_rules_hold_for_toml_values() -> None:
    # TOML has nan and inf literals: they reach TrainConfig through from_dict.
    with pytest.raises(ConfigError, match="lr must be positive and finite, got inf"):
        TrainConfig.from_dict({"lr": INF})


def test_model_overrides_take_their_field_types() -> None:
    """`dim=1e3` (a flag or TOML value) is the integer 1000, as TOML's `tokens = 2e9` is; it
    reached the model as a float and failed deep inside torch (TypeError)."""
    config = TrainConfig(model_overrides={"dim": 1e3, "n_layers": 2.0, "norm_eps": 1})
    assert config.model_overrides == {"dim": 1000, "n_layers": 2, "norm_eps": 1.0}
    assert [type(v) for v in config.model_overrides.values()] == [int, int, float]
    check_model_overrides("tiny", config.model_overrides)


def test_zero_heads_is_a_config_error() -> None:
    # It divided by zero inside the model's shape rules (ZeroDivisionError).
    with pytest.raises(ConfigError, match="model 'tiny' does not accept these overrides"):
        check_model_overrides("tiny", {"n_heads": 0})


def test_run_management_settings_stay_out_of_the_fingerprint() -> None:
    base = TrainConfig().trajectory_fields(1)
    changed = TrainConfig(keep_checkpoints=5, overwrite=True, max_skip_fraction=0.1,
                          weight_guard=False, ckpt_every=7, compile=True,
                          compile_mode="reduce-overhead",
                          compile_scope="model").trajectory_fields(1)  # fmt: skip
    assert changed == base
    assert TrainConfig().ckpt_every == 500 and TrainConfig().keep_checkpoints == 2


def test_compiled_runs_compile_per_block_by_default() -> None:
    assert TrainConfig().compiled_scope is None  # not compiled
    assert TrainConfig(compile=True).compiled_scope == "block"
    assert TrainConfig(compile=True, compile_scope="model").compiled_scope == "model"
    for scope in ("block", "model"):
        with pytest.raises(ConfigError, match=f"compile-scope {scope} needs compile"):
            TrainConfig(compile_scope=scope)
    with pytest.raises(ConfigError, match="compile-scope must be one of model, block"):
        TrainConfig(compile=True, compile_scope="layer")
