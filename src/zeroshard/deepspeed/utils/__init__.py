"""`deepspeed.utils`: the logger, the full-value accessors and ZeRO-3 leaf modules.

- `logger`: the logger of the DeepSpeed API layer (`zeroshard.deepspeed`); setting its
  level (Trainer does) quiets that layer, not zeroshard's start-up lines.
- `safe_get_full_fp32_param` / `safe_get_full_grad` / `safe_get_full_optimizer_state` /
  `safe_set_full_fp32_param` (tensor_fragment.py): a parameter's whole fp32 value,
  gradient or optimizer state, gathered from the ranks' shards; collectives, so every
  rank calls them, as with DeepSpeed.
- `set_z3_leaf_modules` (z3_leaf_module.py): modules of these classes become stage-3
  gather units (zeroshard's `leaf_module.classes`).
"""

import logging

from zeroshard.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
    safe_set_full_fp32_param,
)
from zeroshard.deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
)

logger = logging.getLogger("zeroshard.deepspeed")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (default: rank 0; -1 in `ranks`: every rank)."""
    from zeroshard.deepspeed import comm

    rank = comm.get_rank()
    ranks = [0] if ranks is None else list(ranks)
    if -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


__all__ = ["get_z3_leaf_modules", "log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_set_full_fp32_param",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module"]
