"""`deepspeed.moe.layer.MoE`: zeroshard has no mixture-of-experts layer; building one says so."""

from zeroshard.deepspeed.config import unsupported
from zeroshard.policies import ConfigError

__all__ = ["MoE"]


class MoE:
    def __init__(self, *args, **kwargs) -> None:
        raise ConfigError(unsupported("mixture of experts (deepspeed.moe.layer.MoE)"))
