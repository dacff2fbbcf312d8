"""minifloat: train large language models in FP4, FP8 and mixed precision with PyTorch."""

from minifloat import formats, recipes
from minifloat.quantize import PackedQTensor, QTensor, fake_quantize, quantize

__all__ = [
    "formats",
    "recipes",
    "quantize",
    "fake_quantize",
    "QTensor",
    "PackedQTensor",
]
__version__ = "0.1.0"
