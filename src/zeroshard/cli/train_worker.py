"""One rank of `zeroshard train` (started by torchrun): real training, a live progress
bar and a closing summary of what ZeRO saved and what it cost, from the ledgers."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

import zeroshard
from zeroshard.comm import PAPER_FACTOR
from zeroshard.models import batch_iterator, build_gpt, num_parameters
from zeroshard.models.corpus import stdlib_corpus
from zeroshard.policies import ZeroShardError


def default_config(steps: int) -> dict:
    """The embedded config: stage 2, AdamW with warmup + cosine decay, clipping at 1.0."""
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 50,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": steps, "warmup_num_steps": max(2, steps // 10)}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 200_000, "allgather_bucket_size": 200_000},
    }


def build_config(args: argparse.Namespace) -> dict:
    if args.config:
        try:
            with open(args.config) as fh:
                cfg = json.load(fh)
        except json.JSONDecodeError as exc:
            raise zeroshard.ConfigError(f"{args.config}: not valid JSON at line {exc.lineno}, column "
                                        f"{exc.colno}: {exc.msg}") from None
        except OSError as exc:
            raise zeroshard.ConfigError(f"cannot read config {args.config}: {exc.strerror}") from None
    else:
        cfg = default_config(args.steps)
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg.setdefault("zero_optimization", {})
    if args.stage is not None:
        cfg["zero_optimization"]["stage"] = args.stage
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    try:
        return _train(args, console)
    except ZeroShardError as exc:
        print(f"zeroshard train: {exc}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace, console: Console) -> int:
    torch.manual_seed(args.seed)
    model = build_gpt(args.model)
    if args.seq_len > model.config.block_size:
        raise zeroshard.ConfigError(f"--seq-len {args.seq_len} exceeds the {args.model} model's context "
                                    f"({model.config.block_size})")
    engine = zeroshard.initialize(model, build_config(args))
    rank, world = engine.rank, engine.world_size
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens = stdlib_corpus() % model.config.vocab_size  # bytes folded into small vocabularies
    batches = batch_iterator(tokens, micro, args.seq_len, rank, world, seed=args.seed)
    phi = num_parameters(model, trainable_only=True)
    losses: list[float] = []
    step_comm: dict = {}
    progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                        TextColumn("loss {task.fields[loss]:.3f}  {task.fields[tps]:,.0f} tok/s"),
                        TimeRemainingColumn(), console=console, disable=rank != 0)
    started = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=args.steps, loss=math.nan, tps=0.0)
        for step in range(args.steps):
            engine.reset_comm_stats()
            total = 0.0
            for _ in range(gas):
                x, y = next(batches)
                loss = engine(x, y)[1]
                engine.backward(loss)
                engine.step()
                total += loss.item() / gas
            losses.append(total)
            step_comm = engine.comm_stats()
            elapsed = time.perf_counter() - started
            tps = (step + 1) * gas * micro * args.seq_len * world / elapsed
            progress.update(task, advance=1, loss=total, tps=tps)
    elapsed = time.perf_counter() - started
    if rank == 0:
        _summary(console, engine, phi, losses, step_comm, elapsed, args, world, micro * gas)
    first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
    engine.close()
    return 0 if last < first else 1


def _summary(console, engine, phi, losses, comm, elapsed, args, world, samples) -> None:
    mem = engine.memory_stats()
    held = mem["params"] + mem["grads"] + mem["optimizer_states"]
    itemsize = engine.buckets[0].data.element_size() if engine.buckets else 4
    shards = world if int(engine.settings.zero.stage) > 0 else 1
    plain_dp = 2 * itemsize * phi + mem["optimizer_states"] * shards
    paper = sum(PAPER_FACTOR[op] * s["elements"] for op, s in comm.items() if op != "broadcast")
    table = Table(title="zeroshard train: summary", show_header=False)
    for k, v in [
        ("ZeRO stage / ranks", f"{int(engine.settings.zero.stage)} / {world} ({engine.topology.backend})"),
        ("model", f"GPT {args.model}, Phi = {phi:,} trainable parameters"),
        ("loss", f"{sum(losses[:10]) / len(losses[:10]):.3f} (first 10 steps) -> "
                 f"{sum(losses[-10:]) / len(losses[-10:]):.3f} (last 10)"),
        ("model states per rank", f"{held / 2**20:.2f} MiB vs plain DP {plain_dp / 2**20:.2f} MiB "
                                  f"({held / plain_dp:.2f}x)"),
        ("  of which", f"params {mem['params'] / 2**20:.2f}, grads {mem['grads'] / 2**20:.2f}, "
                       f"optimizer {mem['optimizer_states'] / 2**20:.2f} MiB"),
        ("communication per step", f"{paper / phi:.3f} x Phi (paper units) vs plain DP 2 x Phi"),
        ("throughput", f"{len(losses) * samples * args.seq_len * world / elapsed:,.0f} tokens/s, "
                       f"{elapsed:.1f} s for {len(losses)} steps"),
        ("skipped steps", str(engine.skipped_steps)),
    ]:
        table.add_row(k, v)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    from zeroshard.cli.train_cmd import add_train_arguments

    parser = argparse.ArgumentParser(prog="zeroshard.cli.train_worker")
    add_train_arguments(parser)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        return train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
