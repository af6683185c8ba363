"""Where the served `deepspeed` package lives and the DeepSpeed version it claims, importable
without torch: `zeroshard launch` puts the folder on its ranks' PYTHONPATH before any rank
starts, and importing the drop-in package (zeroshard.deepspeed) would import torch, about
1.5 s of the launcher's start. zeroshard.deepspeed.shadow serves the package (its docstring
says how).
"""

from __future__ import annotations

import os

__all__ = ["SERVED_VERSION", "SHADOW_DIR", "with_shadow_path"]

SERVED_VERSION = "0.19.8+zeroshard"  # the DeepSpeed release whose API is served (its dist-info says so)
SHADOW_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed", "_shadow")


def with_shadow_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with SHADOW_DIR first on PYTHONPATH."""
    rest = env.get("PYTHONPATH", "")
    parts = [SHADOW_DIR] + [p for p in rest.split(os.pathsep) if p and p != SHADOW_DIR]
    return {**env, "PYTHONPATH": os.pathsep.join(parts)}
