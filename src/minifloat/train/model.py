"""The trainer's model: a LLaMA preset in the run's dtype and recipe, wrapped for parallelism.

Order matters and is the same for every run: build → (bf16 cast) → convert to the recipe (a
run with a precision switch: switch.py) → user transform → embedding-gradient shrink → FSDP /
torch.compile / DDP. Under FSDP with fp32 parameters the model is built on the meta device and
each rank initializes only its own shard after sharding (torchtitan's pattern); the values equal
the eager init's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minifloat.models.llama import PRESETS, Llama, LlamaConfig, get_config
from minifloat.recipes import Recipe
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.runtime import Runtime
from minifloat.train.stability import attach_embedding_grad_shrink

__all__ = [
    "build_model",
    "check_quantizes_a_layer",
    "deferred_init",
    "model_config",
    "param_dtype",
]


def param_dtype(config: TrainConfig) -> torch.dtype:
    """dtype of the stored parameters: bf16 for master-less optimizer presets, else fp32."""
    if config.optim_states == "fp32":
        return torch.float32
    from minifloat.optim import preset_param_dtype

    bf16 = preset_param_dtype(config.optim_states) == "bf16"
    return torch.bfloat16 if bf16 else torch.float32


def model_config(config: TrainConfig, *, vocab_size: int) -> LlamaConfig:
    """The LlamaConfig a run trains: its preset and overrides, the tokenizer's vocabulary, and
    room for both the preset's and the run's sequence length (RoPE tables are sized by it)."""
    overrides = {"vocab_size": vocab_size, **config.model_overrides}
    overrides.setdefault("max_seq_len", max(PRESETS[config.model].max_seq_len, config.seq_len))
    llama = get_config(config.model, **overrides)
    if llama.vocab_size < vocab_size:  # token ids >= vocab_size would index past the embedding
        raise ConfigError(
            f"model override vocab_size={llama.vocab_size} is smaller than the tokenizer's "
            f"vocabulary of {vocab_size} tokens: drop the override (the model takes the "
            "tokenizer's size), or train a BPE tokenizer of at most that size (--vocab-size)"
        )
    return llama


def deferred_init(config: TrainConfig, runtime: Runtime) -> bool:
    """Whether to build on the meta device and initialize after sharding.

    Under FSDP every rank then materializes only its own shard, instead of initializing the
    whole model on its CPU and copying it to its GPU (27 GB per rank at 7B). bf16 parameters keep
    the eager path: their values come from rounding the fp32 init.
    """
    return (
        config.parallel == "fsdp" and runtime.distributed and param_dtype(config) == torch.float32
    )


def build_model(
    config: TrainConfig,
    recipe: Recipe,
    runtime: Runtime,
    *,
    vocab_size: int,
    model_transform: Callable[[nn.Module], Any] | None = None,
    convert_recipe: Recipe | None = None,
) -> tuple[LlamaConfig, nn.Module, nn.Module]:
    """(model config, the model, the module to call): the last is the model wrapped by FSDP,
    torch.compile and/or DDP as `config` asks; the model itself holds the parameters.

    ``convert_recipe``: convert with this recipe instead of ``recipe``, then set the quantized
    layers to ``recipe`` (a run that switches from bf16 to a quantized recipe later, switch.py).
    """
    llama_config = model_config(config, vocab_size=vocab_size)
    deferred = deferred_init(config, runtime)
    with torch.device("meta") if deferred else contextlib.nullcontext():
        model = Llama(llama_config)
    if not deferred:
        model.to(runtime.device)
        model.init_weights(config.seed)
    if param_dtype(config) == torch.bfloat16:
        model.to(torch.bfloat16)
        model.reset_rope_tables()  # fp32 again (a compiled forward would rebuild and recompile)
    convert_as = recipe if convert_recipe is None else convert_recipe
    if convert_as.quantized:
        from minifloat.convert import set_recipe

        _convert_or_refuse(model, convert_as, config)
        if convert_as is not recipe:
            set_recipe(model, recipe)
    if model_transform is not None:
        model_transform(model)
    if config.embed_grad_shrink < 1.0:
        attach_embedding_grad_shrink(model.tok_embeddings, config.embed_grad_shrink)
    if config.loss_chunk:  # before FSDP, which records each parameter's module
        from minifloat.train.head_loss import defer_head

        defer_head(model)
    return llama_config, model, _wrap(model, config, runtime, deferred=deferred)


def _convert_or_refuse(model: nn.Module, recipe: Recipe, config: TrainConfig) -> None:
    """convert(), except that a quantized recipe converting no layer is a ConfigError: the run
    would train in high precision under the recipe's name (its results a mislabeled bf16 run;
    convert() itself only warns, which a compare table does not show)."""
    from minifloat.convert import convert
    from minifloat.size_rule import SizeRule

    size_rule = SizeRule.parse(config.size_rule) if config.size_rule else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert(model, recipe, size_rule=size_rule)
    nothing = [w for w in caught if "converted no layer" in str(w.message)]
    for w in caught:
        if w not in nothing:
            warnings.warn(w.message, w.category, stacklevel=3)
    if nothing:
        raise ConfigError(
            f"{nothing[0].message}: the run would train in high precision under the name "
            f"{recipe.name}"
        )


def check_quantizes_a_layer(config: TrainConfig) -> None:
    """ConfigError unless every quantized recipe of ``config`` (its recipe, its switch recipe)
    converts some layer of the run's model: checked on the meta device, before data or training
    (compare runs every recipe in turn, and one that converts nothing would fail after the
    others had trained)."""
    from minifloat import recipes

    for name in (config.recipe, config.switch_recipe):
        recipe = None if name is None else recipes.get(name)
        if recipe is not None and recipe.quantized:
            with torch.device("meta"):
                model = Llama(model_config(config, vocab_size=257))  # the byte vocabulary
            _convert_or_refuse(model, recipe, config)


def _materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the (sharded) meta parameters and buffers on `device` and initialize them."""
    model.to_empty(device=device)
    model.init_weights(seed)  # converted layers' buffers too (`Llama.init_weights`)


