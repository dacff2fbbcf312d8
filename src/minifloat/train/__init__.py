"""The reference LLaMA trainer: one run (``train``), its settings (``TrainConfig``), the CLI.

    from minifloat.train import TrainConfig, train
    result = train(TrainConfig(recipe="fp4", model="tiny", steps=200))

The trainer builds on the numerics (formats, quantize, recipes, linear, convert, kernels), which
never import it. Modules: ``config`` (TrainConfig), ``trainer`` (the loop), ``model`` (build and
wrap the model), ``checkpoint`` / ``sharded_checkpoint`` (the two checkpoint formats), ``metrics``,
``schedule``, ``stability`` (step guard, z-loss), ``loss`` (the objective, compiled when the
model is), ``head_loss`` (the head and the objective a chunk of tokens at a time),
``loss_scaler``, ``runtime`` (device, torchrun),
``compare`` (several recipes), ``export`` (a run as a Hugging Face model) and ``cli``.
"""

from minifloat.train.checkpoint import CheckpointError
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.trainer import Trainer, TrainResult, train

__all__ = ["CheckpointError", "ConfigError", "TrainConfig", "TrainResult", "Trainer", "train"]
