"""Where a step's time goes, per rank: DDP or a zeroshard stage on the peer harness' workload.

    torchrun --standalone --nproc_per_node 2 bench/step_phases.py --system zs2
    torchrun --standalone --nproc_per_node 2 bench/step_phases.py --system ddp
    PEER_MODEL=150M PEER_STEPS=6 torchrun ... bench/step_phases.py --system zs3 --zero '{"reduce_bucket_size": 3e6}'

Per rank, medians over the timed steps (the workload's PEER_* variables: model, warm-up and
timed steps): wall and process CPU seconds (all threads, gloo's included) of forward (with the
loss), backward and the optimizer step; minor page faults and system CPU per step; and for
zeroshard the seconds per step spent blocked in each kind of collective's `wait()` (gradient
reductions, parameter gathers, the gradient norm), which is where a rank waits for its peer or
for communication that did not overlap. `--trace` prints every wait of the last step with its
time from the start of the step. The same barrier before every step as the harness; nothing
here is compared across systems, it explains one system's step (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.environ.get("PEERS", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench-peers")))
import workload as W  # noqa: E402  (the peer harness' workload: model, data, loss, AdamW settings)


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
            what = handle._what
            kind = what.split("(", 1)[1].split(" ")[0] if "(" in what else what
            clock.seconds[kind] = clock.seconds.get(kind, 0.0) + took
            clock.trace.append((t - clock.start, took, what))

        collectives.Handle.wait = wait


def build(system: str, spec, zero_extra: dict):
    """(forward, backward, step, wait clock or None) for `system`."""
    model = W.build_model(spec)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(ddp.parameters(), **W.adamw_kwargs(spec), fused=True)
        return ddp, lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()), None
    import zeroshard

    cfg = {"train_micro_batch_size_per_gpu": spec.micro_batch, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": int(system[2:]), **zero_extra},
           "optimizer": {"type": "AdamW", "params": dict(lr=spec.lr, betas=list(spec.betas), eps=spec.eps,
                                                       weight_decay=spec.weight_decay)}}
    engine = zeroshard.initialize(model, cfg)
    return engine, engine.backward, engine.step, WaitClock()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default="zs2", choices=["ddp", "zs0", "zs1", "zs2", "zs3"])
    ap.add_argument("--zero", default="{}", help="extra zero_optimization keys for zeroshard, as JSON")
    ap.add_argument("--trace", action="store_true", help="print every wait of the last step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = W.WorkloadSpec.from_env()
    forward, backward, step, clock = build(args.system, spec, json.loads(args.zero))
    rows = []
    for s in range(spec.total_steps):
        inp, tgt = W.get_batch(spec, s, rank, world)
        dist.barrier()
        if clock is not None:
            if s == spec.warmup_steps:
                clock.seconds.clear()
            clock.trace.clear()
        marks = [(time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF))]
        if clock is not None:
            clock.start = marks[0][0]
        loss = W.loss_fn(forward(inp), tgt)
        marks.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)))
        backward(loss)
        marks.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)))
        step()
        marks.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)))
        if s >= spec.warmup_steps:
            (w0, c0, r0), end = marks[0], marks[-1]
            rows.append([b[0] - a[0] for a, b in zip(marks, marks[1:])] + [end[0] - w0]
                        + [b[1] - a[1] for a, b in zip(marks, marks[1:])] + [end[1] - c0]
                        + [end[2].ru_minflt - r0.ru_minflt, end[2].ru_stime - r0.ru_stime])
    med = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
    waits = {k: v / spec.timed_steps for k, v in clock.seconds.items()} if clock is not None else {}
    every = [None] * world
    dist.all_gather_object(every, (med, waits, clock.trace if (clock is not None and args.trace) else []))
    if rank == 0:
        print(f"{args.system}, {spec.timed_steps} timed steps, medians per rank (seconds)")
        print("| rank | wall fwd | bwd | step | total | CPU fwd | bwd | step | total | page faults | sys CPU | "
              "blocked in wait() per step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r, (m, w, _) in enumerate(every):
            blocked = ", ".join(f"{k} {v:.3f}" for k, v in sorted(w.items())) or "-"
            print(f"| {r} | " + " | ".join(f"{x:.3f}" for x in m[:8]) + f" | {m[8]:.0f} | {m[9]:.3f} | {blocked} |")
        for r, (_, _, trace) in enumerate(every):
            if trace:
                print(f"\nrank {r}, last step: seconds from its start, seconds waited, collective")
                for t, took, what in trace:
                    print(f"  {t:7.3f} {took:7.3f}  {what}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
