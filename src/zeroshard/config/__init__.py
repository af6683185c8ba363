"""Load a dict or a DeepSpeed JSON config into zeroshard's frozen policies.

Accepts users' existing DeepSpeed 0.19 configs unchanged (aliases, legacy
forms, Hugging Face "auto" values); every problem is one ConfigError naming
the key path, the value and the fix. See `support.py` for what is not built yet.
"""

from zeroshard.config.loader import load_config

__all__ = ["load_config"]
