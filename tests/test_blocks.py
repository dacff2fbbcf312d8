"""blocks.find_repeated_blocks: the rule apply_fsdp shards by, on toy modules and real models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifloat.blocks import NoRepeatedBlocksError, find_repeated_blocks
from minifloat.models.llama import Llama, get_config

HF_LAYERS = 3


def hf_model(name: str) -> nn.Module:
    """A tiny randomly initialized `transformers` decoder (no download): llama | mistral | qwen2."""
    transformers = pytest.importorskip("transformers")
    model_cls, config_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    }[name]
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=HF_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=32)  # fmt: skip
    return model_cls(config)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(3))  # nested: stays in the block
        self.norm = nn.LayerNorm(4)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])  # same class: counted
        self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])  # two classes: not
        self.single = nn.ModuleList([MoEBlock()])  # one child: not (its experts are searched)
        self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # no parameters: not
        self.stack = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # a computation: not
        self.layers = nn.ModuleDict({"a": MoEBlock(), "b": MoEBlock()})


def test_outermost_lists_of_same_class_blocks_with_parameters():
    model = Toy()
    found = find_repeated_blocks(model)
    expected = [*model.heads, *model.single[0].experts, model.layers["a"], model.layers["b"]]
    assert [id(b) for b in found] == [id(b) for b in expected]


def test_our_llama_shards_its_layers():
    model = Llama(get_config("tiny", dim=32, n_layers=3, n_heads=2, ffn_dim=64, vocab_size=64))
    assert [id(b) for b in find_repeated_blocks(model)] == [id(b) for b in model.layers]


def test_a_one_layer_model_shards_its_single_block():
    model = Llama(get_config("tiny", dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=64))
    assert [id(b) for b in find_repeated_blocks(model)] == [id(model.layers[0])]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_transformers_decoders_shard_their_decoder_layers(name):
    torch.manual_seed(0)
    model = hf_model(name)
    found = find_repeated_blocks(model)
    assert [id(b) for b in found] == [id(b) for b in model.model.layers]
    assert len(found) == HF_LAYERS


def test_no_repeated_blocks_is_a_one_line_error():
    with pytest.raises(NoRepeatedBlocksError, match="no nn.ModuleList") as err:
        find_repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)


def test_a_shared_block_list_is_taken_once():
    shared = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    model = nn.Module()
    model.a, model.b = shared, shared
    assert len(find_repeated_blocks(model)) == 2


def test_find_repeated_blocks_refuses_a_non_module():
    with pytest.raises(TypeError, match="takes an nn.Module, got list"):
        find_repeated_blocks([nn.Linear(2, 2), nn.Linear(2, 2)])
