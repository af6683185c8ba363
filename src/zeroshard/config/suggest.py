"""Did-you-mean suggestions for misspelt keys and names (difflib, no third-party code)."""

from __future__ import annotations

import difflib
from typing import Iterable

_CUTOFF = 0.6


def closest(word: str, candidates: Iterable[str], cutoff: float = _CUTOFF) -> str | None:
    """The candidate nearest to `word`, comparing case-insensitively and ignoring outer spaces."""
    by_folded: dict[str, str] = {}
    for name in candidates:
        by_folded.setdefault(name.lower(), name)
    folded = word.strip().lower()
    if folded in by_folded:
        return by_folded[folded]
    matches = difflib.get_close_matches(folded, list(by_folded), n=1, cutoff=cutoff)
    return by_folded[matches[0]] if matches else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """"; did you mean 'x'?" or "" when nothing is close."""
    match = closest(word, candidates)
    return f"; did you mean {match!r}?" if match is not None and match != word else ""
