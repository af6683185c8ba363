"""`zeroshard launch`: run your own training script on N local ranks through torchrun.

    zeroshard launch --nproc 2 train.py --lr 1e-3
    zeroshard launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr head-node train.py   # on each node

zeroshard has no launcher of its own: this is `python -m torch.distributed.run` with
the rendezvous options spelled out, OMP_NUM_THREADS defaulted to 1 (torchrun's own
default, without its warning), and the same checks `zeroshard train` makes before any
rank starts. Everything after the script is passed to it unchanged.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

__all__ = ["add_rendezvous_arguments", "check_nproc", "register", "run_torchrun", "torchrun_command"]


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="run your script on N ranks with torchrun (one node or many)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks on this node (default 2)")
    add_rendezvous_arguments(p)
    p.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def add_rendezvous_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", help="address of node 0, reachable from every node (multi-node)")
    p.add_argument("--master-port", type=int, default=29500, help="port on node 0 (default 29500)")


def check_nproc(nproc: int) -> str | None:
    """Why `nproc` ranks cannot run well on this machine for its backend, or None."""
    import torch

    if nproc < 1:
        return f"--nproc must be at least 1, got {nproc}"
    if torch.cuda.is_available():
        if nproc > torch.cuda.device_count():
            return (f"--nproc {nproc} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                    "NCCL needs one device per rank")
    elif nproc > 4 * (os.cpu_count() or 1):
        return (f"--nproc {nproc} is more than 4 ranks per CPU core ({os.cpu_count()} cores): "
                "the gloo ranks would thrash")
    return None


def check_rendezvous(args: argparse.Namespace) -> str | None:
    if args.nnodes < 1:
        return f"--nnodes must be at least 1, got {args.nnodes}"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes})"
    if args.nnodes > 1 and not args.master_addr:
        return f"--nnodes {args.nnodes} needs --master-addr (the address of node 0)"
    if not 0 < args.master_port < 65536:
        return f"--master-port {args.master_port} is not a TCP port"
    return None


def torchrun_command(args: argparse.Namespace, target: list[str]) -> list[str]:
    """`python -m torch.distributed.run ...` for `target` (a script or `-m module` and its args).

    One node without --master-addr: `--standalone` (a free port on localhost). Otherwise the
    static rendezvous every node runs with the same --master-addr/--master-port."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if args.nnodes == 1 and not args.master_addr:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                f"--master-addr={args.master_addr}", f"--master-port={args.master_port}"]
    return [*cmd, f"--nproc-per-node={args.nproc}", *target]


def run_torchrun(cmd: list[str]) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


def run(args: argparse.Namespace) -> int:
    problem = check_nproc(args.nproc) or check_rendezvous(args)
    if not problem and not args.module and not os.path.isfile(args.script):
        problem = f"{args.script}: no such script"
    if problem:
        print(f"zeroshard launch: {problem}", file=sys.stderr)
        return 2
    target = ["-m", args.script] if args.module else [args.script]
    return run_torchrun(torchrun_command(args, [*target, *args.script_args]))
