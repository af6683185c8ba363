"""What the engine prints at start-up: the effective settings, so nothing is a surprise."""

from __future__ import annotations

import logging
import os
from typing import Any

from zeroshard.comm import Topology
from zeroshard.estimate.byte_units import human_bytes
from zeroshard.policies import Stage
from zeroshard.stages.build import Assembled
from zeroshard.stages.units import describe_units

log = logging.getLogger("zeroshard")
WIDTH = 100  # columns a start-up or step line may take
VERBOSE_ENV = "ZEROSHARD_VERBOSE"  # 1: the whole start-up block and the detail of each step line


def verbose() -> bool:
    """The detail is asked for (`zeroshard train|launch --verbose`, or ZEROSHARD_VERBOSE=1)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."


def _elements(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _reduction(r) -> str:
    """The config's GradientReducePolicy in words."""
    if not r.average:
        return "sum (gradient_allreduce_op \"sum\")"
    if r.prescale:
        return "mean (prescale_gradients: divided by the world size before the sum)"
    if r.predivide_factor != 1.0:
        return f"mean (gradient_predivide_factor {r.predivide_factor:g}: divided by it before the sum)"
    return "mean"


def startup_banner(run: Assembled, topo: Topology, lr_scheduler: Any) -> list[str]:
    """The lines printed once the run is assembled (`run`: what `stages.build.assemble` made)."""
    s, parts = run.settings, run.parts
    p, z, b = s.precision, s.zero, s.batch
    phi = sum(x.numel() for x in parts.trainable)
    frozen = sum(x.numel() for x in parts.frozen)
    padding = sum(bk.layout.padding for bk in run.buckets)
    scaling = "off"
    if p.loss_scale is not None:
        ls = p.loss_scale
        scaling = (f"dynamic from 2^{ls.initial_scale_power}, window {ls.loss_scale_window}, "
                   f"hysteresis {ls.hysteresis}, min {ls.min_loss_scale:g}") if ls.dynamic else f"static {ls.static_scale:g}"
        if ls.rule == "torch":
            scaling = "torch GradScaler's (from 2^16, x2 after 2000 good steps, /2 at an overflow)"
    clip = f"{s.gradient_clipping:g}" if s.gradient_clipping > 0 else "off"
    kernel = "fused" if run.optimizer.optimizer.defaults.get("fused") else (
        "foreach" if run.optimizer.optimizer.defaults.get("foreach") else "default")
    lines = [
        f"zeroshard: ZeRO stage {int(z.stage)} on {topo.world_size} rank(s) ({topo.backend}, {topo.device.type})",
        f"  parameters: {_elements(phi)} trainable ({phi:,}) + {_elements(frozen)} frozen, in "
        f"{len(run.buckets)} bucket(s), padding {padding} elements",
        f"  precision: params {p.compute.value}, compute {p.compute.value}, reduce {p.reduce.value}, "
        f"master {p.master.value}, optimizer states {p.optimizer_states.value}; loss scaling {scaling}",
        f"  optimizer: {run.plan.description}" if run.inference_only else
        f"  optimizer: {run.plan.description} ({kernel} kernel), "
        f"{type(run.optimizer.optimizer).__name__} over fp32 shards; "
        f"scheduler: {type(lr_scheduler).__name__ if lr_scheduler else 'none'}",
        f"  optimizer step: {run.step_mode}",
        f"  gradient clipping: {clip}"
        + ("" if s.gradient_clipping > 0 else " (DeepSpeed 0.19 defaults to 1.0; zeroshard clips only when asked)")
        + f"; gradients reduced as the {_reduction(s.gradient_reduce)} over ranks",
        f"  batch: {b.train_batch_size} = micro {b.micro_batch_size} x accumulation "
        f"{b.gradient_accumulation_steps} x ranks {topo.world_size}",
        f"  buckets: reduce {z.reduce_bucket_size:,} / all-gather {z.allgather_bucket_size:,} elements; "
        f"overlap_comm {'on' if z.overlap_comm else 'off'}; contiguous_gradients "
        f"{'on' if z.contiguous_gradients else 'off'}; reduce with "
        f"{'reduce-scatter' if z.reduce_scatter else 'all-reduce'}",
        f"  offload: optimizer {z.offload_optimizer.device.value}, parameters {z.offload_param.device.value}; "
        f"collective timeout {s.runtime.comm_timeout_s:g}s",
    ]
    if run.host_threads:
        lines.append(f"  optimizer shards by tier: {run.optimizer.tier_summary()}; host step: {kernel} "
                     f"{type(run.optimizer.optimizer).__name__} kernel, {run.host_threads}, "
                     + ("during backward (see 'optimizer step')" if run.step_early
                        else "after backward at the accumulation boundary (as DeepSpeed)")
                     + ("" if topo.device.type == "cuda" else "; host and device are the same memory here: "
                        "no copies, the ledger's tiers say where each byte belongs"))
    lines += [f"  {line}" for line in run.nvme_lines]
    lines.append(f"  host memory: {run.heap_trim.line}")
    if z.stage == Stage.PARAMETERS:
        in_units = {id(bk) for u in run.units for bk in u.buckets}
        persistent = sum(bk.layout.numel for bk in run.buckets if id(bk) not in in_units)
        lines += [f"  {line}" for line in describe_units(run.units, run.unit_rule, persistent, z.stage3)]
    lines += [f"  note: {n}" for n in s.notes]
    return lines


