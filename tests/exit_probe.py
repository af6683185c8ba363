"""A plain `initialize()` script for the clean-exit checks: trains a few steps of a small MLP
on the process group it creates from torchrun's environment, then reports (rank 0, on
stdout) the threads this process still runs after the engine is done with the group.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/exit_probe.py [--no-close]

`--no-close` leaves the group to zeroshard's exit handler, as a script that forgets
`engine.close()` does; `--user-group` makes the default group in the script and reports
the gloo threads left at exit."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import zeroshard


def thread_names() -> list[str]:
    """Every OS thread of this process (Linux: /proc; elsewhere Python's own threads)."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        import threading

        return [t.name for t in threading.enumerate()]
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def gloo_threads() -> list[str]:
    return [n for n in thread_names() if "gloo" in n]


def train_a_little(stage: int = 2, steps: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    engine = zeroshard.initialize(model, {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    for _ in range(steps):
        loss = engine(torch.randn(4, 32)).square().mean()
        engine.backward(loss)
        engine.step()
    return engine


def _settled_count(threads, steady_s: float = 0.25, limit_s: float = 10.0) -> int:
    """How many `threads()` there are once the count has held for `steady_s`: a new gloo thread
    names itself after it starts (until then it carries the process's name), so a count taken
    right after the group's first collective missed one of the user's group's three once."""
    import time

    count, since, start = len(threads()), time.monotonic(), time.monotonic()
    while time.monotonic() - since < steady_s and time.monotonic() - start < limit_s:
        time.sleep(0.02)
        now = len(threads())
        if now != count:
            count, since = now, time.monotonic()
    return count


def _user_group_threads_at_exit() -> None:
    """`--user-group`: the script makes the default group itself (as accelerate does on CPU),
    so zeroshard runs on a group of its own; registered before zeroshard's exit handler, this
    runs after it and reports the gloo threads left beside those of the user's group."""
    import atexit

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    users = _settled_count(gloo_threads)
    rank = dist.get_rank()

    def report():
        if rank == 0:
            print(f"gloo threads at exit: {len(gloo_threads())} (the user's group: {users})", flush=True)

    atexit.register(report)


def main(argv: list[str]) -> int:
    if "--user-group" in argv:
        _user_group_threads_at_exit()
    engine = train_a_little(int(os.environ.get("PROBE_STAGE", "2")))
    if "--no-close" not in argv:
        engine.close()
        if engine.rank == 0:
            print(f"gloo threads after close: {len(gloo_threads())}", flush=True)
    print(f"rank {engine.rank} trained", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
