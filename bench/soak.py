"""Soak: the default `zeroshard train` job (GPT mini, ZeRO stage 3, 2 gloo ranks, seq 64, micro-batch
8) for 2,000 steps, a checkpoint saved and loaded back every 100 (`--reload-checkpoints`), each
rank's RSS / open files / threads / memory mappings logged after every checkpoint
(`--resource-log`). Prints every sample and the verdict per rank:

  warm-up     the samples before --warmup-step (default: the first quarter of the run) are
              not judged: the allocator and torch's pools grow to their working size there
  RSS         after warm-up, no sample more than --rss-rise-mib (default 16) above the first
              post-warm-up one (the least-squares slope per checkpoint is printed, not judged)
  files, threads   exactly the same count at every post-warm-up sample
  mappings    (lines of /proc/self/maps) at most --maps-rise (default 8) above the first one

Why those bounds: one rank's checkpoint of this job is 4.77 MiB (its stage-3 shard's fp32 master
1.59 MiB + AdamW states 3.18 MiB). A save or load that kept what it wrote or read would add that
per checkpoint: 72 MiB over the 15 judged ones (16 MiB is a leak of a quarter of that, ~1.1 MiB
per checkpoint). What the allocator does without a leak: RSS moves in steps of 2-3 MiB (glibc
heap and mmap chunks) and settles; the 2,000-step run in bench/RESULTS.md rose 5.8 MiB at most.
A file, thread or mapping left open per save or per load adds one per checkpoint, 15 or more;
the allocator's own new mmap chunks added 2 over the judged samples.

    python bench/soak.py [--steps 2000] [--every 100] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MiB = 2**20


def run_soak(steps: int, every: int, root: str, extra: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    log = os.path.join(root, "resources")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", "--steps", str(steps), "--save",
           os.path.join(root, "ckpt"), "--save-every", str(every), "--reload-checkpoints", "--resource-log", log,
           "--report", "", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root), log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100, help="steps between save + load")
    parser.add_argument("--warmup-step", type=int, help="first judged step (default steps // 4)")
    parser.add_argument("--rss-rise-mib", type=float, default=16.0)
    parser.add_argument("--maps-rise", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where to write (a temporary directory is made inside)")
    parser.add_argument("--json", help="write the samples and verdicts here")
    parser.add_argument("train_args", nargs="*", help="more `zeroshard train` options (after --)")
    args = parser.parse_args()
    warmup = args.warmup_step if args.warmup_step is not None else args.steps // 4

    from zeroshard.cli.train.resources import judge, read_log

    root = tempfile.mkdtemp(prefix="zeroshard-soak-", dir=args.dir)
    started = time.perf_counter()
    try:
        proc, log = run_soak(args.steps, args.every, root, args.train_args)
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
            print(f"soak: zeroshard train exited {proc.returncode}", file=sys.stderr)
            return 1
        ranks = read_log(log)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"soak: zeroshard train --steps {args.steps} --save-every {args.every} --reload-checkpoints "
          f"{' '.join(args.train_args)} ({seconds:.0f} s wall)")
    print(f"{'step':>6} " + " ".join(f"{'r%d RSS MiB' % r:>12} {'fds':>4} {'thr':>4} {'maps':>5}" for r in ranks))
    steps = [row["step"] for row in ranks[0]]
    for i, step in enumerate(steps):
        cells = []
        for r in ranks:
            row = ranks[r][i]
            cells.append(f"{row['rss_bytes'] / MiB:>12.1f} {row['open_fds']:>4} {row['threads']:>4} "
                         f"{row.get('mappings', 0):>5}")
        print(f"{step:>6} " + " ".join(cells) + ("  " + ranks[0][i]["event"] if ranks[0][i]["event"] != "checkpoint"
                                                  else ""))
    verdicts, ok = {}, True
    for r, rows in ranks.items():
        d, problems = judge(rows, warmup, int(args.rss_rise_mib * MiB), args.maps_rise)
        verdicts[r] = {"drift": d, "problems": problems}
        ok &= not problems
        print(f"rank {r}: steps {d['from_step']}-{d['to_step']} ({d['samples']} samples): RSS "
              f"{d['rss_first'] / MiB:.1f} -> {d['rss_last'] / MiB:.1f} MiB, max rise {d['rss_rise'] / MiB:.1f} MiB, "
              f"slope {d['rss_slope'] / MiB:+.3f} MiB/checkpoint; fds {d['open_fds'][0]}->{d['open_fds'][1]}, "
              f"threads {d['threads'][0]}->{d['threads'][1]}, mappings {d['mappings'][0]}->{d['mappings'][1]}: "
              + ("FLAT" if not problems else "; ".join(problems)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "every": args.every, "warmup_step": warmup, "seconds": seconds,
                       "samples": ranks, "verdicts": verdicts}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
