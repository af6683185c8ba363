"""Run a script of tests/hf_scripts on 2 ranks with `zeroshard launch`, unchanged, and read
its `RESULT {json}` line (rank 0). A hang fails fast: the launch has a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "hf_scripts")
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env.update(OMP_NUM_THREADS=os.environ.get("ZEROSHARD_RANK_THREADS", "1"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", **extra)
    return env


def launch(script: str, args: list[str], cwd, timeout: float = 240, flags: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> tuple[dict, str]:
    """(rank 0's RESULT, everything the launch printed)."""
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc", "2", *flags,
           os.path.join(SCRIPTS, script), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = [json.JSONDecoder().raw_decode(part)[0] for part in proc.stdout.split("RESULT ")[1:]
            if part.startswith("{")]
    assert len(rows) == 1, f"{script}: expected one RESULT line, got {len(rows)}:\n{proc.stdout[-3000:]}"
    return rows[0], proc.stdout + proc.stderr
