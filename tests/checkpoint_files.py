"""Reading a checkpoint tag's files back for tests that compare two runs bit for bit."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def checkpoint_tensors(tag_dir) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank file's tensors (fp32 master shards, optimizer states) of one checkpoint tag."""
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith(".safetensors"))
    assert files, f"no rank files in {tag_dir}"
    return {f: load_file(os.path.join(tag_dir, f)) for f in files}


def assert_bit_equal(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert a.keys() == b.keys()
    for f in a:
        assert a[f].keys() == b[f].keys(), f
        for k in a[f]:
            assert a[f][k].dtype == b[f][k].dtype and a[f][k].shape == b[f][k].shape, (f, k)
            # bit for bit: the raw bytes, so -0.0 vs 0.0 or two NaN payloads would differ too
            assert torch.equal(a[f][k].reshape(-1).view(torch.uint8), b[f][k].reshape(-1).view(torch.uint8)), (
                f"{f} {k}: {(a[f][k] != b[f][k]).sum().item()} of {a[f][k].numel()} elements differ")


def client_state(tag_dir) -> dict:
    with open(os.path.join(tag_dir, "meta.json")) as f:
        return json.load(f)["client_state"]
