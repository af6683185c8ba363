"""User text for `zeroshard train --data PATH`: a file or a folder of text files, at byte level.

Text means UTF-8 without NUL bytes; other files (images, archives, compiled code) in a
folder are skipped, so pointing at a project folder just works. Bytes are the tokens
(vocabulary 256), as for the embedded corpus.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where tokens are made: the launcher checks --data without torch
    import torch

__all__ = ["NoTextError", "read_bytes", "text_bytes", "text_tokens", "walk_files"]

MIN_BYTES = 1024  # below this a sequence window barely fits: nothing to learn from
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", "venv", ".tox"}


class NoTextError(ValueError):
    """The path holds no (or too little) text to train on."""


def _is_text(data: bytes) -> bool:
    if not data or b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # a read cut through a multi-byte character at the end is still text
        return exc.start >= len(data) - 3
    return True


def walk_files(path: str, skip_dirs=_SKIP_DIRS) -> Iterator[str]:
    """`path` if it is a file, else the files under it in sorted order (`skip_dirs` left out)."""
    if os.path.isfile(path):
        yield path
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        yield from (os.path.join(dirpath, name) for name in sorted(filenames))


def read_bytes(names: Iterable[str], max_bytes: int, keep: Callable[[bytes], bool]) -> tuple[list[bytes], int, int]:
    """(contents `keep` accepts, their bytes, files refused) of `names`, up to `max_bytes` in all;
    an unreadable file reads as empty."""
    chunks: list[bytes] = []
    total = refused = 0
    for name in names:
        try:
            with open(name, "rb") as fh:
                data = fh.read(max_bytes - total)
        except OSError:
            data = b""
        if not keep(data):
            refused += 1
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return chunks, total, refused


def text_tokens(path: str | os.PathLike, max_bytes: int = 16_000_000) -> torch.Tensor:
    """The bytes of the text files at `path` (one file, or a folder walked in sorted order),
    up to `max_bytes`, as a LongTensor. Raises NoTextError naming the path when none is text."""
    import torch

    return torch.frombuffer(bytearray(text_bytes(path, max_bytes)), dtype=torch.uint8).long()


def text_bytes(path: str | os.PathLike, max_bytes: int = 16_000_000) -> bytes:
    """The bytes text_tokens makes its tokens of; NoTextError naming the path when none is text."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise NoTextError(f"--data {path}: no such file or folder")
    if not (os.path.isfile(path) or os.path.isdir(path)):
        raise NoTextError(f"--data {path}: not a regular file or a folder (a device or pipe); give a text file or a "
                          "folder of them")
    chunks, total, skipped = read_bytes(walk_files(path), max_bytes, _is_text)  # unreadable: not text
    if total < MIN_BYTES:
        what = "file" if os.path.isfile(path) else f"folder ({len(chunks)} text file(s), {skipped} other)"
        raise NoTextError(f"--data {path}: found {total} bytes of UTF-8 text in this {what}; "
                          f"need at least {MIN_BYTES}")
    return b"".join(chunks)
