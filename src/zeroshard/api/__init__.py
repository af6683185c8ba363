"""The public surface: initialize() and the Engine it returns."""

from zeroshard.api.engine import Engine
from zeroshard.api.initialize import initialize

__all__ = ["Engine", "initialize"]
