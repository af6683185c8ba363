"""issue 46: alternate two ways of moving gradients and parameters every step in one run (both
ranks alike), so the machine's drift lands on both; medians of wall and CPU per way.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/ab_reduce_path.py zs2 150M 6
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/ab_reduce_path.py zs3 50M 8 channel

Arguments: system (zs2 or zs3), model (as `zeroshard bench --model`), timed steps per way
(after 4 untimed), and what alternates: `pieces` (default: stage 2-3 gradients reduced from
where autograd left them, or through a filled bucket, the path NCCL and the cast / scaled
reductions take) or `channel` (comm/cma.py's intra-host copies, or gloo's TCP)."""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch.distributed as dist

sys.path.insert(0, "bench")  # step_phases.build: zeroshard bench's workload and config
import step_phases as sp  # noqa: E402
from zeroshard.cli.train.data import rank_batch  # noqa: E402
import zeroshard.comm.direct as direct  # noqa: E402
from zeroshard.stages.partitioned_gradients import PartitionedGradients  # noqa: E402

system, model, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
way = sys.argv[4] if len(sys.argv) > 4 else "pieces"
names = {"pieces": ("piecewise", "bucket"), "channel": ("channel", "tcp")}[way]
channel_on = {"on": True}
real_channel = direct.DirectCollectives._channel
direct.DirectCollectives._channel = lambda self: real_channel(self) if channel_on["on"] else (real_channel(self), None)[1]
rank, world, tm, tokens = sp.start(model)
forward, backward, step, _ = sp.build(system, tm, 4, {})
pg = [o for o in gc.get_objects() if isinstance(o, PartitionedGradients)]
assert pg, "no PartitionedGradients"
native = [list(o._piecewise) for o in pg]
rows = {True: [], False: []}
for s in range(4 + 2 * steps):
    mode = s % 2 == 0
    channel_on["on"] = mode or way != "channel"
    for o, n in zip(pg, native):
        o._piecewise = [x and (mode or way != "pieces") for x in n]
    inp, tgt = rank_batch(tokens, 4, 128, s, rank, world, 0)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    backward(forward(inp, tgt)); step()
    if s >= 4:
        rows[mode].append((time.perf_counter() - t0, time.process_time() - c0))
med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for m, v in rows.items()}
every = [None] * world
dist.all_gather_object(every, med)
if rank == 0:
    for r, m in enumerate(every):
        print(f"rank {r} {system} {model}: {names[0]} wall {m[True][0]:.3f} cpu {m[True][1]:.3f} | "
              f"{names[1]} wall {m[False][0]:.3f} cpu {m[False][1]:.3f} | ratio {m[True][0] / m[False][0]:.3f}")
dist.destroy_process_group()
