"""Where a zeroshard step's time goes, on two revisions side by side (issue 26's check that a
structural change left the step alone): the peer harness's workload (../shared/bench-peers),
2 gloo ranks x 1 thread, each revision from its own git worktree first on PYTHONPATH, the
order alternating every round.

    python bench/revision_phases.py --before 4af8b11 --after HEAD --rounds 8 --stage 2
    python bench/revision_phases.py --before 4af8b11 --after HEAD --rounds 1 --profile-step 3

Per run, medians over the timed steps and both ranks: the step (max over ranks, as the harness
counts it), forward, backward and step wall seconds, process CPU seconds (gloo's threads
included), minor page faults and system CPU per step, and seconds blocked in `Handle.wait()` by
what the collective was for. `--profile-step k` runs cProfile over step k on every rank and
prints the Python functions whose call counts differ between the revisions. Only the public API
and `Handle.wait` are touched, so any revision since the peer harness existed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "..", "shared", "bench-peers")
FIELDS = ("step", "fwd", "bwd", "opt", "cpu", "minflt", "sys")


def rank_main(out: str, stage: int, profile_step: int) -> None:
    import resource

    sys.path.insert(0, PEERS)
    import torch
    import torch.distributed as dist
    import workload as W

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import zeroshard
    import zeroshard.comm.collectives as collectives

    waits: dict[str, float] = {}
    original = collectives.Handle.wait

    def wait(handle) -> None:
        t = time.perf_counter()
        original(handle)
        what = getattr(handle, "_what", "")
        kind = what.split("(", 1)[1].split(" ")[0] if "(" in what else what
        waits[kind] = waits.get(kind, 0.0) + time.perf_counter() - t

    collectives.Handle.wait = wait
    spec = W.WorkloadSpec.from_env()
    cfg = {"train_micro_batch_size_per_gpu": spec.micro_batch, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": dict(lr=spec.lr, betas=list(spec.betas), eps=spec.eps,
                                                         weight_decay=spec.weight_decay)}}
    engine = zeroshard.initialize(W.build_model(spec), cfg)
    rows = []
    for step in range(spec.total_steps):
        inp, tgt = W.get_batch(spec, step, rank, world)
        dist.barrier()
        waits.clear()
        prof = None
        if step == profile_step:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        ru0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
        loss = W.loss_fn(engine(inp), tgt)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3, c1, ru1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{out}.rank{rank}.prof")
        rows.append({"step": t3 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "cpu": c1 - c0,
                     "minflt": ru1.ru_minflt - ru0.ru_minflt, "sys": ru1.ru_stime - ru0.ru_stime,
                     "loss": float(loss.detach()), **{f"wait {k}": v for k, v in waits.items()}})
    per_rank = [None] * world
    dist.all_gather_object(per_rank, rows)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"per_rank": per_rank, "warmup": spec.warmup_steps, "zeroshard": zeroshard.__file__}, f)
    dist.barrier()
    dist.destroy_process_group()


def worktree(commit: str) -> str:
    """A detached worktree of `commit` (made once; bench/run_revisions.sh uses the same ones)."""
    sha = subprocess.check_output(["git", "rev-parse", "--short", commit], cwd=ROOT, text=True).strip()
    tree = f"/tmp/zeroshard-rev-{sha}"
    if not os.path.isdir(tree):
        subprocess.check_call(["git", "worktree", "add", "--detach", tree, sha], cwd=ROOT,
                              stdout=subprocess.DEVNULL)
    return tree


def summarize(path: str) -> dict:
    d = json.load(open(path))
    runs, warm = d["per_rank"], d["warmup"]
    timed = range(warm, len(runs[0]))
    keys = sorted({k for rows in runs for row in rows for k in row if k.startswith("wait ")})
    out = {k: statistics.median(rows[i].get(k, 0.0) for rows in runs for i in timed) for k in (*FIELDS, *keys)}
    out["step"] = statistics.median(max(rows[i]["step"] for rows in runs) for i in timed)
    out["losses"] = [row["loss"] for row in runs[0]]
    return out


def call_counts(prof: str) -> dict:
    import pstats

    counts: dict = {}
    for (file, _, fn), (_, calls, *_rest) in pstats.Stats(prof).stats.items():
        where = re.sub(r".*/src/zeroshard/", "", file) if "/src/zeroshard/" in file else os.path.basename(file)
        fn = re.sub(r" at 0x[0-9a-f]+", "", fn)  # a built-in's address differs between processes
        counts[(where, fn)] = counts.get((where, fn), 0) + calls
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--model", default="50M")
    ap.add_argument("--profile-step", type=int, default=-1)
    ap.add_argument("--out", default="/tmp/revision_phases")
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)  # set on the ranks
    args = ap.parse_args()
    if args.rank_out:
        return rank_main(args.rank_out, args.stage, args.profile_step)
    os.makedirs(args.out, exist_ok=True)
    trees = {"before": worktree(args.before), "after": worktree(args.after)}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(1, args.rounds + 1):
        for side in ("after", "before") if r % 2 else ("before", "after"):
            out = os.path.join(args.out, f"r{r}_{side}.json")
            load = open("/proc/loadavg").read().split()[0]
            env = dict(os.environ, PYTHONPATH=os.path.join(trees[side], "src"), PEER_MODEL=args.model)
            subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", os.path.abspath(__file__),
                            "--before", args.before, "--stage", str(args.stage), "--profile-step",
                            str(args.profile_step), "--rank-out", out], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
            s = summarize(out)
            results[side].append(s)
            print(f"round {r} {side:6} (load {load}): " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items() if k != "losses"),
                flush=True)
    for side, runs in results.items():
        print(f"median {side:6}: " + ", ".join(
            f"{k} {statistics.median(r.get(k, 0.0) for r in runs):.3f}" for k in runs[0] if k != "losses"))
    ratios = [a["step"] / b["step"] for a, b in zip(results["after"], results["before"])]
    print("step after/before per round:", ", ".join(f"{x:.3f}" for x in ratios),
          f"(median {statistics.median(ratios):.3f})")
    print("losses identical:", all(a["losses"] == b["losses"] for a, b in zip(results["after"], results["before"])))
    if args.profile_step >= 0:
        before = call_counts(os.path.join(args.out, "r1_before.json.rank0.prof"))
        after = call_counts(os.path.join(args.out, "r1_after.json.rank0.prof"))
        print(f"python calls in step {args.profile_step}, rank 0: before {sum(before.values())}, "
              f"after {sum(after.values())}; differing:")
        for key in sorted(set(before) | set(after)):
            if before.get(key, 0) != after.get(key, 0):
                print(f"  {key[0]}:{key[1]}  {before.get(key, 0)} -> {after.get(key, 0)}")


if __name__ == "__main__":
    main()
