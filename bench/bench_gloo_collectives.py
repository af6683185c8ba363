"""Benchmark: one bucket's all-gather and reduce-scatter on gloo, torch's own vs zeroshard's Comm.

    torchrun --standalone --nproc_per_node 2 bench/bench_gloo_collectives.py            # 25 MiB fp32
    torchrun --standalone --nproc_per_node 2 bench/bench_gloo_collectives.py --mib 100

torch's gloo `all_gather_into_tensor` gathers into a new flat tensor and copies every chunk
out on gloo's thread; its `reduce_scatter_tensor` all-reduces a clone of the whole input.
zeroshard's `Comm` sends each chunk straight to the rank that needs it (point-to-point,
tagged). The last row copies what each collective brings into this rank ((N-1)/N of the
tensor) within the process: the floor of any transfer on this machine. Each row: the same
tensor, 3 warm-up and --reps timed calls issued and waited one at a time, one intra-op thread
per rank; wall time per call (median over rounds of the mean of --reps calls, spread min-max)
and this process's CPU time per call (all threads, os.times). Rounds alternate the variants so drift of the machine lands on each alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=25.0, help="bucket size in MiB of fp32 (default 25: DDP's)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from zeroshard.comm import Comm, CommLedger, setup_topology
    from zeroshard.partition import MemoryLedger
    from zeroshard.partition.buffer_pool import BufferPool
    import torch.distributed as dist

    # torch's own collectives, timed beside zeroshard's (a benchmark may call them; src/ may not)
    _AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    topology = setup_topology(120.0)
    # scratch from a BufferPool as the engine's Comm has it (a fresh receive buffer each call re-faults)
    comm = Comm(topology, CommLedger(topology.world_size), 120.0, pool=BufferPool(MemoryLedger()))
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = int(args.mib * 2**20 / 4) // n * n
    shard = numel // n
    full = torch.randn(numel)
    out = torch.empty(shard)
    received = torch.empty((n - 1) * shard)

    variants = {
        "all-gather, torch gloo": lambda: _AG(
            full, full[rank * shard:(rank + 1) * shard], async_op=True).wait(),
        "all-gather, zeroshard": lambda: comm.all_gather(full, full[rank * shard:(rank + 1) * shard]).wait(),
        "reduce-scatter, torch gloo": lambda: _RS(out, full, async_op=True).wait(),
        "reduce-scatter, zeroshard": lambda: comm.reduce_scatter(out, full).wait(),
        # the bytes either collective brings into this rank, copied within the process: no
        # collective moves them faster on this machine (cross-process reads cost more per byte)
        "local copy of the same bytes": lambda: torch.cat([full[p * shard:(p + 1) * shard] for p in range(n) if p != rank],
                                                          out=received),
    }
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, call in variants.items():
            for _ in range(3):
                call()
            dist.barrier()
            c0, t0 = _cpu(), time.perf_counter()
            for _ in range(args.reps):
                call()
            dist.barrier()
            wall[name].append((time.perf_counter() - t0) / args.reps * 1e3)
            cpu[name].append((_cpu() - c0) / args.reps * 1e3)
    if rank == 0:
        print(f"gloo, {n} ranks, one {numel * 4 / 2**20:.1f} MiB fp32 bucket, {args.rounds} rounds x "
              f"{args.reps} calls, torch {torch.__version__}\n")
        print("| collective | wall ms / call (spread) | CPU ms / call, rank 0 (spread) |")
        print("|---|---|---|")
        for name in variants:
            w, c = wall[name], cpu[name]
            print(f"| {name} | {statistics.median(w):.1f} ({min(w):.1f}-{max(w):.1f}) | "
                  f"{statistics.median(c):.1f} ({min(c):.1f}-{max(c):.1f}) |")
    topology.destroy()


if __name__ == "__main__":
    main()
