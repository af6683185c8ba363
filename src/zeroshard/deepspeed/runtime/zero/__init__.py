"""`deepspeed.runtime.zero`: `Init`, `GatheredParameters` and `partition_parameters`."""

from zeroshard.deepspeed.runtime.zero import offload_config, partition_parameters
from zeroshard.deepspeed.zero import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "offload_config", "partition_parameters", "register_external_parameter"]
