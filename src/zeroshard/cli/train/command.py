"""`zeroshard train`: train a language model with ZeRO across local ranks (default: GPT mini,
ZeRO stage 3, 2 ranks, the bytes of Python's standard library source).

The command checks everything it can, then launches: it runs `torch.distributed.run`
(torchrun) with `--nproc` ranks on `zeroshard.cli.train.worker`, so the same worker runs
unchanged on many nodes (`--nnodes`, `--node-rank`, `--master-addr` on every node, or
your own torchrun command). Already inside torchrun (RANK is set), it trains directly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from zeroshard.cli.launch_cmd import add_rendezvous_arguments, check_nproc, check_rendezvous, elastic, \
    elastic_note, rank_target, run_torchrun, torchrun_command
from zeroshard.cli.train.args import add_train_arguments, resolve_defaults, worker_argv


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a language model with ZeRO (default: GPT mini, stage 3, 2 ranks)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default 2)")
    add_rendezvous_arguments(p)
    p.set_defaults(func=run)


def check_train_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, as one line, or None. Runs before any rank starts."""
    from zeroshard.cli.train.data import check_data
    from zeroshard.cli.train.model import check_model
    from zeroshard.cli.train.resources import check_resource_log

    resolve_defaults(args)
    for flag, value in (("--steps", args.steps), ("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch),
                        ("--save-every", args.save_every), ("--keep-last", args.keep_last)):
        if value is not None and value < 1:
            return f"{flag} must be at least 1, got {value}"
    if args.keep_last is not None and not args.save:
        return "--keep-last N prunes the checkpoints --save DIR writes: give --save"
    if args.resume:
        if not args.save:
            return "--resume continues from --save DIR: give the checkpoint folder with --save"
        if not os.path.exists(os.path.join(args.save, "latest")):
            return f"--resume: no checkpoint in {args.save} (no 'latest' file)"
    if args.reload_checkpoints and not args.save:
        return "--reload-checkpoints reads back what --save DIR writes: give --save"
    problem = check_resource_log(args.resource_log)
    if problem:
        return problem
    if getattr(args, "offload", "none") == "nvme" and not getattr(args, "nvme_path", None):
        return "--offload nvme keeps states in files: give --nvme-path DIR (a directory on a fast local drive)"
    if getattr(args, "nvme_path", None) and getattr(args, "offload", "none") != "nvme":
        return "--nvme-path is used only with --offload nvme; add --offload nvme or drop --nvme-path"
    return check_model(args.model, args.seq_len, args.lora) or _check_config(args) or check_data(args.data)


def _check_config(args: argparse.Namespace) -> str | None:
    from zeroshard.cli.train.config import build_config, wrote_optimizer
    from zeroshard.cli.train.prelaunch import check_settings
    from zeroshard.config import load_config
    from zeroshard.policies import ZeroShardError

    world = args.nproc * args.nnodes
    try:
        cfg = build_config(args, ["Block"])
        settings = load_config(cfg, world)
        if args.save and os.path.isfile(os.path.join(args.save, "latest")) and not elastic(args):
            from zeroshard.cli.train.resume import keep_global_batch  # reads a checkpoint: imports torch

            keep_global_batch(dict(cfg), args.save, world)  # its batch at another world size: refused before any rank
    except ZeroShardError as exc:
        return str(exc)
    return check_settings(settings, args.model, args.seq_len, args.nproc, world,
                          user_optimizer=wrote_optimizer(args))


def run(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:  # already launched by torchrun: be the worker
        from zeroshard.cli.train.worker import train

        return train(args)
    problem = check_nproc(args.nproc) or check_rendezvous(args) or check_train_args(args)
    if problem:
        print(f"zeroshard train: {problem}", file=sys.stderr)
        return 2
    from zeroshard.cli.train.config import filled_from_default

    for note in [*filled_from_default(args), elastic_note(args)]:
        if note:
            print(f"zeroshard train: {note}", flush=True)
    if args.verbose:  # the ranks inherit it (zeroshard.api.banner.verbose)
        os.environ["ZEROSHARD_VERBOSE"] = "1"
    target = rank_target(["-m", "zeroshard.cli.train.worker", *worker_argv(args)])
    return run_torchrun(torchrun_command(args, target), command="zeroshard train",
                        describe_stop=lambda: after_stop(args.save))


def after_stop(save: str | None) -> str:
    """Once every rank has exited after a stop: the partial tag of a save the stop cut short is
    removed (a rank ended by its watchdog, or killed, had no chance to), and the stop line
    says which checkpoint a rerun continues from."""
    if not save:
        return ""
    from zeroshard.checkpoint.save import remove_partial_tags  # only after a stop, as prepare_tag uses it

    with contextlib.suppress(OSError):
        remove_partial_tags(save)
    try:
        with open(os.path.join(save, "latest")) as fh:
            tag = fh.read().strip()
    except OSError:
        return f"no checkpoint was completed in {save}"
    return f"the last complete checkpoint is {os.path.join(save, tag)} (the same command continues from it)"
