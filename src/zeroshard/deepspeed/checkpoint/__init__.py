"""`deepspeed.checkpoint`: `utils.clone_tensors_for_torch_save` (what Accelerate imports)."""

from zeroshard.deepspeed.checkpoint import utils

__all__ = ["utils"]
