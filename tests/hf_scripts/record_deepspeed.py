"""Record what the real DeepSpeed gives for each scenario of scenarios.py (run once, by hand).

    python -m venv --system-site-packages /tmp/dsvenv
    /tmp/dsvenv/bin/pip install --no-deps deepspeed==0.19.8
    /tmp/dsvenv/bin/pip install hjson ninja py-cpuinfo msgpack einops
    /tmp/dsvenv/bin/python tests/hf_scripts/record_deepspeed.py [NAME ...] > /tmp/deepspeed_figures.json
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/hf_scripts/record_deepspeed.py --trl \
        > tests/fixtures/trl_deepspeed/figures.json

Each scenario runs on 2 ranks with `zeroshard launch --real-deepspeed` (torchrun, the
installed DeepSpeed on its CPU accelerator; its first run builds DeepSpeed's CPU ops, which
takes minutes). It prints one JSON line per scenario: what scenarios.DEEPSPEED holds. With
`--trl` it runs the TRL scripts of scenarios.TRL (through ds_comm_first.py: what DeepSpeed needs on
a CPU, said there) and prints the fixture tests/test_trl_deepspeed.py reads, with its provenance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from scenarios import SCENARIOS, TRL  # noqa: E402

KEEP = ("losses", "rewards", "completions", "train_loss", "probe_loss", "first_step", "loaded_probe_loss",
        "held_fraction", "lrs", "saved_probe", "moved_probe", "loaded_probe")


def launch_real(script_and_args: list[str], work: str, env: dict[str, str]) -> dict:
    """Rank 0's RESULT of `zeroshard launch --real-deepspeed --nproc 2 SCRIPT ARGS` run in `work`."""
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--real-deepspeed", "--nproc", "2", *script_and_args]
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=work, env={**full_env, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        print(f"{script_and_args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}", file=sys.stderr)
        return {"failed": True}
    row = json.JSONDecoder().raw_decode(proc.stdout.split("RESULT ", 1)[1])[0]
    return {k: v for k, v in row.items() if k in KEEP}


def run(name: str, base: str) -> dict:
    """Scenario `name` in base/name; `{other}` in its arguments is base/other."""
    script, args, env = SCENARIOS[name]
    work = os.path.join(base, name)
    os.makedirs(work)
    args = [a.format(**{n: os.path.join(base, n) for n in SCENARIOS}) for a in args]
    out = ["--out", work] if script != "dse_cifar_style.py" else []
    return launch_real([os.path.join(HERE, script), *args, *out], work, env)


def record_trl(base: str) -> dict:
    """Each TRL scenario under the real DeepSpeed, and how it was run."""
    import platform
    import time

    import accelerate
    import torch
    import transformers
    import trl

    import deepspeed

    runs = {}
    for name, (script, args, flags) in TRL.items():
        work = os.path.join(base, name)
        os.makedirs(work)
        row = launch_real([os.path.join(HERE, "ds_comm_first.py"), *flags, os.path.join(HERE, script), "--zero3",
                           *args, "--out", work], work, {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
                                                                  "HF_HUB_OFFLINE": "1"})
        runs[name] = {"script": script, "args": ["--zero3", *args], "recorded_with": flags, **row}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    provenance = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                  "transformers": transformers.__version__, "trl": trl.__version__,
                  "accelerate": accelerate.__version__, "python": platform.python_version(),
                  "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu, "threads_per_rank": 1,
                  "command": "DS_ACCELERATOR=cpu python tests/hf_scripts/record_deepspeed.py --trl",
                  "each_run": "zeroshard launch --real-deepspeed --nproc 2 tests/hf_scripts/ds_comm_first.py "
                              "[recorded_with] tests/hf_scripts/SCRIPT ARGS --out DIR "
                              "(gloo, DeepSpeed's CPU accelerator)"}
    return {"provenance": provenance, "runs": runs}


def main() -> None:
    import deepspeed

    if sys.argv[1:] == ["--trl"]:
        with tempfile.TemporaryDirectory() as base:
            print(json.dumps(record_trl(base), indent=1))
        return
    names = sys.argv[1:] or list(SCENARIOS)
    print(json.dumps({"deepspeed": deepspeed.__version__}), flush=True)
    with tempfile.TemporaryDirectory() as base:
        for name in names:
            print(json.dumps({name: run(name, base)}), flush=True)


if __name__ == "__main__":
    main()
