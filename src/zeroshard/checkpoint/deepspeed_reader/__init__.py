"""Checkpoints written by DeepSpeed 0.1x, read without DeepSpeed and without running pickled code.

    from zeroshard.checkpoint.deepspeed_reader import DeepSpeedCheckpoint, is_deepspeed_checkpoint

`DeepSpeedCheckpoint(dir, tag)` answers the same questions as zeroshard's own
`CheckpointReader` (names, shapes, `read(name, field, lo, hi)`, optimizer state kinds,
counters), so `load_checkpoint`, `export` and `inspect` take either. DeepSpeed's flat
partitions are mapped back to parameters from the shapes and order stored in the files
and DeepSpeed's padding rules (layout.py); the files are opened by safe_load.py, which
allows tensors, plain containers and a short list of inert DeepSpeed records only; files.py
knows the folder's shape, entry.py opens either kind of checkpoint (checkpoint/inspect.py
reports on either).
"""

from zeroshard.checkpoint.deepspeed_reader.entry import open_checkpoint, open_deepspeed
from zeroshard.checkpoint.deepspeed_reader.files import find_deepspeed_tag, is_deepspeed_checkpoint
from zeroshard.checkpoint.deepspeed_reader.reader import DeepSpeedCheckpoint

__all__ = ["DeepSpeedCheckpoint", "find_deepspeed_tag", "is_deepspeed_checkpoint", "open_checkpoint", "open_deepspeed"]
