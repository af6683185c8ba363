"""`zeroshard bench`: zeroshard's ZeRO stages and offload beside DDP, FSDP2 and DeepSpeed, on
one workload, with the figures a user needs to choose a stage.

    zeroshard bench                                   # 10M GPT, the default systems, 2 ranks
    zeroshard bench --model 50M --out bench-50m
    zeroshard bench --systems ddp,zs2,zs3 --steps 5 --warmup 2
    zeroshard bench --sizes 10M,50M,150M --systems ddp,fsdp2,zs2,zs3   # how they grow with size
    zeroshard bench --model hf:path/to/config.json --seq-len 64
    zeroshard bench --model 50M --systems ddp,zs2 --rounds 3   # interleaved rounds, steps pooled

Every system runs as its own torchrun job (one process group per system, `--nproc` ranks)
on the same model (same seed), the same batches, the same optimizer (AdamW, fused kernel),
the same intra-op threads per rank, the same warm-up and measured steps. The table shows
the median step time with its spread, tokens/s, peak RSS per rank, model-state bytes by
category (and by tier, from zeroshard's memory ledger), communication per step in Phi and
bytes (zeroshard's comm ledger) and how far each loss curve is from DDP's; then the ratios
and a report that answers the usual questions about ZeRO with these measurements.
--out DIR gets bench.json, bench.png (with the `plot` extra: matplotlib) and each run's log.

Systems (--systems, comma-separated; `zeroshard bench --list` describes them):
  ddp zero1_torch fsdp2  zs0 zs1 zs2 zs3 zs2_offload zs3_offload zs2_no_overlap
  zs2_no_contiguous zs3_defaults zs2_ds zs3_fsdp2  ds0 ds1 ds2 ds3 ds2_offload ds3_offload (DeepSpeed)
DeepSpeed's rows run when it imports (with DS_ACCELERATOR=cpu); named explicitly, a missing
DeepSpeed is an error. Timings on a shared machine are noisy: read the spread.
"""

from __future__ import annotations

import argparse
import sys

from zeroshard.bench.systems import DEFAULT_SYSTEMS, SYSTEMS, resolve_systems
from zeroshard.cli.launch_cmd import check_nproc

__all__ = ["model_spec", "register", "run", "run_preset"]

def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark ZeRO stages and offload beside DDP, FSDP2 and DeepSpeed",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, metavar="NAME",
                   help="10M | 50M | 150M (zeroshard's GPT presets), any `zeroshard train --model` name, or "
                        "hf:PATH/config.json (default 10M)")
    p.add_argument("--sizes", metavar="A,B,..", help="several models in one run (e.g. 10M,50M,150M): every "
                                                     "system on each, and the growth plot")
    p.add_argument("--systems", metavar="A,B,..",
                   help=f"systems to run (default {','.join(DEFAULT_SYSTEMS)}; DeepSpeed's when importable)")
    p.add_argument("--list", action="store_true", help="describe every system and exit")
    p.add_argument("--steps", type=int, default=10, help="measured steps per system (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    p.add_argument("--rounds", type=int, default=1, help="run the whole set of systems this many times, "
                   "interleaved; each system's measured steps of all rounds pooled (default 1)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per system (default 2)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank, every system (default 1)")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per rank per step (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute: zeroshard and DeepSpeed bf16 with fp32 "
                   "masters, FSDP2 MixedPrecisionPolicy, DDP autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="zeroshard-bench", metavar="DIR",
                   help="folder for bench.json, bench.png and logs (default ./zeroshard-bench)")
    p.add_argument("--timeout", type=int, default=1800, metavar="S", help="limit per system run (default 1800)")
    p.set_defaults(func=run)


def model_spec(name: str) -> str:
    """`--model` as `build_model` reads it: the size names in any case, others unchanged."""
    return name.lower() if name.lower() in ("10m", "50m", "150m") else name


def check_args(args: argparse.Namespace) -> str | None:
    from zeroshard.cli.train.model import check_model

    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1),
                               ("--micro-batch", args.micro_batch, 1), ("--seq-len", args.seq_len, 1),
                               ("--threads", args.threads, 1), ("--timeout", args.timeout, 1)):
        if value < least:
            return f"{flag} must be at least {least}, got {value}"
    if args.sizes and args.model:
        return "give --model or --sizes, not both (--sizes runs every model it lists)"
    if args.sizes is not None and not args.models:
        return "--sizes is empty; list models, e.g. --sizes 10M,50M"
    if len(set(args.models)) != len(args.models):
        return f"--sizes names a model twice: {args.sizes}"
    for m in args.models:
        problem = check_model(m, args.seq_len, None)
        if problem:
            return problem.replace("--model", "--sizes" if args.sizes else "--model", 1)
    return check_nproc(args.nproc)


def _measure(args: argparse.Namespace, report: bool) -> tuple[int, dict | None]:
    """Check, run, write bench.json (and print the report when `report`); (exit code, result)."""
    args.models = [model_spec(m.strip()) for m in (args.sizes.split(",") if args.sizes else [args.model or "10M"])
                   if m.strip()]
    problem = check_args(args)
    systems, notes = [], []
    if not problem:
        systems, notes, problem = resolve_systems(args.systems)
    if problem:
        print(f"zeroshard bench: {problem}", file=sys.stderr)
        return 2, None
    from zeroshard.bench.launch import run_all
    from zeroshard.bench.report import add_report, print_report, write_outputs

    for note in notes:
        print(f"note: {note}", flush=True)
    result = add_report(run_all(args, systems))
    result["notes"] = notes
    if report:
        print_report(result)
    for p in write_outputs(result, args.out):
        print(p, flush=True)
    failed = [f"{m}:{name}" for m, run_ in result["runs"].items() for name in run_["failed"]]
    if failed:
        print(f"zeroshard bench: failed: {', '.join(failed)} (see the logs in {args.out}/runs)", file=sys.stderr)
        return 1, result
    return 0, result


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, s in SYSTEMS.items():
            print(f"{name:<18} {'default ' if s.default else '        '}{s.description}")
        return 0
    return _measure(args, report=True)[0]


def run_preset(argv: list[str]) -> tuple[int, dict | None]:
    """`zeroshard bench ARGV` for the scripts in bench/ (presets of this harness): the same checks,
    jobs and bench.json, without the printed report (the script prints its own); (exit code,
    the result `bench.json` holds, or None when the arguments were refused)."""
    parser = argparse.ArgumentParser(prog="zeroshard")
    register(parser.add_subparsers())
    return _measure(parser.parse_args(["bench", *argv]), report=False)
