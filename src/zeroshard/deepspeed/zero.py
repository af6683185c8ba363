"""`deepspeed.zero` for scripts: `Init`, `GatheredParameters`, `register_external_parameter`."""

from __future__ import annotations

import weakref
from typing import Any

import zeroshard
from zeroshard.deepspeed.config import client_config, unsupported
from zeroshard.partition.param_shards import shard_of
from zeroshard.policies import ConfigError

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]

class GatheredParameters(zeroshard.GatheredParameters):
    """zeroshard.GatheredParameters (same signature: params, modifier_rank, fwd_module, enabled);
    parameters sharded by `Init` get their new shard as `ds_tensor` on exit."""

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for param in self.params:
            entry = shard_of(param)
            if entry is not None and "ds_tensor" in param.__dict__:
                param.ds_tensor = entry.shard

_STAGE3_ONLY = {"zero_optimization": {"stage": 3}}


class Init(zeroshard.Init):
    """`with deepspeed.zero.Init(config_dict_or_path=ds_config): model = MyModel()`: each
    submodule is sharded as it is built (zeroshard.Init). Without a config the model is built
    for stage 3, as DeepSpeed's Init always partitions."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype=None, mpu=None, **kwargs: Any) -> None:
        if module is not None:
            raise ConfigError("zero.Init(module=...) (partitioning a model already built) is not supported: build "
                              "the model inside `with zero.Init(...)`, or pass it to initialize() at stage 3, "
                              "which shards it")
        if mpu is not None:
            raise ConfigError(unsupported("zero.Init(mpu=...) (model parallelism)"))
        if data_parallel_group is not None:
            raise ConfigError("zero.Init(data_parallel_group=...) is not supported: zeroshard shards over the "
                              "default process group")
        if remote_device not in (None, "none"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}) is not supported: zeroshard.Init keeps "
                              "the shards on the device")
        if dtype is not None:
            raise ConfigError("zero.Init(dtype=...) is not supported: the precision comes from the config's "
                              "fp16 / bf16 sections, applied by initialize()")
        unknown = [k for k, v in kwargs.items() if v not in (None, False)]
        if unknown:
            raise ConfigError(f"zero.Init({', '.join(unknown)}=...) is not supported by zeroshard")
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        super().__init__(client_config(cfg) if cfg is not None else _STAGE3_ONLY, enabled)

    def _on_attach(self, parent, name, child):
        """As zeroshard.Init, and each parameter sharded here shows DeepSpeed's attributes:
        `ds_tensor` (this rank's shard), `ds_numel`, `ds_shape`; `initialize` takes them
        off when the engine's buckets take the shards over."""
        out = super()._on_attach(parent, name, child)
        if child is not None:
            for param in child.parameters(recurse=False):
                entry = shard_of(param)
                if entry is not None:
                    param.ds_tensor, param.ds_numel, param.ds_shape = entry.shard, entry.numel, param.shape
                    self._flagged.append(weakref.ref(param))
        return out

    def __enter__(self):
        self._flagged: list = []
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for ref in getattr(self, "_flagged", []):  # a write inside the context re-sharded it
            param = ref()
            entry = shard_of(param) if param is not None else None
            if entry is not None:
                param.ds_tensor = entry.shard


def forget_ds_attributes(model) -> None:
    """The engine holds the shards now: the Init-time `ds_*` attributes would be stale. At
    stage 3 the engine gave every parameter its own (`ds_id` among them), kept true by it."""
    for param in model.parameters():
        if hasattr(param, "ds_id"):
            continue
        for attr in ("ds_tensor", "ds_numel", "ds_shape"):
            if attr in param.__dict__:
                delattr(param, attr)


def register_external_parameter(module, parameter) -> None:
    """Nothing to do: at stage 3 zeroshard finds parameters used outside their module's
    forward and gathers them itself."""
