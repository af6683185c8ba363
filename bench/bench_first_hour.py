"""What a new user waits for (issue 29): how long `zeroshard --help` and a usage error take,
how long a mistake caught before launch takes to be reported, and how long a stop signal
takes to end every rank of `zeroshard train`.

    python bench/bench_first_hour.py [--repeats 5] [--stops 3]

Prints one table: median and range (min-max) of wall seconds per case, and the other
programs' CPU load during the run (/proc/loadavg), since every figure here is wall time.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CLI = [sys.executable, "-m", "zeroshard.cli.main"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def _wall(argv: list[str], cwd: str) -> tuple[float, int]:
    t = time.perf_counter()
    proc = subprocess.run(CLI + argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    return time.perf_counter() - t, proc.returncode


def _stop_once(cwd: str, sig: int) -> float:
    """Seconds from the signal to the launcher's exit, training under way (first checkpoint written)."""
    ckpt = os.path.join(cwd, f"ck{time.monotonic_ns()}")
    proc = subprocess.Popen(CLI + ["train", "--model", "tiny", "--steps", "100000", "--save", ckpt, "--save-every", "3",
                                   "--report", ""], cwd=cwd, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(ckpt, "latest")):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("training did not start")
        time.sleep(0.05)
    t = time.perf_counter()
    os.kill(proc.pid, sig)
    proc.wait(timeout=120)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stops", type=int, default=3)
    args = p.parse_args()
    load_before = open("/proc/loadavg").read().split()[0]
    rows = []
    with tempfile.TemporaryDirectory() as cwd:
        bad = os.path.join(cwd, "bad.json")
        with open(bad, "w") as fh:
            fh.write('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": -1}}}')
        cases = [("zeroshard --help", ["--help"]), ("usage error: train --bogus", ["train", "--bogus"]),
                 ("caught before launch: lr -1", ["train", "--model", "tiny", "--config", bad])]
        for label, argv in cases:
            runs = [_wall(argv, cwd) for _ in range(args.repeats)]
            rows.append((label, [s for s, _ in runs], {c for _, c in runs}))
        for sig in (signal.SIGINT, signal.SIGTERM):
            runs = [_stop_once(cwd, sig) for _ in range(args.stops)]
            rows.append((f"{sig.name} to zeroshard train -> every rank gone", runs, {128 + sig}))
    load_after = open("/proc/loadavg").read().split()[0]
    print(f"| case | runs | median s | min-max s | exit |\n|---|---|---|---|---|")
    for label, secs, codes in rows:
        print(f"| {label} | {len(secs)} | {statistics.median(secs):.2f} | {min(secs):.2f}-{max(secs):.2f} | "
              f"{','.join(map(str, sorted(codes)))} |")
    print(f"\nload average (1 min) before {load_before}, after {load_after}; {os.cpu_count()} CPU(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
