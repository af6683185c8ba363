"""One rank of one system of `zeroshard bench` (started by torchrun from `bench.launch`).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zeroshard.bench.worker JOB.json

JOB.json says the system, model, steps and shapes. Every system gets the same model (same
seed, built on every rank), the same batches (rank r's rows of each global batch), the same
optimizer and threads. Each step is timed on every rank from a barrier (issued through
zeroshard's comm layer on a ledger of the harness's own) to the end of its optimizer step, and
its forward, backward and optimizer step apart (the runner's `phases`), with the seconds a
zeroshard rank was blocked on its collectives in each (the runner's `waits`).
Peak RSS is the kernel's high-water mark over the measured steps (reset at the first one).
Each rank writes `rank<r>.json` beside JOB.json; `bench.results` merges them.
"""

from __future__ import annotations

import gc
import json
import os
import re
import resource
import sys
import time
import traceback

import torch

from zeroshard.bench.systems import SYSTEMS
from zeroshard.cli.train.data import rank_batch
from zeroshard.cli.train.model import build_model
from zeroshard.comm import Comm, CommLedger, setup_topology
from zeroshard.models import synthetic_tokens

__all__ = ["main", "run_job"]

TIMEOUT_S = 600.0
DATA_TOKENS = 400_000


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as fh:
            m = re.search(rf"{field}:\s+(\d+) kB", fh.read())
        return int(m.group(1)) if m else -1
    except OSError:
        return -1


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class _Barrier:
    def __init__(self, topology) -> None:
        self.comm = Comm(topology, CommLedger(topology.world_size), TIMEOUT_S)
        self._flag = torch.zeros(1, device=topology.device)

    def __call__(self) -> None:
        if self.comm.world_size > 1:
            self.comm.all_reduce(self._flag, what="zeroshard bench: step barrier").wait()


def _runner(job: dict, tm):
    system = SYSTEMS[job["system"]]
    if system.family == "zeroshard":
        from zeroshard.bench.engine import EngineRunner

        runner = EngineRunner(system, tm.module, tm.unit_classes, job["micro_batch"], job["bf16"],
                              job.get("scratch", ""))
        return runner, runner.topology
    topology = setup_topology(TIMEOUT_S)  # the default group every peer runs on
    from zeroshard.bench.peers import build_peer

    return build_peer(system, tm.module, tm.unit_classes, job["micro_batch"], job["bf16"], topology.device), topology


def _measure(job: dict) -> tuple[dict, object]:
    """Build, warm up, measure; returns (this rank's figures, the topology). Every object
    holding the process group (DDP's reducer, FSDP2's state, the engine) is local here and
    freed on return, while the group is still alive: a reducer freed after the group's
    destruction would destroy the gloo group in its own destructor, whose threads then wait
    for the GIL the destructor holds."""
    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    tm = build_model(job["model"])
    phi = sum(p.numel() for p in tm.module.parameters())
    started = time.perf_counter()
    runner, topology = _runner(job, tm)
    init_s = time.perf_counter() - started
    rank, world = topology.rank, topology.world_size
    barrier = _Barrier(topology)
    tokens = synthetic_tokens(DATA_TOKENS, tm.vocab_size, seed=job["seed"])
    warmup, steps = job["warmup"], job["steps"]
    times, phases, waits, losses, reset_ok = [], [], [], [], False
    for i in range(warmup + steps):
        x, y = rank_batch(tokens, job["micro_batch"], job["seq_len"], i, rank, world, job["seed"])
        x, y = x.to(topology.device), y.to(topology.device)
        if i == warmup:
            reset_ok = _reset_peak_rss()
            if hasattr(runner, "start_window"):
                runner.start_window()
        barrier()
        t0 = time.perf_counter()
        losses.append(runner.step(x, y))
        times.append(time.perf_counter() - t0)
        phases.append(runner.phases)
        waits.append(getattr(runner, "waits", None))  # zeroshard's and the floor's; peers' are inside their phases
    out = {"system": job["system"], "rank": rank, "world_size": world, "phi": phi, "label": tm.label,
           "threads": torch.get_num_threads(), "init_s": init_s, "step_times_s": times, "phases_s": phases, "waits_s": waits, "losses": losses,
           "warmup": warmup, "peak_rss_kib": _status_kib("VmHWM"), "peak_rss_reset": reset_ok,
           "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    if hasattr(runner, "ledgers"):
        out["ledgers"] = runner.ledgers(steps)
        out["config"] = runner.config
    x, y = rank_batch(tokens, job["micro_batch"], job["seq_len"], warmup + steps, rank, world, job["seed"])
    out["model_states"] = runner.model_states(x.to(topology.device), y.to(topology.device))
    if getattr(runner, "peak", None):  # FSDP2: its transients, sampled in that untimed step
        out["peer_peak"] = runner.peak
    barrier()
    runner.close()
    return out, topology


def run_job(job: dict) -> dict:
    out, topology = _measure(job)
    gc.collect()  # cycles through the peers' modules and optimizers, before the group goes
    if topology.owns_group:
        topology.destroy()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m zeroshard.bench.worker JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        job = json.load(fh)
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(os.path.dirname(os.path.abspath(argv[0])), f"rank{rank}.json")
    try:
        out = run_job(job)
    except Exception as exc:  # noqa: BLE001 - the parent reports it with the system's name
        with open(path + ".err", "w") as fh:
            fh.write(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        traceback.print_exc()
        return 1
    with open(path + ".tmp", "w") as fh:
        json.dump(out, fh)
    os.replace(path + ".tmp", path)  # the parent sees a rank's file whole or not at all
    return 0


if __name__ == "__main__":
    sys.exit(main())
