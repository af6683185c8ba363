"""The options of `zeroshard train`: declared once here, read by the launching command
(`command.py`) and by each rank (`worker.py`), which gets them back through `worker_argv`."""

from __future__ import annotations

import argparse

from zeroshard.models.presets import model_choices

REPORT_DEFAULT = "zeroshard_train_report.png"


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
    p.add_argument("--compile", action="store_true",
                   help="engine.compile(): each stage-3 unit / repeated block compiled in place (inductor)")
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
    p.add_argument("--tensorboard", metavar="DIR", help="TensorBoard events under DIR/zeroshard_train (loss, lr, "
                   "traffic, memory; the config's tensorboard section)")
    p.add_argument("--csv", metavar="DIR", help="the same events as CSV files under DIR/zeroshard_train")
    p.add_argument("--wandb", metavar="PROJECT", help="the same events to W&B project PROJECT (WANDB_MODE=offline: "
                   "no network)")
    p.add_argument("--verbose", action="store_true",
                   help="the whole start-up block (every setting and why) and each rank's memory under each step line")


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the options whose default depends on another (--seq-len on --model)."""
    if args.seq_len is None:
        from zeroshard.cli.train.model import default_seq_len

        args.seq_len = default_seq_len(args.model)


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The training options again, for the worker's command line."""
    argv = ["--model", args.model, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
            "--seed", str(args.seed), "--save-every", str(args.save_every),
            "--report", args.report, "--offload", args.offload]
    for flag, value in (("--config", args.config), ("--data", args.data), ("--stage", args.stage),
                        ("--lora", args.lora), ("--keep-last", args.keep_last),
                        ("--micro-batch", args.micro_batch), ("--save", args.save),
                        ("--resource-log", args.resource_log), ("--tensorboard", args.tensorboard),
                        ("--csv", args.csv), ("--wandb", args.wandb)):
        if value is not None:
            argv += [flag, str(value)]
    argv += [flag for flag, on in (("--bf16", args.bf16), ("--resume", args.resume),
                                   ("--reload-checkpoints", args.reload_checkpoints),
                                   ("--compile", args.compile)) if on]
    if getattr(args, "nvme_path", None):
        argv += ["--nvme-path", args.nvme_path]
    return argv
