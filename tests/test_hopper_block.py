"""A compiled LLaMA block at model width trains on the GPU under every recipe (GPU only).

The single-layer GPU tests (test_hopper_linear.py) use small shapes. At model widths inductor
fuses the quantizers differently, and a fused kernel can fail where the small one compiles:
session 24 found a compiled mxfp4 block at 1.3B width whose backward kernel Triton could not
compile ("PassManager::run failed"; the block scales' reciprocals computed in the graph,
docs/hopper_sessions.md). So every recipe compiles one block at the width of the 125M and 1.3B
presets and runs a bf16-autocast forward and backward on train_e2e.py's batch for that preset
(whole sequences: at 1.3B the failing fusion needed 2048 positions, 2047 compiled), with finite
results.
"""

import pytest
import torch

from minifloat import recipes
from scripts import load_benchmark

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores"),
]

# nvfp4 keeps its last blocks in bf16 (convert's keep_last): with one block that is all of them.
RECIPES = [
    f"{n}:keep_last=0" if recipes.get(n).keep_last_blocks else n
    for n in recipes.names()
    if recipes.get(n).quantized
]
# benchmarks/partition_probe.py: the one-block LLaMA (vocab 1000), shared with test_transpose.py
_PROBE = load_benchmark("partition_probe")
VOCAB = _PROBE._VOCAB
# preset -> (batch, positions): benchmarks/train_e2e.py's batches
SHAPES = {"125M": (32, 1024), "1.3B": (8, 2048)}


@pytest.mark.parametrize("preset", sorted(SHAPES))
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_block_at_model_width_trains(name, preset):
    torch._dynamo.reset()
    batch, positions = SHAPES[preset]
    net = _PROBE.one_block_llama(name, preset, positions, preset=preset, device="cuda")
    tokens = torch.randint(0, VOCAB, (batch, positions + 1), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = net(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for pname, p in net.layers[0].named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().amax() > 0, pname