def startup_summary(run: Assembled, topo: Topology, lr_scheduler: Any, memory: dict[str, int]) -> list[str]:
    """What a user decides from, in at most 5 lines of at most WIDTH columns: stage, ranks and
    parameters; precision, optimizer and clipping; batch; model-state memory per rank and
    offload; the config notes (read them with ZEROSHARD_VERBOSE=1 / --verbose)."""
    s, parts = run.settings, run.parts
    p, z, b = s.precision, s.zero, s.batch
    phi, frozen = sum(x.numel() for x in parts.trainable), sum(x.numel() for x in parts.frozen)
    scaling = "off" if p.loss_scale is None else "dynamic" if p.loss_scale.dynamic else "static"
    master = "" if p.master == p.compute else f", master {p.master.value}"
    if s.runtime.autocast:
        master += f", forward under torch.autocast({s.runtime.autocast})"
    clip = f"{s.gradient_clipping:g}" if s.gradient_clipping > 0 else "off"
    kernel = "fused" if run.optimizer.optimizer.defaults.get("fused") else "torch"
    states = {k: memory.get(k, 0) for k in ("params", "grads", "optimizer_states")}
    lines = [
        f"zeroshard: ZeRO stage {int(z.stage)} on {topo.world_size} rank(s) ({topo.backend}, {topo.device.type}), "
        f"{_elements(phi)} trainable + {_elements(frozen)} frozen parameters",
        f"  precision {p.compute.value}{master}, loss scaling {scaling}; " + (
            "optimizer none (inference only)" if run.inference_only else
            f"{type(run.optimizer.optimizer).__name__} ({kernel}), scheduler "
            f"{type(lr_scheduler).__name__ if lr_scheduler else 'none'}; clipping {clip}"),
        f"  batch {b.train_batch_size} = micro {b.micro_batch_size} x accumulation {b.gradient_accumulation_steps} "
        f"x ranks {topo.world_size}; offload: optimizer {z.offload_optimizer.device.value}, parameters "
        f"{z.offload_param.device.value}",
        f"  memory per rank: params {human_bytes(states['params'])}, grads {human_bytes(states['grads'])}, optimizer "
        + (f"{human_bytes(states['optimizer_states'])}" if states["optimizer_states"] else
           "states from the first step"),
    ]
    if s.notes:  # each note's head (up to its first ' (' or ';'), the whole of them with --verbose
        heads = "; ".join(n.split(" (")[0].split("; ")[0][:60] for n in s.notes)
        lines.append(_fit(f"  {len(s.notes)} note(s), all with --verbose / {VERBOSE_ENV}=1: {heads}"))
    return [_fit(line) for line in lines]


def log_startup(run: Assembled, topo: Topology, lr_scheduler: Any, memory: dict[str, int],
                extra: list[str]) -> None:
    """Rank 0: the summary, or with verbose() the whole block (startup_banner + `extra`)."""
    lines = startup_banner(run, topo, lr_scheduler) + extra if verbose() else \
        startup_summary(run, topo, lr_scheduler, memory)
    for line in lines:
        log.info(line)


REDUCE_OPS = ("reduce_scatter", "all_reduce", "all_to_all")  # gradient reductions (qgZ: all-to-all)


def wall_clock_per_step(engine, steps: int) -> dict[str, float]:
    """Milliseconds per step in forward, backward, reduce (the gradient collectives' time in the
    traffic ledger, inside backward where it overlaps) and step, over the last `steps` steps."""
    now = {**engine.timers(), "reduce": sum(engine.comm.ledger.lifetime()[op]["seconds"] for op in REDUCE_OPS)}
    last = getattr(engine, "_wall_clock_printed", {})
    engine._wall_clock_printed = now
    return {k: (now.get(k, 0.0) - last.get(k, 0.0)) * 1000.0 / steps for k in ("forward", "backward", "reduce", "step")}


def log_step(engine) -> None:
    """Every `steps_per_print` steps on rank 0: lr, norm, loss scale, skipped steps, memory;
    with wall_clock_breakdown the timers, with comms_logger the collectives."""
    every = engine.settings.steps_per_print
    if not every or engine.global_steps % every or engine.rank != 0:
        return
    mem = engine.memory_stats()
    log.info("step %d | lr %s | grad norm %.4g | loss scale %g | skipped %d | params %s grads %s optim %s",
             engine.global_steps, ", ".join(f"{lr:.3g}" for lr in engine.get_lr()),
             engine.get_global_grad_norm() or 0.0, engine.loss_scale, engine.skipped_steps,
             human_bytes(mem["params"]), human_bytes(mem["grads"]), human_bytes(mem["optimizer_states"]))
    if engine.settings.wall_clock_breakdown:
        log.info("time per step (ms, mean of the last %d): %s", every, ", ".join(
            f"{k} {v:.1f}" for k, v in wall_clock_per_step(engine, every).items()))
    if engine.settings.comms_logger.enabled:
        for op, s in engine.comm_stats().items():
            if s["calls"]:
                log.info("comm %-14s calls %d elements %d sent MB %.2f s %.3f", op, s["calls"],
                         s["elements"], s["sent_bytes"] / 2**20, s["seconds"])
