"""`deepspeed.pipe`: zeroshard has no pipeline engine; building one of these says so."""

from zeroshard.deepspeed.config import unsupported
from zeroshard.policies import ConfigError

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class _Unsupported:
    def __init__(self, *args, **kwargs) -> None:
        raise ConfigError(unsupported(f"pipeline parallelism (deepspeed.pipe.{type(self).__name__})"))


class PipelineModule(_Unsupported):
    pass


class LayerSpec(_Unsupported):
    pass


class TiedLayerSpec(_Unsupported):
    pass
