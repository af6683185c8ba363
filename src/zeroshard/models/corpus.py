"""An embedded corpus that every machine with Python has: the standard library's own
source files, read as bytes (vocabulary 256). No download, nothing to ship."""

from __future__ import annotations

import os
import sysconfig

import torch

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The first `max_bytes` bytes of the stdlib's .py files, in sorted path order, as a
    LongTensor of byte values. Deterministic for a given Python installation."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as fh:
                data = fh.read(max_bytes - total)
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
    if total < 1024:
        raise FileNotFoundError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
