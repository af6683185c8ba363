"""Batch-size arithmetic, as DeepSpeed's `_set_batch_related_parameters` and `_batch_assertion`.

    train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size

Any two of the three determine the third. Only train_batch_size: accumulation 1.
Only the micro batch: accumulation 1. Neither batch size (DeepSpeed refuses this;
zeroshard, like Hugging Face's "auto", uses a micro batch of 1 and says so).
"""

from __future__ import annotations

from zeroshard.policies import BatchPolicy, ConfigError

_RULE = "train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size"


def _divide(total: int, divisor: int, what: str, numbers: str) -> int:
    if total % divisor:
        raise ConfigError(f"batch sizes do not divide: {numbers}; {what} is not an integer. {_RULE}")
    return total // divisor


def resolve_batch(train_batch_size: int | None, micro_batch_size: int | None,
                  gradient_accumulation_steps: int | None, world_size: int) -> tuple[BatchPolicy, list[str]]:
    """The three batch numbers, completed and checked, and notes for values zeroshard chose."""
    tbs, micro, gas, world = train_batch_size, micro_batch_size, gradient_accumulation_steps, world_size
    notes: list[str] = []
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            raise ConfigError(
                f"inconsistent batch sizes: train_batch_size = {tbs}, train_micro_batch_size_per_gpu = "
                f"{micro}, gradient_accumulation_steps = {gas}, world_size = {world}: "
                f"{micro} x {gas} x {world} = {micro * gas * world} != {tbs}. {_RULE}")
    elif tbs is not None and micro is not None:
        gas = _divide(tbs, micro * world, "gradient_accumulation_steps",
                      f"train_batch_size = {tbs}, train_micro_batch_size_per_gpu = {micro}, "
                      f"world_size = {world}, gradient_accumulation_steps = {tbs} / ({micro} x {world})")
    elif tbs is not None and gas is not None:
        micro = _divide(tbs, gas * world, "train_micro_batch_size_per_gpu",
                        f"train_batch_size = {tbs}, gradient_accumulation_steps = {gas}, world_size = {world}, "
                        f"train_micro_batch_size_per_gpu = {tbs} / ({gas} x {world})")
    elif micro is not None and gas is not None:
        tbs = micro * gas * world
    elif tbs is not None:
        gas = 1
        micro = _divide(tbs, world, "train_micro_batch_size_per_gpu",
                        f"train_batch_size = {tbs}, gradient_accumulation_steps = 1 (not given), "
                        f"world_size = {world}, train_micro_batch_size_per_gpu = {tbs} / {world}")
    elif micro is not None:
        gas = 1
        tbs = micro * world
    else:
        micro = 1
        gas = 1 if gas is None else gas
        tbs = micro * gas * world
        notes.append(f"no batch size given: train_micro_batch_size_per_gpu = 1, gradient_accumulation_steps "
                     f"= {gas}, train_batch_size = {tbs} (world_size {world})")
    if micro < 1 or gas < 1:  # e.g. train_batch_size smaller than micro x world
        raise ConfigError(
            f"batch sizes do not fit: train_batch_size = {tbs}, train_micro_batch_size_per_gpu = {micro}, "
            f"gradient_accumulation_steps = {gas}, world_size = {world}. {_RULE}")
    return BatchPolicy(train_batch_size=tbs, micro_batch_size=micro, gradient_accumulation_steps=gas), notes
