"""Count the real tensor storage a rank holds, to check `memory_stats()` against reality.

Everything reachable from the engine, its module and its optimizer (attributes, lists,
dicts, tuples, parameters and their live `.grad`s, optimizer states) is visited; each tensor
counts the bytes of its storage once, however many views share it. Module buffers (masks,
rotary caches) are not model states and the ledger does not count them, so neither does
this: they are reported apart.
"""

from __future__ import annotations

import torch
from torch import nn

_SKIP_TYPES = (str, bytes, int, float, bool, type(None), type, torch.dtype, torch.device)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    if t.is_meta or t.device.type == "meta":
        return None
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def real_storage_bytes(engine) -> dict[str, int]:
    """{'model_states': bytes, 'buffers': bytes} held by this rank right now."""
    buffer_ptrs = {}
    for b in engine.module.buffers():
        key = _storage(b)
        if key:
            buffer_ptrs[key[0]] = key[1]
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack: list = [engine, engine.module, engine.optimizer]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _SKIP_TYPES) or id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = _storage(obj)
            if key and key[0] and key[0] not in buffer_ptrs:
                storages[key[0]] = max(storages.get(key[0], 0), key[1])
            if isinstance(obj, nn.Parameter) and obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, torch.optim.Optimizer):
            stack.extend(obj.state.values())
            stack.extend(obj.param_groups)
            continue
        if isinstance(obj, nn.Module):
            stack.extend(obj.parameters(recurse=False))
            stack.extend(obj.children())
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("zeroshard", "torch.optim")):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__") and type(obj).__module__.startswith("zeroshard"):
            stack.extend(getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s))
    return {"model_states": sum(storages.values()), "buffers": sum(buffer_ptrs.values())}


def ledger_bytes(engine) -> int:
    stats = engine.memory_stats()
    return sum(stats.get(k, 0) for k in ("params", "grads", "optimizer_states", "comm_buffers"))
