"""`zeroshard export CKPT OUT`: a consolidated Hugging Face style model from a checkpoint.

Streams one tensor at a time from the rank files (peak memory about the largest
tensor), so a model too big for one host's memory still exports. Writes
`model.safetensors`, or shards and `model.safetensors.index.json`, plus `config.json`
when the model came from `transformers`.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="consolidate a checkpoint into Hugging Face style safetensors",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="the checkpoint directory (uses `latest`) or one tag directory")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--tag", help="tag to export (default: the one `latest` names)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype of floating-point tensors (default fp32, the master weights)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import export
    from zeroshard.policies import ZeroShardError

    try:
        written = export(args.ckpt, args.out, args.dtype, args.max_shard_size, tag=args.tag)
    except ZeroShardError as exc:
        print(f"zeroshard export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(written)} to {args.out}")
    return 0
