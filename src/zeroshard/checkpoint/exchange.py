"""Small agreements between ranks during save and load, over the engine's Comm (so the
ledger sees them): exchange JSON records, and fail on every rank when one rank failed.

A rank that hits an error keeps taking part in these exchanges, reporting the error
instead of its record; so a full disk or a damaged file on one rank becomes the same
clear error on every rank instead of a hang in the next collective.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

import torch

from zeroshard.policies import CheckpointError


def all_records(comm, record: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Every rank's `record`, in rank order, on every rank (two collectives)."""
    if comm.world_size == 1:
        return [json.loads(json.dumps(record))]
    data = json.dumps(record).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.all_reduce(size, op="max", what="checkpoint record size").wait()
    width = int(size.item())
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = torch.empty(width * comm.world_size, dtype=torch.uint8, device=device)
    comm.all_gather(every, mine, what="checkpoint records").wait()
    raw = every.cpu().numpy().tobytes()
    return [json.loads(raw[r * width : (r + 1) * width].rstrip(b"\0")) for r in range(comm.world_size)]


def agree(comm, error: BaseException | None, device: torch.device, doing: str) -> None:
    """Raise on every rank if any rank passes an error: its own, or the first failing rank's."""
    records = all_records(comm, {"error": None if error is None else str(error)}, device)
    failed = [(r, rec["error"]) for r, rec in enumerate(records) if rec["error"] is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise CheckpointError(f"{doing} failed on rank {rank}{others}: {message}")


@contextlib.contextmanager
def agreed(comm, device: torch.device, doing: str) -> Iterator[None]:
    """`agree` on the outcome of the block: an error in it, on any rank, is raised on every rank
    as the block ends (this rank's own, or the first failing rank's)."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
    agree(comm, error, device, doing)
