"""`zeroshard export CKPT OUT`: a consolidated Hugging Face style model from a checkpoint.

Streams one tensor at a time from the rank files (peak memory about the largest
tensor), so a model too big for one host's memory still exports. CKPT may also be a
checkpoint DeepSpeed wrote (its fp32 masters are exported; nothing in it is unpickled
beyond tensors and an allow-list of inert records). Writes
`model.safetensors`, or shards and `model.safetensors.index.json`, plus `config.json`
when the model came from `transformers`.

--adapter-only: the LoRA adapter in peft's format (adapter_model.safetensors +
adapter_config.json, for PeftModel.from_pretrained), read from the trainable buckets only.
--exclude-frozen: the trainable tensors only, in the full format (state-dict names).
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
    only = p.add_mutually_exclusive_group()
    only.add_argument("--adapter-only", action="store_true",
                      help="write the LoRA adapter in peft's format (adapter_model.safetensors, adapter_config.json)")
    only.add_argument("--exclude-frozen", action="store_true",
                      help="write only the trainable tensors, in the full format (no config.json)")
    p.add_argument("--lora-alpha", type=float,
                   help="--adapter-only, for a checkpoint that does not record its peft config: the LoRA alpha")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import export
    from zeroshard.checkpoint.adapter import export_adapter
    from zeroshard.policies import ZeroShardError

    try:
        if args.lora_alpha is not None and not args.adapter_only:
            raise ZeroShardError("--lora-alpha goes with --adapter-only")
        if args.adapter_only:
            written = export_adapter(args.ckpt, args.out, args.dtype, tag=args.tag, lora_alpha=args.lora_alpha)
        else:
            written = export(args.ckpt, args.out, args.dtype, args.max_shard_size, tag=args.tag,
                             exclude_frozen=args.exclude_frozen)
    except ZeroShardError as exc:
        print(f"zeroshard export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(written)} to {args.out}")
    return 0
