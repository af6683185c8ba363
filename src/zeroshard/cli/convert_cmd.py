"""`zeroshard convert DS_CKPT OUT`: write a checkpoint DeepSpeed saved as a zeroshard checkpoint.

Reads the DeepSpeed folder (a save_dir with `latest`, or one `global_stepN` tag folder)
without DeepSpeed and without running any pickled code, and writes the same tag under
OUT in zeroshard's format (safetensors + meta.json, sha256-checked), which then loads on
any world size and stage. Loading the DeepSpeed folder directly works too
(`engine.load_checkpoint(DS_CKPT)`); convert once to stop reading pickles at every
restart. See docs/deepspeed-migration.md.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="write a DeepSpeed checkpoint once as a zeroshard checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", metavar="DS_CKPT", help="the DeepSpeed checkpoint directory (uses `latest`) or a tag folder")
    p.add_argument("out", metavar="OUT", help="directory for the zeroshard checkpoint (its tag and `latest` go there)")
    p.add_argument("--tag", help="DeepSpeed tag to convert (default: the one `latest` names)")
    p.add_argument("--lr-scheduler-class", metavar="NAME",
                   help="the class of a client LR scheduler (one passed to deepspeed.initialize, e.g. StepLR): "
                        "DeepSpeed saves its state dict without the class; naming it carries the state over")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint.deepspeed_reader.convert import convert
    from zeroshard.policies import ZeroShardError

    try:
        final, dropped = convert(args.ckpt, args.out, tag=args.tag, scheduler_class=args.lr_scheduler_class)
    except ZeroShardError as exc:
        print(f"zeroshard convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {final} (zeroshard format; `latest` in {args.out} names it)")
    if dropped:
        print(f"left out: {'; '.join(dropped)}")
    return 0
