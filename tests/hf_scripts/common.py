"""What the Hugging Face scripts share: a tiny GPT-2 built from a config, and generated data.

Nothing is downloaded: the model is `GPT2LMHeadModel(config)` with seeded weights, the
data are token sequences made by a seeded generator (arithmetic runs mod the vocabulary,
so there is something to learn). Dropout is off so that two libraries running the same
steps see the same numbers.
"""

from __future__ import annotations

import json

import torch

VOCAB, SEQ, SAMPLES = 96, 16, 64


def gpt2_config(width: int = 64, layers: int = 2):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=width, n_layer=layers, n_head=4, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager")


def token_rows(n: int = SAMPLES, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = SAMPLES, seed: int = 0) -> None:
        self.rows = token_rows(n, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def probe_batch() -> dict:
    rows = token_rows(8, seed=1)
    return {"input_ids": rows, "labels": rows}


def report(**fields) -> None:
    """One `RESULT {json}` line (the tests read these)."""
    print("RESULT " + json.dumps(fields), flush=True)
