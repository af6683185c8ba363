"""An embedded corpus that every machine with Python has: the standard library's own
source files, read as bytes (vocabulary 256). No download, nothing to ship."""

from __future__ import annotations

import sysconfig

import torch

from zeroshard.models.text import read_bytes, walk_files

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The first `max_bytes` bytes of the stdlib's .py files, in sorted path order, as a
    LongTensor of byte values. Deterministic for a given Python installation."""
    root = sysconfig.get_paths()["stdlib"]
    sources = (name for name in walk_files(root, SKIP_DIRS) if name.endswith(".py"))
    chunks, total, _ = read_bytes(sources, max_bytes, keep=lambda data: True)
    if total < min(1024, max_bytes):
        raise FileNotFoundError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
