"""A compiled LLaMA block at model width trains on the GPU under every recipe (GPU only).

The single-layer GPU tests (test_hopper_linear.py) use small shapes. At model widths inductor
fuses the quantizers differently, and a fused kernel can fail where the small one compiles:
session 24 found a compiled mxfp4 block at 1.3B width whose backward kernel Triton could not
compile ("PassManager::run failed"; the block scales' reciprocals computed in the graph,
docs/hopper_sessions.md). So every recipe compiles one block at the width of the 125M and 1.3B
presets and runs a bf16-autocast forward and backward on train_e2e.py's batch for that preset
(whole sequences: at 1.3B the failing fusion needed 2048 positions, 2047 compiled), with finite
results, and with gradients as close to the unquantized block's as the same block's eager
gradients are: compiled and eager may round a few entries differently (inductor fuses the norm
and the quantizers into other kernels), but a fused kernel that computes something else, a lost
scale or a wrong transpose, costs many dB. That comparison runs at 1.3B width only: the eager
blocks took the GPU suite from 295 to 493 s (session 48).
"""

import pytest
import torch

from minifloat import recipes
from minifloat.sqnr import sqnr_db
from scripts import load_benchmark
from tolerances import COMPILED_BLOCK_SQNR_MARGIN_DB

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


def _step(net: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One bf16-autocast forward and backward: (loss, the block's parameter gradients)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = net(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.layers[0].named_parameters()}


@pytest.mark.parametrize("preset", sorted(SHAPES))
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_block_at_model_width_trains(name, preset, record_property):
    torch._dynamo.reset()
    batch, positions = SHAPES[preset]
    tokens = torch.randint(0, VOCAB, (batch, positions + 1), device="cuda")
    build = _PROBE.one_block_llama  # the same weights for every recipe (seeded)
    loss, grads = _step(build(name, preset, positions, preset=preset, device="cuda"), tokens)
    assert torch.isfinite(loss)
    for pname, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), pname
        assert g.abs().amax() > 0, pname
    if preset != "1.3B":  # the eager blocks doubled the suite's time; one width checks fusions
        return
    _, eager = _step(
        build(name, preset, positions, preset=preset, device="cuda", compile_block=False), tokens
    )
    _, plain = _step(
        build("bf16", preset, positions, preset=preset, device="cuda", compile_block=False), tokens
    )
    for pname, g in grads.items():
        compiled_db, eager_db = sqnr_db(plain[pname], g), sqnr_db(plain[pname], eager[pname])
        # in --junitxml reports: the margin's calibration (tests/tolerances.py)
        record_property(f"sqnr_gap_db:{pname}", round(eager_db - compiled_db, 4))
        assert compiled_db >= eager_db - COMPILED_BLOCK_SQNR_MARGIN_DB, (
            pname,
            compiled_db,
            eager_db,
        )
