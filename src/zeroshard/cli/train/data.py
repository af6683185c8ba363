"""`zeroshard train --data`: the token stream (bytes of the embedded corpus or of the user's
text) and each rank's slice of every global batch, indexed by micro-step so a resumed run
sees exactly the batches the uninterrupted run would have."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroshard.models.text import NoTextError, text_bytes, text_tokens

if TYPE_CHECKING:  # the ranks' functions import it: the launcher's check_data runs without torch
    import torch

__all__ = ["NoTextError", "check_data", "load_tokens", "rank_batch"]


def load_tokens(data: str | None, vocab_size: int) -> torch.Tensor:
    """Byte tokens of `data` (file or folder of text) or of the stdlib's source; bytes are
    folded into vocabularies smaller than 256 (the tiny preset has 64)."""
    from zeroshard.models.corpus import stdlib_corpus

    tokens = text_tokens(data) if data else stdlib_corpus()
    return tokens % vocab_size if vocab_size < 256 else tokens


def check_data(data: str | None) -> str | None:
    if not data:
        return None
    try:
        text_bytes(data, max_bytes=1 << 20)
    except NoTextError as exc:
        return str(exc)
    return None


def rank_batch(tokens: torch.Tensor, micro: int, seq_len: int, index: int, rank: int, world: int,
               seed: int, micro_step: int = 0, accumulation: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of micro-step `micro_step` of global batch number `index` (see
    zeroshard.models.data). A global batch is world x accumulation x micro rows drawn at once, so
    the samples of an optimizer step do not depend on how they are split: world 4 with no
    accumulation and world 2 accumulating 2 micro-steps train on the same rows (an elastic
    restart at a new world size keeps its data). With accumulation 1 this is the batch of
    `index` as before: rows rank*micro:(rank+1)*micro."""
    from zeroshard.models import global_batch

    x, y = global_batch(tokens, micro * accumulation, seq_len, index, world, seed)
    lo = (micro_step * world + rank) * micro
    return x[lo:lo + micro], y[lo:lo + micro]
