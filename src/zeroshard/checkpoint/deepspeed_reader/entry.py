"""`open_checkpoint`: zeroshard's own reader or DeepSpeed's, whichever the folder is."""

from __future__ import annotations

import os

from zeroshard.checkpoint.deepspeed_reader.files import find_deepspeed_tag, is_universal
from zeroshard.checkpoint.deepspeed_reader.reader import DeepSpeedCheckpoint
from zeroshard.checkpoint.deepspeed_reader.universal import UniversalCheckpoint
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.policies import CheckpointError


def open_deepspeed(path: str | os.PathLike, tag: str | None = None) -> DeepSpeedCheckpoint:
    """The reader of a folder DeepSpeed wrote: a ZeRO checkpoint, or ds_to_universal's output."""
    tag_dir = find_deepspeed_tag(path, tag)
    if tag_dir is not None and is_universal(tag_dir):
        return UniversalCheckpoint(path, tag)
    return DeepSpeedCheckpoint(path, tag)


def open_checkpoint(path: str | os.PathLike, tag: str | None = None):
    """A reader of the checkpoint at `path`: zeroshard's own (`CheckpointReader`), or one
    DeepSpeed wrote (`DeepSpeedCheckpoint`)."""
    if find_deepspeed_tag(path, tag) is not None:
        return open_deepspeed(path, tag)
    try:
        return CheckpointReader(path, tag)
    except CheckpointError as exc:
        if "not a zeroshard checkpoint" not in str(exc):
            raise
        raise CheckpointError(f"{exc}; nor is it a checkpoint DeepSpeed wrote (no *_model_states.pt or "
                              "*_optim_states.pt files there or in the tag 'latest' names)") from None

