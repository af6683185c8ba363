"""Run a function on N real ranks (gloo process group), with a hard timeout: the one rank
spawner of the test suite (tests/distributed.py) and the scripts in bench/.

Each rank is a spawned process with torchrun's environment variables set, so the code under
test creates (or finds) the process group exactly as it does under torchrun. A rank that
raises fails the call with its traceback (its peers, stuck in a collective with it, get
FAILED_PEER_GRACE_S to report, then are killed); a rank that dies without reporting fails it
within a second; ranks that hang are killed after `timeout` seconds and the call fails instead
of freezing CI. Imports nothing of zeroshard (`--help` stays fast).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from queue import Empty as queue_empty
from typing import Any, Callable

FAILED_PEER_GRACE_S = 30.0  # after a rank fails, how long the others may take to report
# What a forkserver imports once for all the ranks it forks: torch's import is most of a rank's
# start. torch._dynamo: zeroshard imports it before it makes a group (comm.topology), ~0.9 s of
# CPU per rank otherwise (rank CPU 1.08 -> 0.17 s). GPT-2's transformers module: the suite's
# Hugging Face ranks (oracle, generation, LoRA, export) paid ~2.3 s each for it. A module that
# is not installed is skipped by multiprocessing. frozen_heap last: it keeps the forked ranks'
# garbage collections off the objects those imports made (each rank copied their pages).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zeroshard.api.initialize",
                      "transformers.models.gpt2.modeling_gpt2", "zeroshard.bench.frozen_heap"]

__all__ = ["free_port", "from_wire", "rank_entry", "run_ranks", "start_context", "to_wire"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_wire(obj):
    """Tensors travel as numpy arrays: pickled by value, not by shared-memory handles
    that die with the child process."""
    import torch

    if torch.is_tensor(obj):
        t = obj.detach().cpu()
        return ("__tensor__", (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy(), str(t.dtype))
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_wire(v) for v in obj)
    return obj


def from_wire(obj):
    import torch

    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "__tensor__":
        t = torch.from_numpy(obj[1])
        return t.to(getattr(torch, obj[2].replace("torch.", "")))
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_wire(v) for v in obj)
    return obj


def rank_entry(fn, rank, world_size, port, args, queue, env, parent_env=None) -> None:
    """A started rank: the parent's environment as it was at the call (a forkserver child
    would otherwise have the server's), torchrun's variables, one torch thread
    (ZEROSHARD_RANK_THREADS: more, for the tests' second numerics configuration in .ci/run),
    fn's result or error to `queue`."""
    if parent_env is not None:
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(int(os.environ.get("ZEROSHARD_RANK_THREADS", "1")))
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, True, to_wire(result)))
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def start_context(start: str):
    """`spawn`: a fresh interpreter per rank (what the benchmarks use: nothing inherited).
    `forkserver`: ranks forked from one server process that imported torch and zeroshard once,
    ~0.5 s per rank instead of the seconds a fresh `import torch` takes (the test suite)."""
    if start not in ("spawn", "forkserver"):
        raise ValueError(f"run_ranks(start={start!r}): 'spawn' or 'forkserver'")
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 240,
              env: dict[str, str] | None = None, allow_failures: bool = False,
              grace: float = FAILED_PEER_GRACE_S, start: str = "spawn") -> list[Any]:
    """fn(rank, world_size, *args) on each rank; returns the per-rank results in rank order.

    With `allow_failures`, a rank's exception text is returned in place of its result (every
    rank gets `timeout`); without, the others get `grace` seconds after the first failure.
    `start`: how ranks start (`start_context`); either way each rank sees the caller's environment
    of the moment, plus `env`."""
    ctx = start_context(start)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_entry, args=(fn, r, world_size, port, args, queue, env or {}, dict(os.environ)),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    reported: set[int] = set()  # ranks that put their outcome on the queue: they are on their way out
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            if failures and not allow_failures:  # its peers hang in a collective: give them a grace, not `timeout`
                deadline = min(deadline, time.monotonic() + grace)
            try:
                rank, ok, value = queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                (results if ok else failures)[rank] = from_wire(value) if ok else value
                reported.add(rank)
                continue
            except queue_empty:
                pass
            for r, p in enumerate(procs):  # died without a word (a signal, os._exit): the queue is drained first
                if r not in results and r not in failures and p.exitcode is not None and queue.empty():
                    failures[r] = f"exited with code {p.exitcode} without reporting a result"
            if time.monotonic() >= deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                if failures and not allow_failures:
                    failures.update({r: f"killed: no result {grace:.0f}s after a peer failed" for r in missing})
                    break
                raise AssertionError(f"ranks {missing} did not finish within {timeout}s (hang?)")
    finally:
        for r, p in enumerate(procs):  # a rank that never reported is stuck: killed at once
            p.join(timeout=10 if r in reported else 0.1)
            if p.is_alive():
                p.kill()
    if failures and not allow_failures:
        raise AssertionError("\n".join(f"rank {r} failed: {t}" for r, t in sorted(failures.items())))
    merged = {**results, **failures}
    return [merged[r] for r in range(world_size)]
