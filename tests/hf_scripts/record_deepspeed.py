"""Record what the real DeepSpeed gives for each scenario of scenarios.py (run once, by hand).

    python -m venv --system-site-packages /tmp/dsvenv
    /tmp/dsvenv/bin/pip install --no-deps deepspeed==0.19.8
    /tmp/dsvenv/bin/pip install hjson ninja py-cpuinfo msgpack einops
    /tmp/dsvenv/bin/python tests/hf_scripts/record_deepspeed.py [NAME ...] > /tmp/deepspeed_figures.json

Each scenario runs on 2 ranks with `zeroshard launch --real-deepspeed` (torchrun, the
installed DeepSpeed on its CPU accelerator; its first run builds DeepSpeed's CPU ops, which
takes minutes). It prints one JSON line per scenario: what scenarios.DEEPSPEED holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from scenarios import SCENARIOS  # noqa: E402

KEEP = ("losses", "train_loss", "probe_loss", "first_step", "loaded_probe_loss", "held_fraction", "lrs",
        "saved_probe", "moved_probe", "loaded_probe")


def run(name: str, base: str) -> dict:
    """Scenario `name` in base/name; `{other}` in its arguments is base/other."""
    script, args, env = SCENARIOS[name]
    work = os.path.join(base, name)
    os.makedirs(work)
    args = [a.format(**{n: os.path.join(base, n) for n in SCENARIOS}) for a in args]
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--real-deepspeed", "--nproc", "2",
           os.path.join(HERE, script), *args, *(["--out", work] if script != "dse_cifar_style.py" else [])]
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=work, env={**full_env, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        print(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}", file=sys.stderr)
        return {"failed": True}
    row = json.JSONDecoder().raw_decode(proc.stdout.split("RESULT ", 1)[1])[0]
    return {k: v for k, v in row.items() if k in KEEP}


def main() -> None:
    import deepspeed

    names = sys.argv[1:] or list(SCENARIOS)
    print(json.dumps({"deepspeed": deepspeed.__version__}), flush=True)
    with tempfile.TemporaryDirectory() as base:
        for name in names:
            print(json.dumps({name: run(name, base)}), flush=True)


if __name__ == "__main__":
    main()
