"""Where a step's time goes, per rank: DDP or a zeroshard stage on `zeroshard bench`'s workload.

    torchrun --standalone --nproc_per_node 2 bench/step_phases.py --system zs2
    torchrun --standalone --nproc_per_node 2 bench/step_phases.py --system ddp
    torchrun ... bench/step_phases.py --model 150M --steps 6 --system zs3 --zero '{"reduce_bucket_size": 3e6}'

Per rank, medians over the timed steps (the workload, systems and AdamW of zeroshard.bench, as
`zeroshard bench` runs them: --model, --warmup, --steps, --micro-batch, --seq-len): wall and
process CPU seconds (all threads, gloo's included) of forward (with the loss), backward and the
optimizer step; minor page faults per step (and per phase) and system CPU per step; and for zeroshard the seconds per
step spent blocked in each kind of collective's `wait()` (gradient reductions, parameter
gathers, the gradient norm), which is where a rank waits for its peer or for communication
that did not overlap. `--trace` prints every wait of the last step with its time from the start
of the step. The same barrier before every step as the harness; nothing here is compared
across systems, it explains one system's step (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

from zeroshard.bench import peers
from zeroshard.bench.command import model_spec
from zeroshard.bench.engine import bench_config
from zeroshard.bench.systems import SYSTEMS
from zeroshard.bench.worker import DATA_TOKENS
from zeroshard.cli.train.data import rank_batch
from zeroshard.cli.train.model import build_model
from zeroshard.models import synthetic_tokens


class WaitClock:
    """Seconds blocked in `Handle.wait()`, by what the collective was for."""

    def __init__(self) -> None:
        import zeroshard.comm.collectives as collectives

        self.seconds: dict[str, float] = {}
        self.trace: list[tuple[float, float, str]] = []
        self.start = 0.0
        original = collectives.Handle.wait
        clock = self

        def wait(handle) -> None:
            t = time.perf_counter()
            original(handle)
            took = time.perf_counter() - t
            what = handle.what
            kind = what.split("(", 1)[1].split(" ")[0] if "(" in what else what
            clock.seconds[kind] = clock.seconds.get(kind, 0.0) + took
            clock.trace.append((t - clock.start, took, what))

        collectives.Handle.wait = wait


def start(model: str, seed: int = 0):
    """(rank, world, model, tokens): one torch thread, the gloo group, `zeroshard bench`'s model
    `model` and its synthetic tokens, seeded alike on every rank (also for bench/ab_*.py)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(seed)
    tm = build_model(model_spec(model))
    return dist.get_rank(), dist.get_world_size(), tm, synthetic_tokens(DATA_TOKENS, tm.vocab_size, seed=seed)


def build(system: str, tm, micro_batch: int, zero_extra: dict, compiled: bool = False):
    """(forward(x, y) -> loss, backward, step, wait clock or None) for `system`: zeroshard bench's;
    `compiled`: zeroshard's `engine.compile()` (the peer harness's PEER_COMPILE=1)."""
    if system == "ddp":
        runner = peers.build_peer(SYSTEMS["ddp"], tm.module, tm.unit_classes, micro_batch, False, torch.device("cpu"))
        def step():  # as PeerRunner.step: the update, then the gradients freed
            runner.optimizer.step()
            runner.optimizer.zero_grad(set_to_none=True)

        return lambda x, y: runner.wrapper(x, y)[1], lambda loss: loss.backward(), step, None
    import zeroshard

    cfg = bench_config(SYSTEMS[system], micro_batch, False, tm.unit_classes, "")
    cfg["zero_optimization"].update(zero_extra)
    engine = zeroshard.initialize(tm.module, cfg)
    if compiled:
        engine.compile()
    return lambda x, y: engine(x, y)[1], engine.backward, engine.step, WaitClock()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default="zs2", choices=["ddp", "zs0", "zs1", "zs2", "zs3", "zs3_defaults"])
    ap.add_argument("--zero", default="{}", help="extra zero_optimization keys for zeroshard, as JSON")
    ap.add_argument("--trace", action="store_true", help="print every wait of the last step")
    ap.add_argument("--model", default="50M", help="as `zeroshard bench --model` (default 50M)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per rank per step (default 4)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rank, world, tm, tokens = start(args.model, args.seed)
    forward, backward, step, clock = build(args.system, tm, args.micro_batch, json.loads(args.zero))
    rows = []
    for s in range(args.warmup + args.steps):
        inp, tgt = rank_batch(tokens, args.micro_batch, args.seq_len, s, rank, world, args.seed)
        dist.barrier()
        if clock is not None:
            if s == args.warmup:
                clock.seconds.clear()
            clock.trace.clear()
        marks = [(time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF))]
        if clock is not None:
            clock.start = marks[0][0]
        loss = forward(inp, tgt)
        marks.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)))
        backward(loss)
        marks.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)))
        step()
        marks.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)))
        if s >= args.warmup:
            (w0, c0, r0), end = marks[0], marks[-1]
            rows.append([b[0] - a[0] for a, b in zip(marks, marks[1:])] + [end[0] - w0]
                        + [b[1] - a[1] for a, b in zip(marks, marks[1:])] + [end[1] - c0]
                        + [end[2].ru_minflt - r0.ru_minflt, end[2].ru_stime - r0.ru_stime]
                        + [b[2].ru_minflt - a[2].ru_minflt for a, b in zip(marks, marks[1:])])
    med = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
    waits = {k: v / args.steps for k, v in clock.seconds.items()} if clock is not None else {}
    every = [None] * world
    dist.all_gather_object(every, (med, waits, clock.trace if (clock is not None and args.trace) else []))
    if rank == 0:
        print(f"{args.system}, {args.steps} timed steps, medians per rank (seconds)")
        print("| rank | wall fwd | bwd | step | total | CPU fwd | bwd | step | total | page faults (fwd/bwd/step) "
              "| sys CPU | blocked in wait() per step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r, (m, w, _) in enumerate(every):
            blocked = ", ".join(f"{k} {v:.3f}" for k, v in sorted(w.items())) or "-"
            print(f"| {r} | " + " | ".join(f"{x:.3f}" for x in m[:8]) + f" | {m[8]:.0f} ({m[10]:.0f}/{m[11]:.0f}/{m[12]:.0f})"
                  f" | {m[9]:.3f} | {blocked} |")
        for r, (_, _, trace) in enumerate(every):
            if trace:
                print(f"\nrank {r}, last step: seconds from its start, seconds waited, collective")
                for t, took, what in trace:
                    print(f"  {t:7.3f} {took:7.3f}  {what}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