def _wrap(model: nn.Module, config: TrainConfig, runtime: Runtime, *, deferred: bool) -> nn.Module:
    """Apply FSDP / torch.compile / DDP as configured; returns the module to call."""
    if config.parallel != "none" and not runtime.distributed:
        raise ConfigError(f"parallel={config.parallel} needs a torchrun launch (WORLD_SIZE > 1)")
    _compile_blocks(model, config)  # before FSDP, torchtitan's order; no-op unless "block"
    if config.parallel == "fsdp":
        from minifloat.distributed import apply_fsdp, fsdp_reduce_dtype

        try:
            reduce_dtype = fsdp_reduce_dtype(config.grad_comm)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        model = apply_fsdp(
            model, reduce_dtype=reduce_dtype, quantized_all_gather=config.quantized_all_gather
        )
        if deferred:
            _materialize(model, runtime.device, config.seed)
    forward_module = model
    # Static shapes (dynamic=False) in both scopes: a validation batch smaller than training's
    # recompiles for its own shape, where automatic dynamic shapes would compile a symbolic
    # graph, slower to build (with the old rope recompile, a 125M run on the H200 had not
    # finished step 50 after 10 minutes; session 56).
    if config.compiled_scope == "model":
        forward_module = torch.compile(model, mode=config.compile_mode, dynamic=False)
    if config.parallel == "ddp" or (runtime.distributed and config.parallel == "none"):
        from torch.nn.parallel import DistributedDataParallel

        from minifloat.distributed import register_grad_comm_hook

        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        # Every rank builds the same rope tables: DDP need not broadcast them each step.
        rope = [name for name, _ in forward_module.named_buffers() if name.endswith("rope_cos")
                or name.endswith("rope_sin")]  # fmt: skip
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(forward_module, rope)
        forward_module = DistributedDataParallel(forward_module, device_ids=device_ids)
        register_grad_comm_hook(forward_module, config.grad_comm)
    return forward_module


def _compile_blocks(model: nn.Module, config: TrainConfig) -> None:
    """Under `compile_scope="block"`, compile each repeated block in place (`Module.compile`:
    parameter names and the state_dict stay those of the plain model)."""
    if config.compiled_scope != "block":
        return
    from minifloat.blocks import NoRepeatedBlocksError, find_repeated_blocks

    try:
        blocks = find_repeated_blocks(model)
    except NoRepeatedBlocksError as err:
        raise ConfigError(f"compile-scope block: {err}") from None
    for block in blocks:
        block.compile(mode=config.compile_mode, dynamic=False)
