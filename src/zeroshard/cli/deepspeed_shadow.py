"""`zeroshard launch`'s part in serving `import deepspeed` (zeroshard.deepspeed.shadow).

By default the ranks get zeroshard's `deepspeed` package first on PYTHONPATH, so a script
(or Trainer, or Accelerate) that imports `deepspeed` runs on zeroshard unchanged, and one
start-up line says so. `--real-deepspeed` leaves PYTHONPATH alone and runs the DeepSpeed
installed here (an error if there is none).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os

from zeroshard.shadow_path import SERVED_VERSION, SHADOW_DIR, with_shadow_path

__all__ = ["add_arguments", "shadow_env"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--real-deepspeed", action="store_true",
                   help="let `import deepspeed` find the DeepSpeed installed here instead of zeroshard's "
                        "(by default zeroshard serves it: docs/huggingface.md)")


def shadow_env(args: argparse.Namespace, env: dict[str, str] | None = None) -> tuple[str | None, dict[str, str], str]:
    """(problem, environment to add for the ranks, the start-up line)."""
    env = dict(os.environ if env is None else env)
    if getattr(args, "real_deepspeed", False):
        inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SHADOW_DIR]
        version = _installed_deepspeed()
        if version is None:
            return ("--real-deepspeed: no DeepSpeed is installed in this Python (pip install deepspeed), or "
                    "leave the flag out and zeroshard serves `import deepspeed`"), {}, ""
        return None, {"PYTHONPATH": os.pathsep.join(inherited)}, (
            f"zeroshard launch: `import deepspeed` is the installed DeepSpeed {version} (--real-deepspeed)")
    line = (f"zeroshard launch: zeroshard serves `import deepspeed` in this run (zeroshard.deepspeed, seen as "
            f"deepspeed {SERVED_VERSION}); --real-deepspeed runs the installed DeepSpeed instead")
    return None, {"PYTHONPATH": with_shadow_path(env)["PYTHONPATH"]}, line


def _installed_deepspeed() -> str | None:
    """The version of a real DeepSpeed distribution importable here, or None (ours is not counted)."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None
    if version.endswith("+zeroshard") or importlib.util.find_spec("deepspeed") is None:
        return None
    return version
