"""Sharded, crash-safe checkpoints that load into any world size and stage, and export.

    engine.save_checkpoint("ckpt")                  # every rank writes its own shards
    client = engine.load_checkpoint("ckpt")         # any world size / stage / bucket sizes
    zeroshard export ckpt out --dtype bf16          # Hugging Face style model.safetensors

Only safetensors and JSON are written and read: nothing is pickled or unpickled.
See docs/checkpoints.md for the format and the guarantees.
"""

from zeroshard.checkpoint.export import export, save_16bit_model
from zeroshard.checkpoint.inspect import inspect
from zeroshard.checkpoint.load import load_checkpoint
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.checkpoint.save import save_checkpoint

__all__ = ["CheckpointReader", "export", "inspect", "load_checkpoint", "save_16bit_model", "save_checkpoint"]
