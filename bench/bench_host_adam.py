#!/usr/bin/env python
"""Host Adam: zeroshard's CPU optimizer step beside DeepSpeedCPUAdam (issue 10).

    python bench/bench_host_adam.py                       # 100M elements, threads 1 and 2, 3 rounds
    python bench/bench_host_adam.py --n 20000000 --rounds 5 --threads 1

zeroshard steps host-resident fp32 masters with the kernel `zeroshard.optim.build_optimizer`
picks for the CPU (torch's fused AdamW), one step per sub-group of `--sub-group` elements, the
way `ShardedOptimizer` does. DeepSpeedCPUAdam (adamw_mode=True, its AVX kernel, JIT-built)
steps the same tensors the same way, when deepspeed imports. Same hyper-parameters, same
threads (OMP_NUM_THREADS and torch.set_num_threads), same elements, a fresh process per
measurement, the two systems alternating (A B, B A, ...) over `--rounds` rounds so drift on a
shared machine falls on both. Each process does 2 warm-up + 5 timed steps; a row reports the
median over all its timed steps and the min-max spread. Throughput ratio = DeepSpeed's median
step time / zeroshard's (>= 1 means zeroshard's step is at least as fast).

Bytes model as `../shared/bench-peers/micro_adam.py`: p, g, m, v read and p, m, v written in
fp32, 28 bytes per element.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BYTES_PER_ELEMENT = 28
SYSTEMS = ("zeroshard", "deepspeed")


def _tensors(n: int, sub_group: int):
    import torch

    torch.manual_seed(0)
    sizes = [min(sub_group, n - lo) for lo in range(0, n, sub_group)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in sizes]
    for p in params:
        p.grad = torch.randn(p.numel()) * 1e-3
    return params


def _optimizer(system: str, params):
    kw = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if system == "zeroshard":
        from zeroshard.optim.factory import build_optimizer, optimizer_kernel
        from zeroshard.policies.settings import OptimizerSpec

        opt = build_optimizer(OptimizerSpec("adamw", kw), params, "cpu")
        return opt, f"torch.optim.AdamW ({optimizer_kernel(opt)})"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **kw), "deepspeed.ops.adam.DeepSpeedCPUAdam"


def one(system: str, n: int, sub_group: int, threads: int, warmup: int = 2, steps: int = 5) -> dict:
    """Time `steps` optimizer steps in this process (after `warmup`), one call per sub-group."""
    import torch

    torch.set_num_threads(threads)
    params = _tensors(n, sub_group)
    opt, kernel = _optimizer(system, params)
    grads = [p.grad for p in params]
    times = []
    for i in range(warmup + steps):
        started = time.perf_counter()
        for p, g in zip(params, grads):  # ShardedOptimizer: only this sub-group has a gradient
            for q in params:
                q.grad = None
            p.grad = g
            opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return {"system": system, "kernel": kernel, "threads": torch.get_num_threads(), "n": n,
            "sub_group": sub_group, "times_s": times}


def _run(system: str, args, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu")
    cmd = [sys.executable, __file__, "--one", system, "--n", str(args.n), "--sub-group", str(args.sub_group),
           "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"system": system, "threads": threads, "error": " | ".join(tail) or f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=100_000_000, help="elements stepped (default 100M)")
    ap.add_argument("--sub-group", type=int, default=25_000_000, help="elements per step call (default 25M)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per thread count (default 3)")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.n, args.sub_group, int(args.threads))))
        return 0
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        kernels, errors = {}, {}
        for r in range(args.rounds):
            for system in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
                res = _run(system, args, threads)
                if "error" in res:
                    errors[system] = res["error"]
                    continue
                times[system] += res["times_s"]
                kernels[system] = res["kernel"]
        for system in SYSTEMS:
            t = times[system]
            if not t:
                rows.append({"system": system, "threads": threads, "error": errors.get(system, "no run")})
                continue
            med = statistics.median(t)
            rows.append({"system": system, "threads": threads, "kernel": kernels[system], "steps": len(t),
                         "median_s": med, "min_s": min(t), "max_s": max(t),
                         "melem_per_s": args.n / med / 1e6, "gb_per_s": BYTES_PER_ELEMENT * args.n / med / 1e9})
    print(f"AdamW step over {args.n:,} fp32 elements in sub-groups of {args.sub_group:,}, "
          f"{args.rounds} alternating round(s) x 5 timed steps, fresh process each")
    print("| system | threads | kernel | step s median | spread (min-max) | M elements/s | GB/s (28 B/elem) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['system']} | {row['threads']} | not run: {row['error']} | | | | |")
            continue
        print(f"| {row['system']} | {row['threads']} | {row['kernel']} | {row['median_s']:.4f} | "
              f"{row['min_s']:.4f}-{row['max_s']:.4f} | {row['melem_per_s']:.0f} | {row['gb_per_s']:.1f} |")
    print("\n| threads | zeroshard throughput / DeepSpeedCPUAdam's |")
    print("|---|---|")
    for threads in sorted({row["threads"] for row in rows}):
        med = {row["system"]: row.get("median_s") for row in rows if row["threads"] == threads}
        if med.get("zeroshard") and med.get("deepspeed"):
            print(f"| {threads} | {med['deepspeed'] / med['zeroshard']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
