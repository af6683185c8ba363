"""Recording only (`record_deepspeed.py --trl`): run a TRL script of this folder, unchanged, under the
real DeepSpeed 0.19.8 on CPU. Usage (each rank): ds_comm_first.py [--no-prefetch] SCRIPT ARGS...

What DeepSpeed needs here that the compared script does not do (zeroshard's runs never use this file):
- deepspeed.comm joins torch.distributed's group as soon as it is made. With `use_cpu=True`
  accelerate's PartialState makes the group with torch.distributed alone (state.py calls
  `deepspeed.comm.init_distributed` only `if not cpu`, as it does on a GPU). transformers'
  from_pretrained under zero.Init (trl_grpo.py loads its model from a folder) then builds a
  DeepSpeedConfig whose `dist.get_rank()` asserts, falls back to world_size 1 (runtime/config.py)
  and fails `_batch_assertion`: "train_batch_size ... 8 != 4 * 1 * 1".
- `--no-prefetch` sets `stage3_prefetch_bucket_size` to 0 (prefetching only schedules gathers: the
  numbers are the same). With GRPO's `ds3_gather_for_generation=False` DeepSpeed's prefetcher,
  following the trace the generation forwards recorded, leaves `lm_head.weight` AVAILABLE when TRL's
  fused LM head reads it; TRL's `maybe_gather_lm_head_ctx` then skips its gather (it gathers only
  parameters that are not AVAILABLE), DeepSpeed releases the weight before the backward (seen there
  NOT_AVAILABLE, shape (0,)), and the backward fails in lm_head.weight's AccumulateGrad: "The size
  of tensor a (0) must match the size of tensor b (32) at non-singleton dimension 1".
"""

from __future__ import annotations

import functools
import os
import runpy
import sys


def _join_deepspeed_comm() -> None:
    import torch.distributed

    import deepspeed

    make_group = torch.distributed.init_process_group

    @functools.wraps(make_group)
    def make_group_then_join(*args, **kwargs):
        out = make_group(*args, **kwargs)
        deepspeed.init_distributed(dist_backend="gloo")  # the group exists: deepspeed.comm only wraps it
        return out

    torch.distributed.init_process_group = make_group_then_join


def _no_prefetch(here: str) -> None:
    sys.path.insert(0, here)
    import trl_common

    config = trl_common.ds_config

    def without_prefetch() -> dict:
        c = config()
        c["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        return c

    trl_common.ds_config = without_prefetch  # common_args looks it up at call time


def main() -> None:
    argv = sys.argv[1:]
    no_prefetch = argv[:1] == ["--no-prefetch"]
    target = os.path.abspath(argv[1] if no_prefetch else argv[0])
    _join_deepspeed_comm()
    if no_prefetch:
        _no_prefetch(os.path.dirname(target))
    sys.argv = argv[1:] if no_prefetch else argv
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
