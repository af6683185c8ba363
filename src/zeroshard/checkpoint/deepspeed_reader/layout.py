"""Where each parameter's elements sit in DeepSpeed's flat partitions: pure arithmetic.

Read from DeepSpeed 0.1x's source, not guessed:

Stages 1 and 2 (runtime/zero/stage_1_and_2.py, and runtime/bf16_optimizer.py for bf16 at
stage 1 with fp32 gradient accumulation). Each optimizer param group's trainable
parameters are flattened in `round_robin_bit16_groups` order, which is the order of
`param_shapes[i]` in the model-states file (engine._get_zero_param_shapes), with no gap
between parameters; the flat buffer is padded at its end to a multiple of
`nccl_start_alignment_factor (2) x dp world size` (align_dense_tensors) and cut into
`world size` equal partitions of P elements (get_data_parallel_partitions). Rank r's file
holds partition r of the fp32 master (`single_partition_of_fp32_groups[i]`); the ZeRO
optimizer saves it without the padding (`_get_groups_without_padding`, `group_paddings[i]`
elements are cut off rank r's copy), BF16_Optimizer with it. The optimizer states
(`base_optimizer_state`) have the master's shape (rigid: the torch state dict, padded;
elastic: a list of padding-free states and one `base_optimizer_state_step`).

Stage 3 (runtime/zero/stage3.py, utils/zero_to_fp32.py). Every parameter is partitioned
on its own: rank r holds elements [r*ceil(n/W), (r+1)*ceil(n/W)) of it, the last
partitions padded with zeros to ceil(n/W) elements. A rank's `fp32_flat_groups` (one
tensor per sub-group) are these partitions in `param_shapes` order, back to back; the
optimizer state of sub-group j has the shape of `fp32_flat_groups[j]`.

A `Run` says: elements [lo, hi) of a parameter's flattened value are in DeepSpeed rank
`rank`'s flat tensor `flat` starting at `start`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from zeroshard.policies import CheckpointError


@dataclass(frozen=True)
class Run:
    rank: int
    flat: int
    start: int
    lo: int
    hi: int


def partition_size(lengths: list[int], paddings: list[int], total: int, where: str) -> int:
    """P, the elements of each rank's partition of one flat group, from the lengths saved by
    each rank and the paddings they recorded; checked against the group's element count."""
    world = len(lengths)
    size = max(lengths)
    for r, (n, pad) in enumerate(zip(lengths, paddings)):
        if n not in (size, size - pad):
            raise CheckpointError(f"{where}: rank {r} saved {n} elements of a {size}-element partition with "
                                  f"padding {pad}; this is not a layout DeepSpeed writes")
    if not (world - 1) * size < total <= world * size and total:
        raise CheckpointError(f"{where}: {total} parameter elements do not fill {world} partitions of {size}; "
                              "the files are not from this model or were written by another DeepSpeed layout")
    return size


def flat_group_runs(numels: list[int], size: int, flat: int = 0) -> list[list[Run]]:
    """Stages 1-2: the runs of each parameter of one flat group cut into partitions of `size`."""
    out = []
    offset = 0
    for n in numels:
        runs = []
        lo = offset
        while lo < offset + n:
            r = lo // size
            hi = min(offset + n, (r + 1) * size)
            runs.append(Run(r, flat, lo - r * size, lo - offset, hi - offset))
            lo = hi
        out.append(runs)
        offset += n
    return out


def stage3_runs(numels: list[int], world: int, flat_sizes: list[int]) -> list[list[Run]]:
    """Stage 3: the runs of each parameter, given the sizes of one rank's sub-group tensors
    (every rank's are the same). Raises when the partitions do not add up to them, as
    DeepSpeed's zero_to_fp32 does."""
    bounds = list(itertools.accumulate(flat_sizes, initial=0))
    out = []
    offset = 0
    for n in numels:
        part = math.ceil(n / world)
        flat = next((j for j in range(len(flat_sizes)) if bounds[j] <= offset < bounds[j + 1]), None)
        if flat is None or offset + part > bounds[flat + 1]:
            raise CheckpointError(f"stage-3 partitions of the saved parameters ({sum(math.ceil(m / world) for m in numels)} "
                                  f"elements per rank) do not match the saved flat groups ({bounds[-1]} elements)")
        runs = []
        for r in range(world):
            lo, hi = r * part, min(n, (r + 1) * part)
            if lo < hi:
                runs.append(Run(r, flat, offset - bounds[flat], lo, hi))
        out.append(runs)
        offset += part
    if offset != bounds[-1]:
        raise CheckpointError(f"stage-3 partitions of the saved parameters ({offset} elements per rank) do not "
                              f"match the saved flat groups ({bounds[-1]} elements)")
    return out


def overlapping(runs: list[Run], lo: int, hi: int):
    """(run, a, b): the part [a, b) of [lo, hi) each run holds, in order."""
    for run in runs:
        a, b = max(lo, run.lo), min(hi, run.hi)
        if a < b:
            yield run, a, b
