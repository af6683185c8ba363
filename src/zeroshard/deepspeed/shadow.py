"""Serving `import deepspeed` from zeroshard, for scripts that cannot be edited.

Hugging Face Trainer, Accelerate and DeepSpeedExamples import `deepspeed` themselves and
first check that a distribution of that name is installed (`importlib.util.find_spec`,
`importlib.metadata.version`). `SHADOW_DIR` holds a `deepspeed` package and a
`deepspeed-<version>+zeroshard.dist-info`; with it first on PYTHONPATH those checks pass
and `import deepspeed` is `zeroshard.deepspeed`.

- `zeroshard launch` puts it on every rank's PYTHONPATH (and says so); `--real-deepspeed`
  leaves the installed DeepSpeed alone.
- Anywhere else nothing is shadowed unless you opt in:

      python -m zeroshard.deepspeed.shadow train.py --args ...     # run one script served
      export PYTHONPATH="$(python -m zeroshard.deepspeed.shadow --path)${PYTHONPATH:+:$PYTHONPATH}"

`serve()` (run by the served package) makes `deepspeed.X` the very module
`zeroshard.deepspeed.X`, so classes are the same objects under both names; a `deepspeed.X`
with no zeroshard module is a ModuleNotFoundError that names it and the supported path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys

from zeroshard.shadow_path import SERVED_VERSION, SHADOW_DIR, with_shadow_path

__all__ = ["SERVED_VERSION", "SHADOW_DIR", "main", "serve", "with_shadow_path"]

_PREFIX = "deepspeed"
_TARGET = "zeroshard.deepspeed"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # already executed under its zeroshard name; the import system has just set the alias
        # spec on it: give it back its own, so the module keeps one identity
        module.__spec__ = self._spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """`deepspeed.a.b` -> the module `zeroshard.deepspeed.a.b`, or one clear error."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(_PREFIX + "."):
            return None
        real = _TARGET + fullname[len(_PREFIX):]
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            raise ModuleNotFoundError(not_served(fullname), name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real),
                                              is_package=spec.submodule_search_locations is not None)


def not_served(name: str) -> str:
    return (f"{name} is not served by zeroshard: under `zeroshard launch` `import deepspeed` is "
            "zeroshard.deepspeed, which serves what Hugging Face Trainer, Accelerate and DeepSpeedExamples "
            "use (see docs/huggingface.md for the list). Run the installed DeepSpeed instead with "
            "`zeroshard launch --real-deepspeed ...`")


def serve() -> None:
    """Make `deepspeed` (and every `deepspeed.X`) zeroshard.deepspeed in this process."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
    sys.modules[_PREFIX] = importlib.import_module(_TARGET)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--path"]:
        print(SHADOW_DIR)
        return 0
    as_module = argv[:1] == ["-m"]
    if as_module:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    os.environ.update(with_shadow_path(dict(os.environ)))  # child processes are served too
    sys.path.insert(0, SHADOW_DIR)
    serve()
    sys.argv = list(argv)
    if as_module:
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
