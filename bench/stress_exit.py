"""Run the main job and a plain `initialize()` script many times in a row and count clean exits.

    python bench/stress_exit.py                  # 20 runs of each (~7 min on 2 cores)
    python bench/stress_exit.py --runs 5 --steps 10

Each run is a fresh torchrun with 2 ranks. A run is clean when it exits 0 and neither rank
printed "terminate called" (the SIGABRT at interpreter shutdown this guards against: the
main job used to die there about once in six runs, after its summary had printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(os.path.dirname(HERE), "tests", "exit_probe.py")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def jobs(steps: int) -> dict[str, list[str]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return {
        f"zeroshard train --steps {steps} --report ''":
            [sys.executable, "-m", "zeroshard.cli.main", "train", "--steps", str(steps), "--report", ""],
        "plain initialize() script, close()": [*torchrun, PROBE],
        "plain initialize() script, no close()": [*torchrun, PROBE, "--no-close"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40, help="steps of the main job per run")
    parser.add_argument("--only", choices=["train", "plain"], help="run only the main job, or only the plain script")
    parser.add_argument("--log-dir", default="stress_exit_logs", help="where the output of failed runs goes")
    args = parser.parse_args()
    print(f"| job | runs | clean exits | failures (exit code) | median s |\n|---|---|---|---|---|")
    bad = 0
    for label, cmd in jobs(args.steps).items():
        if args.only and (args.only == "train") != label.startswith("zeroshard train"):
            continue
        codes, seconds = [], []
        for i in range(args.runs):
            started = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
            seconds.append(time.perf_counter() - started)
            aborted = "terminate called" in proc.stdout + proc.stderr
            codes.append(-6 if aborted and proc.returncode == 0 else proc.returncode)
            if codes[-1] != 0:
                os.makedirs(args.log_dir, exist_ok=True)
                path = os.path.join(args.log_dir, f"{label.split()[0]}-{len(codes)}.log")
                with open(path, "w") as f:
                    f.write(f"$ {' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
            print(f"  {label}: run {i + 1}/{args.runs} exit {proc.returncode}{' (abort printed)' if aborted else ''}",
                  file=sys.stderr, flush=True)
        fails = [c for c in codes if c != 0]
        bad += len(fails)
        median = sorted(seconds)[len(seconds) // 2]
        print(f"| {label} | {args.runs} | {args.runs - len(fails)} | {fails or 'none'} | {median:.1f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
