"""minifloat: train large language models in FP4, FP8 and mixed precision with PyTorch.

    import minifloat
    model = minifloat.convert(model, "fp4")   # swap linear layers for quantized ones, in place
    print(model.minifloat_report)             # what was converted, what was kept and why

Core numerics are importable from here; the trainer, models, data, optimizer and distributed
helpers live in their own modules (`minifloat.train`, `minifloat.models`, `minifloat.data`,
`minifloat.optim`, `minifloat.distributed`, `minifloat.diagnostics`).
"""

from minifloat import formats, recipes
from minifloat.conv1d import QuantConv1D
from minifloat.convert import (
    REPORT_ATTR,
    AlreadyConvertedError,
    ConversionReport,
    check_recipe,
    convert,
    is_output_head,
    set_recipe,
)
from minifloat.dge import dge_derivative
from minifloat.linear import QuantLinear
from minifloat.quantize import PackedQTensor, QTensor, fake_quantize, quantize
from minifloat.size_rule import TORCHAO_ROWWISE, TORCHAO_TENSORWISE, SizeRule
from minifloat.sqnr import sqnr_db

__all__ = [
    "formats",
    "recipes",
    "quantize",
    "fake_quantize",
    "QTensor",
    "PackedQTensor",
    "convert",
    "ConversionReport",
    "AlreadyConvertedError",
    "is_output_head",
    "set_recipe",
    "check_recipe",
    "SizeRule",
    "TORCHAO_TENSORWISE",
    "TORCHAO_ROWWISE",
    "REPORT_ATTR",
    "QuantLinear",
    "QuantConv1D",
    "dge_derivative",
    "sqnr_db",
]
__version__ = "0.1.0"
