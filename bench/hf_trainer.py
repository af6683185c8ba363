"""Hugging Face Trainer step time on zeroshard beside DeepSpeed: same script, same config.

    python bench/hf_trainer.py --deepspeed-python /tmp/dsvenv/bin/python [--steps 40] [--rounds 2]

Runs tests/hf_scripts/trainer_gpt2.py (GPT-2 built from a config, "auto" DeepSpeed
config, Trainer's AdamW) on 2 ranks with `zeroshard launch` (zeroshard serves `import
deepspeed`) and with `zeroshard launch --real-deepspeed` under `--deepspeed-python` (a
Python where DeepSpeed is installed, e.g. a venv made with --system-site-packages), at
stages 2 and 3, the two systems alternating within each round. Each optimizer step's wall
time comes from a Trainer callback on rank 0 (first micro-batch to the step's end), with
the CPU cores other programs used meanwhile (the machine's busy time from /proc/stat less
both ranks' CPU time); the first `--warmup` steps of each run are left out, and so is any
step during which other programs used more than 0.25 cores (a *clean* step is one they
did not; where either system has fewer than 3 clean steps at a stage, both are compared
over all their measured steps, and the table says so). Prints a markdown table: median
over the clean steps of all rounds, the spread (min-max of the per-round medians, and the
10th-90th percentile of the steps), the clean / measured step counts, and zeroshard /
DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "hf_scripts", "trainer_gpt2.py")


LOAD_LIMIT = 0.25  # other programs' CPU cores above which a step is contended


def run_once(python: str, real: bool, stage: int, args) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as work:
        cmd = [python, "-m", "zeroshard.cli.main", "launch", "--nproc", "2", *(["--real-deepspeed"] if real else []),
               SCRIPT, "--stage", str(stage), "--steps", str(args.steps), "--time-steps", "--width", str(args.width),
               "--layers", str(args.layers), "--out", work]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        proc = subprocess.run(cmd, cwd=work, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    row = json.JSONDecoder().raw_decode(proc.stdout.split("RESULT ", 1)[1])[0]
    return row["step_seconds"][args.warmup:], row["other_cores"][args.warmup:]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed-python", required=True, help="a Python whose `import deepspeed` is DeepSpeed")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--stages", default="2,3")
    args = p.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    times: dict[tuple[str, int], list[list[float]]] = {}
    measured: dict[tuple[str, int], int] = {}
    for r in range(args.rounds):
        for stage in stages:
            order = [("zeroshard", sys.executable, False), ("deepspeed", args.deepspeed_python, True)]
            for name, python, real in (order if r % 2 == 0 else order[::-1]):
                steps, other = run_once(python, real, stage, args)
                clean = [t for t, load in zip(steps, other) if load < LOAD_LIMIT]
                times.setdefault((name, stage), []).append(clean)
                key = (name, stage)
                measured[key] = measured.get(key, 0) + len(steps)
                times.setdefault(("all", name, stage), []).append(steps)
                print(f"round {r + 1} stage {stage} {name}: median {statistics.median(steps):.4f} s over "
                      f"{len(steps)} steps, {len(clean)} clean", file=sys.stderr, flush=True)
    print(f"GPT-2 n_embd {args.width}, {args.layers} layers, micro-batch 4 x 2 ranks, {args.steps} steps "
          f"({args.warmup} warm-up steps left out), {args.rounds} round(s)\n")
    print("| stage | zeroshard s/step | DeepSpeed s/step | zeroshard / DeepSpeed |")
    print("|---|---|---|---|")
    for stage in stages:
        # clean steps where both systems have at least 3 of them, else every measured step of both
        use_clean = all(sum(len(run) for run in times[(name, stage)]) >= 3 for name in ("zeroshard", "deepspeed"))
        cells = []
        medians = {}
        for name in ("zeroshard", "deepspeed"):
            runs = times[(name, stage)] if use_clean else times[("all", name, stage)]
            runs = [run for run in runs if run]
            flat = [t for run in runs for t in run]
            clean_count = sum(len(run) for run in times[(name, stage)])
            note = f"{clean_count}/{measured[(name, stage)]} clean" + ("" if use_clean else ", all steps used")
            medians[name] = statistics.median(flat)
            per_round = [statistics.median(run) for run in runs]
            cells.append(f"{medians[name]:.4f} (rounds {min(per_round):.4f}-{max(per_round):.4f}; "
                         f"p10-p90 {percentile(flat, 0.1):.4f}-{percentile(flat, 0.9):.4f}; {note})")
        print(f"| {stage} | {cells[0]} | {cells[1]} | {medians['zeroshard'] / medians['deepspeed']:.2f} |")


if __name__ == "__main__":
    main()
