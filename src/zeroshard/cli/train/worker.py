"""One rank of `zeroshard train` (started by torchrun): build the model, train it under the
engine, checkpoint when asked, and (rank 0) show progress, a summary and the PNG report.

Run directly under your own torchrun, on one node or many:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \
        -m zeroshard.cli.train.worker --model small --steps 1000
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from rich.console import Console

import zeroshard
from zeroshard import faults
from zeroshard.api.banner import verbose
from zeroshard.cli import rank_guard
from zeroshard.cli.train.args import add_train_arguments, resolve_defaults
from zeroshard.cli.train.config import DEFAULT_STEPS_PER_PRINT, build_config
from zeroshard.cli.train.data import NoTextError, load_tokens, rank_batch
from zeroshard.cli.train.model import ModelSpecError, TrainModel, build_model
from zeroshard.cli.train.report import RunRecord, detail_line, gather_memory, make_progress, memory_line, \
    summary_table, write_report
from zeroshard.cli.train.resources import ResourceLog
from zeroshard.cli.train.resume import client_state, describe, keep_global_batch, restart_count, resume
from zeroshard.policies import ZeroShardError


def train(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    try:
        return _train(args, console)
    except (ZeroShardError, ModelSpecError, NoTextError) as exc:
        rank_guard.report_error("zeroshard train", str(exc))  # under the launcher: one line, once
        return 2


def _train(args: argparse.Namespace, console: Console) -> int:
    resolve_defaults(args)
    torch.manual_seed(args.seed)
    tm = build_model(args.model, args.lora)
    if tm.context is not None and args.seq_len > tm.context:
        raise zeroshard.ConfigError(f"--seq-len {args.seq_len} exceeds the model's context ({tm.context})")
    cfg = build_config(args, tm.unit_classes)
    # this command prints its own per-rank line in place of the engine's rank-0 line
    every = cfg.pop("steps_per_print", None)
    every = DEFAULT_STEPS_PER_PRINT if every is None else every
    rescaled = keep_global_batch(cfg, args.save, int(os.environ.get("WORLD_SIZE", "1")))  # an elastic restart
    engine = zeroshard.initialize(tm.module, cfg)
    if rescaled and engine.rank == 0:
        console.print(rescaled, highlight=False, soft_wrap=True)
    if args.compile:
        engine.compile()
    if engine.rank == 0:  # the start-up block's last line: where checkpoints go
        if engine.compiled is not None:
            console.print(f"  {engine.compiled.describe()}", highlight=False)
        console.print(f"  checkpoints: {args.save}, every {args.save_every} steps and at the end" if args.save else
                      "  checkpoints: none (--save DIR writes them, and the same command resumes from DIR)",
                      highlight=False, soft_wrap=True)
    tokens = load_tokens(args.data, tm.vocab_size)
    rec = _record(engine, tm)
    resources = ResourceLog(getattr(args, "resource_log", None), engine.rank)
    resumed = resume(engine, args)  # --save DIR with a checkpoint: continue from it, never start over
    if resumed is not None:
        done = int(resumed.get("step", engine.global_steps))
        rec.losses = [float(v) for v in resumed.get("losses", [])][-done:] if done else []
        rec.first_step = done - len(rec.losses)  # the curve starts where the recorded losses start
        if engine.rank == 0:
            console.print(describe(resumed, args.steps), highlight=False, soft_wrap=True)
    start = rec.first_step + len(rec.losses)
    resources.record(start, "start")
    _loop(engine, tm, tokens, rec, args, start, every, console, resources)
    resources.record(args.steps, "end")
    per_rank = gather_memory(engine)
    shards = engine.world_size if rec.stage > 0 else 1
    if engine.rank == 0:
        console.print(summary_table(rec, per_rank, shards))
        if args.report:
            console.print(f"report: {write_report(args.report, rec, per_rank, shards)}")
    engine.close()
    return _verdict(rec, console if engine.rank == 0 else None)


def _record(engine, tm: TrainModel) -> RunRecord:
    params = {id(p): p for p in tm.module.parameters()}.values()
    ts = engine.train_state
    return RunRecord(label=tm.label, stage=int(ts.settings.zero.stage), world=ts.world_size,
                     backend=ts.comm.topology.backend, phi=sum(p.numel() for p in params),
                     trainable=sum(p.numel() for p in params if p.requires_grad), itemsize=ts.compute_dtype.itemsize,
                     host_waits=not ts.comm.stream_ordered)


def _loop(engine, tm: TrainModel, tokens, rec: RunRecord, args, start: int, every: int, console,
          resources: ResourceLog) -> None:
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    rec.tokens_per_step = micro * gas * engine.world_size * args.seq_len
    progress = make_progress(console, args.steps, disable=engine.rank != 0)
    rank_guard.set_where(lambda: f"at step {rec.first_step + len(rec.losses)} of {args.steps}")
    killed_before = faults.kill_hook(engine.rank, restart_count())  # a no-op unless a test arms it
    started = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=args.steps, completed=start, loss=math.nan, tps=0.0)
        for step in range(start, args.steps):
            killed_before(step)
            engine.reset_comm_stats()
            total = 0.0
            for m in range(gas):
                x, y = rank_batch(tokens, micro, args.seq_len, step, engine.rank, engine.world_size, args.seed,
                                  micro_step=m, accumulation=gas)
                x, y = x.to(engine.device), y.to(engine.device)
                loss = tm.loss(engine, x, y)
                engine.backward(loss)
                engine.step()
                total += loss.item() / gas
            rec.losses.append(total)
            rec.last_comm = engine.comm_stats()  # read before the memory gather adds to the ledger
            rec.waited += sum(s["waited"] for s in rec.last_comm.values())
            rec.seconds = time.perf_counter() - started
            done = step + 1 - start
            progress.update(task, advance=1, loss=total, tps=done * rec.tokens_per_step / rec.seconds)
            if every and (step + 1) % every == 0:
                per_rank = gather_memory(engine)  # a collective: every rank takes part
                if engine.rank == 0:
                    line = memory_line(step + 1, args.steps, total, engine, per_rank, rec.last_comm, rec.phi)
                    progress.console.print(line, highlight=False, soft_wrap=True)
                    if verbose():
                        progress.console.print(detail_line(per_rank, rec.last_comm), highlight=False, soft_wrap=True)
            if args.save and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
                state = client_state(step + 1, rec.losses, args, micro * gas * engine.world_size, engine.world_size)
                path = engine.save_checkpoint(args.save, client_state=state, keep_last=getattr(args, "keep_last", None))
                if engine.rank == 0:
                    progress.console.print(f"checkpoint: {path}", highlight=False)
                if getattr(args, "reload_checkpoints", False):
                    engine.load_checkpoint(path)  # continue from what was read back
                resources.record(step + 1, "checkpoint")
    rec.seconds = time.perf_counter() - started
    rec.steps_run = args.steps - start
    rec.skipped = engine.skipped_steps


def _verdict(rec: RunRecord, console) -> int:
    """1 when the loss became non-finite; a warning (exit 0) when it merely did not fall."""
    losses = rec.losses
    if not all(math.isfinite(v) for v in losses):
        if console:
            console.print("[red]the loss became non-finite[/red]")
        return 1
    k = max(1, min(10, len(losses) // 2))
    if len(losses) >= 2 and sum(losses[-k:]) >= sum(losses[:k]) and console:
        console.print("[yellow]warning: the loss did not fall; try more --steps or a different lr[/yellow]")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroshard.cli.train.worker")
    add_train_arguments(parser)
    parser.add_argument("--nproc", type=int, default=1)
    rank_guard.install()  # a stop signal ends the rank quietly (also under your own torchrun)
    try:
        return train(parser.parse_args(argv))  # the engine's Topology destroys the group it made
    except rank_guard.StopRequested as stop:
        return rank_guard.stop_code(stop.signum)


if __name__ == "__main__":
    sys.exit(main())
