"""`zeroshard train`: train the built-in GPT on the embedded corpus across local ranks.

The command itself only launches: it runs `torch.distributed.run` (torchrun) with
`--nproc` ranks on `zeroshard.cli.train_worker`, so the same worker runs unchanged
under a multi-node torchrun. Already inside torchrun (RANK is set), it trains directly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from zeroshard.models import GPT_PRESETS


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a small GPT on the embedded corpus (stdlib source, bytes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default 2)")
    p.set_defaults(func=run)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="DeepSpeed-style JSON config (default: the embedded one)")
    p.add_argument("--model", default="mini", choices=sorted(GPT_PRESETS), help="GPT preset (default mini)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2), help="override zero_optimization.stage")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per rank per micro-step (default 8)")
    p.add_argument("--bf16", action="store_true", help="train in bf16 with fp32 master weights")
    p.add_argument("--seed", type=int, default=0)


def _check_nproc(nproc: int) -> str | None:
    if nproc < 1:
        return f"--nproc must be at least 1, got {nproc}"
    if torch.cuda.is_available():
        if nproc > torch.cuda.device_count():
            return (f"--nproc {nproc} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                    "NCCL needs one device per rank")
    elif nproc > 4 * (os.cpu_count() or 1):
        return f"--nproc {nproc} is more than 4 ranks per CPU core ({os.cpu_count()} cores): the gloo ranks would thrash"
    return None


def _check_config(args: argparse.Namespace) -> str | None:
    """Validate the config here, once, before any rank starts: errors read cleanly."""
    from zeroshard.cli.train_worker import build_config
    from zeroshard.config import load_config
    from zeroshard.policies import ZeroShardError

    try:
        load_config(build_config(args), args.nproc)
    except ZeroShardError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:  # already launched by torchrun: be the worker
        from zeroshard.cli.train_worker import train

        return train(args)
    problem = _check_nproc(args.nproc) or _check_config(args)
    if problem:
        print(f"zeroshard train: {problem}", file=sys.stderr)
        return 2
    forwarded = _rebuild_argv(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "zeroshard.cli.train_worker", *forwarded]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def _rebuild_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model", args.model, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
            "--micro-batch", str(args.micro_batch), "--seed", str(args.seed)]
    if args.config:
        argv += ["--config", args.config]
    if args.stage is not None:
        argv += ["--stage", str(args.stage)]
    if args.bf16:
        argv.append("--bf16")
    return argv
