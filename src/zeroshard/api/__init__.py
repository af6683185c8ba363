"""The public surface: initialize(), the Engine it returns, Init and GatheredParameters."""

from zeroshard.api.engine import Engine
from zeroshard.api.gathered import GatheredParameters
from zeroshard.api.init import Init
from zeroshard.api.initialize import initialize

__all__ = ["Engine", "GatheredParameters", "Init", "initialize"]
