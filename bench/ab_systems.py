"""issue 46: the compute floor and zeroshard's stages step by step in one run, so the machine's
drift (which moves single harness runs by 10-20 % here) lands on every system alike.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/ab_systems.py 150M 6 floor,zs2,zs3

Arguments: model (as `zeroshard bench --model`), timed steps per system (after 2 untimed rounds),
systems (comma-separated: `floor` and any `zeroshard bench` system of zeroshard's family;
`+compile` after a name compiles it as the peer harness's PEER_COMPILE=1 does: the floor's blocks
each compiled in place, zeroshard's `engine.compile()`; `@` and a JSON object after a zeroshard
system add those zero_optimization keys: 'zs3_defaults@{"memory_efficient_linear": false}'). Each
system has its own copy of the model (same initial weights); one step of each in turn, the order
rotating every round. `floor` is ../shared/bench-peers' compute floor: forward and backward with
no collectives, gradients kept in place, torch AdamW(fused) over this rank's ~1/N of the
parameters (whole tensors, balanced by size). Prints, per rank, the median wall and CPU seconds
per step of each system (CPU: of all the process's threads, and of the main thread alone; the rest
is gloo's and the intra-host copy thread's; system CPU of all threads), minor page faults, the
cyclic garbage collector's seconds (mean: most steps have none), and its ratio to the first
system's median. Every system is resident at once: at 150M, floor + zs2 + zs3 take about 9 GiB per
rank. They share one glibc heap, which each engine also trims (after its first step and on 5 %
growth), so a system's page faults can depend on its neighbours: zs3_defaults at 150M took
74,000-96,000 a step beside zs2 and a zs3 without memory_efficient_linear (which took 1,900-5,200),
and 2,500-11,000 in a process of its own with either setting (bench/RESULTS.md, session 50; the
cause was not found). Compare page-fault-bound systems in the peer harness too.
"""

from __future__ import annotations

import copy
import gc
import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, "bench")  # step_phases.build: zeroshard bench's workload and config
import step_phases as sp  # noqa: E402
from zeroshard.bench.peers import AdamW, floor_share  # noqa: E402
from zeroshard.cli.train.data import rank_batch  # noqa: E402


def floor(module: torch.nn.Module, rank: int, world: int):
    """(step function) the harness's floor over `module` (`zeroshard bench`'s `floor` system)."""
    opt = torch.optim.AdamW(floor_share(module, rank, world), fused=True, **AdamW.kwargs())

    def one(x, y):
        module(x, y)[1].backward()
        opt.step()
        module.zero_grad(set_to_none=False)
    return one


class GcClock:
    """Seconds the cyclic garbage collector ran (all generations), through `gc.callbacks`."""

    def __init__(self) -> None:
        self.seconds, self._t = 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t


def main() -> None:
    model, steps = sys.argv[1], int(sys.argv[2])
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["floor", "zs2", "zs3"]
    rank, world, tm, tokens = sp.start(model)
    runs = {}
    for name in names:
        mine = copy.copy(tm)
        mine.module = copy.deepcopy(tm.module)
        spec, _, extra = name.partition("@")
        system, compiled = spec.removesuffix("+compile"), spec.endswith("+compile")
        if system == "floor":
            if compiled:
                for unit in [m for m in mine.module.modules() if type(m).__name__ in tm.unit_classes]:
                    unit.compile()  # the harness's way: each block in place
            runs[name] = floor(mine.module, rank, world)
        else:
            forward, backward, step, _ = sp.build(system, mine, 4, json.loads(extra or "{}"), compiled)
            runs[name] = lambda x, y, f=forward, b=backward, s=step: (b(f(x, y)), s())
    rows: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
    gc_clock = GcClock()
    for r in range(2 + steps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            inp, tgt = rank_batch(tokens, 4, 128, r, rank, world, 0)
            dist.barrier()
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            t0, c0, m0, g0 = time.perf_counter(), time.process_time(), time.thread_time(), gc_clock.seconds
            runs[name](inp, tgt)
            t1, c1, m1, g1 = time.perf_counter(), time.process_time(), time.thread_time(), gc_clock.seconds
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            if r >= 2:
                rows[name].append((t1 - t0, c1 - c0, m1 - m0, u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt,
                                   g1 - g0))
    med = {n: [statistics.median(x[i] for x in v) for i in range(5)] + [statistics.mean(x[5] for x in v)]
           + [min(x[0] for x in v), max(x[0] for x in v)] for n, v in rows.items()}
    every = [None] * world
    dist.all_gather_object(every, med)
    if rank == 0:
        print(f"{model}, {steps} steps per system, alternating; medians per rank (s), ratio to {names[0]}")
        print("| rank | system | wall | spread | CPU, all threads | main thread | system CPU | page faults "
              "| gc | wall / " + names[0] + " |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for r, m in enumerate(every):
            for n in names:
                w, c, main, sys_cpu, faults, gc_s, lo, hi = m[n]
                print(f"| {r} | {n} | {w:.3f} | {lo:.3f}-{hi:.3f} | {c:.3f} | {main:.3f} | {sys_cpu:.3f} | {faults:.0f} "
                      f"| {gc_s:.3f} | {w / m[names[0]][0]:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
