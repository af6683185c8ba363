"""`zeroshard bench`: one torchrun job per (model, system, round), one after the other, each
with a time limit; a progress line per job; the ranks' files merged into rows.

Jobs run through `launch_cmd.torchrun_command` (the launcher `zeroshard train` and `launch`
use): `--standalone`, so every system gets a fresh process group on a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

from zeroshard.bench.results import loss_agreement, merge_ranks, pool_rounds, ratios
from zeroshard.bench.systems import BenchSystem
from zeroshard.cli.launch_cmd import torchrun_command

__all__ = ["run_all", "run_system"]

EXIT_GRACE_S = 60.0


def _last_error(log_path: str, lines: int = 6) -> str:
    try:
        with open(log_path, errors="replace") as fh:
            text = fh.read().splitlines()
    except OSError:
        return "no log"
    errors = [ln for ln in text if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return errors[-1] if errors else " | ".join(text[-lines:])


def _rank_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if re.fullmatch(r"rank\d+\.json", n))


def _wait(proc, folder: str, nproc: int, timeout: float) -> tuple[int, bool, bool]:
    """(exit code, timed out, hung): `hung` when every rank wrote its results but the job did not
    exit within EXIT_GRACE_S after (a teardown stuck in the backend); it is then killed."""
    deadline = time.monotonic() + timeout
    written_at = None
    while True:
        try:
            return proc.wait(timeout=1.0), False, False
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if written_at is None and len(_rank_files(folder)) == nproc:
            written_at = now
        if now > deadline or (written_at is not None and now - written_at > EXIT_GRACE_S):
            os.killpg(proc.pid, signal.SIGKILL)  # the session started for this job only
            return proc.wait(), now > deadline and written_at is None, written_at is not None


def run_system(args: argparse.Namespace, model: str, system: BenchSystem, folder: str) -> tuple[dict | None, str]:
    """Run one system on `model`; (its row or None, a one-line status)."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name.startswith("rank"):
            os.remove(os.path.join(folder, name))
    scratch = tempfile.mkdtemp(prefix=f"zsbench_{system.name}_") if system.needs_scratch else ""
    job = {"system": system.name, "model": model, "steps": args.steps, "warmup": args.warmup,
           "micro_batch": args.micro_batch, "seq_len": args.seq_len, "bf16": args.bf16, "seed": args.seed,
           "threads": args.threads, "scratch": scratch}
    job_path = os.path.join(folder, "job.json")
    with open(job_path, "w") as fh:
        json.dump(job, fh, indent=1)
    launch = argparse.Namespace(nnodes=1, master_addr=None, nproc=args.nproc)
    cmd = torchrun_command(launch, ["-m", "zeroshard.bench.worker", job_path])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": os.environ.get(
        "DS_ACCELERATOR", "cpu"), "PYTHONUNBUFFERED": "1"}
    log_path = os.path.join(folder, "log.txt")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out, hung = _wait(proc, folder, args.nproc, args.timeout)
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)  # the session started for this job only
            proc.wait()
            raise
    wall = time.perf_counter() - started
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    files = _rank_files(folder)
    if len(files) != args.nproc or (rc != 0 and not hung):
        errs = sorted(n for n in os.listdir(folder) if n.endswith(".err"))
        if timed_out:
            why = f"timed out after {args.timeout} s"
        elif errs:
            with open(os.path.join(folder, errs[0])) as fh:
                why = fh.readline().strip()
        else:
            why = _last_error(log_path)
        return None, f"FAILED after {wall:.0f} s: {why}"
    per_rank = []
    for name in files:
        with open(os.path.join(folder, name)) as fh:
            per_rank.append(json.load(fh))
    row = merge_ranks(per_rank, args.micro_batch, args.seq_len)
    row["wall_s"] = wall
    row["exit"] = "killed after writing its results (did not exit)" if hung else "clean"
    row["description"] = system.description
    st = row["step_time_s"]
    phi = row.get("ledger", {}).get("phi_per_step")
    status = (f"{st['median']:.3f} s/step ({st['min']:.3f}-{st['max']:.3f}), {row['tokens_per_s']:,.0f} tok/s, "
              f"peak RSS {'/'.join(f'{m:,.0f}' for m in row['peak_rss_mib'])} MiB"
              + (f", {phi:.3f} Phi/step" if phi is not None else "") + f", {wall:.0f} s"
              + (" (killed: it did not exit after writing its results)" if hung else ""))
    return row, status


def run_all(args: argparse.Namespace, systems: list[BenchSystem]) -> dict[str, Any]:
    """Every system on every model; with `args.rounds` > 1 the whole set of systems runs that many
    times, interleaved (a, b, c, a, b, c), and each system's rounds are pooled (`pool_rounds`):
    load from other programs then falls on every system alike. A system that fails in any round
    is reported failed."""
    rounds = getattr(args, "rounds", 1)
    total = len(args.models) * len(systems) * rounds
    runs: dict[str, Any] = {}
    started = time.perf_counter()
    i = 0
    for model in args.models:
        done: dict[str, list[dict]] = {s.name: [] for s in systems}
        failed: dict[str, str] = {}
        for rnd in range(rounds):
            for system in systems:
                if system.name in failed:
                    continue
                i += 1
                head = f"[{i}/{total}] {model} {system.name}" + (f" round {rnd + 1}/{rounds}" if rounds > 1 else "")
                print(f"{head}: running ({system.description})", flush=True)
                folder = os.path.join(args.out, "runs", re.sub(r"[^A-Za-z0-9_.-]+", "_", model), system.name)
                row, status = run_system(args, model, system, os.path.join(folder, f"round{rnd + 1}")
                                         if rounds > 1 else folder)
                print(f"{head}: {status}", flush=True)
                if row is None:
                    failed[system.name] = status
                else:
                    done[system.name].append(row)
        rows = {name: pool_rounds(rs) for name, rs in done.items() if name not in failed}
        first = next(iter(rows.values()), None)
        runs[model] = {"model": model, "phi": first["phi"] if first else None, "rows": rows, "failed": failed,
                       "ratios": ratios(rows), "loss_max_abs_diff_vs_ddp": loss_agreement(rows)}
    import torch

    return {"settings": {"models": args.models, "systems": [s.name for s in systems], "steps": args.steps,
                         "warmup": args.warmup, "rounds": rounds, "nproc": args.nproc, "threads": args.threads,
                         "micro_batch": args.micro_batch, "seq_len": args.seq_len, "bf16": args.bf16,
                         "seed": args.seed, "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()},
            "wall_s": time.perf_counter() - started, "runs": runs}
