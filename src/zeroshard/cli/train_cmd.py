"""`zeroshard train`: train a language model with ZeRO across local ranks (default: GPT mini,
ZeRO stage 3, 2 ranks, the bytes of Python's standard library source).

The command checks everything it can, then launches: it runs `torch.distributed.run`
(torchrun) with `--nproc` ranks on `zeroshard.cli.train_worker`, so the same worker runs
unchanged on many nodes (`--nnodes`, `--node-rank`, `--master-addr` on every node, or
your own torchrun command). Already inside torchrun (RANK is set), it trains directly.
"""

from __future__ import annotations

import argparse
import os
import sys

from zeroshard.cli.launch_cmd import add_rendezvous_arguments, check_nproc, check_rendezvous, rank_target, \
    run_torchrun, torchrun_command
from zeroshard.models.presets import model_choices

REPORT_DEFAULT = "zeroshard_train_report.png"


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a language model with ZeRO (default: GPT mini, stage 3, 2 ranks)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default 2)")
    add_rendezvous_arguments(p)
    p.set_defaults(func=run)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="DeepSpeed-style JSON config (default: the embedded stage-3 one)")
    p.add_argument("--model", default="mini", metavar="NAME",
                   help=f"{model_choices()} (default mini; gpt-mini etc. also accepted)")
    p.add_argument("--data", metavar="PATH", help="a text file or a folder of text files, read as bytes "
                                                  "(default: the Python standard library's source)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="override zero_optimization.stage")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample (default 64, or the model's context when shorter)")
    p.add_argument("--micro-batch", type=int, help="samples per rank per micro-step (default 8, or the config's)")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R >= 1 (peft) only")
    p.add_argument("--bf16", action="store_true", help="train in bf16 with fp32 master weights")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                   help="cpu: optimizer states (and, at stage 3, parameter shards) on host memory (ZeRO-Offload); "
                        "nvme: the same in files under --nvme-path (ZeRO-Infinity)")
    p.add_argument("--nvme-path", metavar="DIR", help="with --offload nvme: a directory on a fast local drive")
    p.add_argument("--save", metavar="DIR", help="write a checkpoint to DIR every --save-every steps and at the end")
    p.add_argument("--save-every", type=int, default=100, metavar="K", help="steps between checkpoints (default 100)")
    p.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep only the newest N checkpoints in --save DIR (default: keep every one)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --save DIR, an error if there is none (a run "
                        "whose --save DIR holds a checkpoint continues from it even without --resume)")
    p.add_argument("--reload-checkpoints", action="store_true",
                   help="after each checkpoint, load it back and continue from what was read (checks every save)")
    p.add_argument("--resource-log", metavar="DIR",
                   help="each rank appends its RSS, open files and threads to DIR/rank<r>.jsonl at every "
                        "checkpoint (soak tests; Linux)")
    p.add_argument("--report", default=REPORT_DEFAULT, metavar="PATH",
                   help=f"PNG with the loss curve and memory breakdown (default ./{REPORT_DEFAULT}; '' for none)")
    p.add_argument("--seed", type=int, default=0)


def check_train_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, as one line, or None. Runs before any rank starts."""
    from zeroshard.cli.train_data import check_data
    from zeroshard.cli.train_model import check_model
    from zeroshard.cli.train_resources import check_resource_log

    resolve_defaults(args)
    if args.steps < 1:
        return f"--steps must be at least 1, got {args.steps}"
    if args.seq_len < 1:
        return f"--seq-len must be at least 1, got {args.seq_len}"
    if args.micro_batch is not None and args.micro_batch < 1:
        return f"--micro-batch must be at least 1, got {args.micro_batch}"
    if args.save_every < 1:
        return f"--save-every must be at least 1, got {args.save_every}"
    if args.keep_last is not None:
        if args.keep_last < 1:
            return f"--keep-last must be at least 1, got {args.keep_last}"
        if not args.save:
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


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the options whose default depends on another (--seq-len on --model)."""
    if args.seq_len is None:
        from zeroshard.cli.train_model import default_seq_len

        args.seq_len = default_seq_len(args.model)


def _check_config(args: argparse.Namespace) -> str | None:
    from zeroshard.cli.train_config import build_config
    from zeroshard.cli.train_prelaunch import check_settings
    from zeroshard.config import load_config
    from zeroshard.policies import ZeroShardError

    try:
        settings = load_config(build_config(args, ["Block"]), args.nproc * args.nnodes)
    except ZeroShardError as exc:
        return str(exc)
    return check_settings(settings, args.model, args.seq_len, args.nproc)


def run(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:  # already launched by torchrun: be the worker
        from zeroshard.cli.train_worker import train

        return train(args)
    problem = check_nproc(args.nproc) or check_rendezvous(args) or check_train_args(args)
    if problem:
        print(f"zeroshard train: {problem}", file=sys.stderr)
        return 2
    from zeroshard.cli.train_config import filled_from_default

    for note in filled_from_default(args):
        print(f"zeroshard train: {note}", flush=True)
    target = rank_target(["-m", "zeroshard.cli.train_worker", *worker_argv(args)])
    return run_torchrun(torchrun_command(args, target), command="zeroshard train",
                        describe_stop=lambda: last_checkpoint_line(args.save))


def last_checkpoint_line(save: str | None) -> str:
    """For the stop line: which checkpoint a rerun continues from."""
    if not save:
        return ""
    try:
        with open(os.path.join(save, "latest")) as fh:
            tag = fh.read().strip()
    except OSError:
        return f"no checkpoint was completed in {save}"
    return f"the last complete checkpoint is {os.path.join(save, tag)} (the same command continues from it)"


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The training options again, for the worker's command line."""
    argv = ["--model", args.model, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
            "--seed", str(args.seed), "--save-every", str(args.save_every),
            "--report", args.report, "--offload", args.offload]
    for flag, value in (("--config", args.config), ("--data", args.data), ("--stage", args.stage),
                        ("--lora", args.lora), ("--keep-last", args.keep_last),
                        ("--micro-batch", args.micro_batch), ("--save", args.save),
                        ("--resource-log", args.resource_log)):
        if value is not None:
            argv += [flag, str(value)]
    argv += [flag for flag, on in (("--bf16", args.bf16), ("--resume", args.resume),
                                   ("--reload-checkpoints", args.reload_checkpoints)) if on]
    if getattr(args, "nvme_path", None):
        argv += ["--nvme-path", args.nvme_path]
    return argv
