"""What the engine prints at start-up: the effective settings, so nothing is a surprise."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroshard.partition.unit_bucket import UnitBucket
from zeroshard.policies import Stage
from zeroshard.stages.assembly import ModelParts
from zeroshard.stages.units import describe_units

if TYPE_CHECKING:
    from zeroshard.api.engine import Engine


def _elements(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def startup_banner(engine: "Engine", parts: ModelParts) -> list[str]:
    s, topo = engine.settings, engine.topology
    p, z, b = s.precision, s.zero, s.batch
    phi = sum(x.numel() for x in parts.trainable)
    frozen = sum(x.numel() for x in parts.frozen)
    padding = sum(bk.layout.padding for bk in engine.buckets)
    scaling = "off"
    if p.loss_scale is not None:
        ls = p.loss_scale
        scaling = (f"dynamic from 2^{ls.initial_scale_power}, window {ls.loss_scale_window}, "
                   f"hysteresis {ls.hysteresis}, min {ls.min_loss_scale:g}") if ls.dynamic else f"static {ls.static_scale:g}"
    clip = f"{s.gradient_clipping:g}" if s.gradient_clipping > 0 else "off"
    kernel = "fused" if engine.optimizer.optimizer.defaults.get("fused") else (
        "foreach" if engine.optimizer.optimizer.defaults.get("foreach") else "default")
    lines = [
        f"zeroshard: ZeRO stage {int(z.stage)} on {topo.world_size} rank(s) ({topo.backend}, {topo.device.type})",
        f"  parameters: {_elements(phi)} trainable ({phi:,}) + {_elements(frozen)} frozen, in "
        f"{len(engine.buckets)} bucket(s), padding {padding} elements",
        f"  precision: params {p.compute.value}, compute {p.compute.value}, reduce {p.reduce.value}, "
        f"master {p.master.value}, optimizer states {p.optimizer_states.value}; loss scaling {scaling}",
        f"  optimizer: {engine.plan.description} ({kernel} kernel), "
        f"{type(engine.optimizer.optimizer).__name__} over fp32 shards; "
        f"scheduler: {type(engine.lr_scheduler).__name__ if engine.lr_scheduler else 'none'}",
        f"  optimizer step: {engine.step_mode}",
        f"  gradient clipping: {clip}"
        + ("" if s.gradient_clipping > 0 else " (DeepSpeed 0.19 defaults to 1.0; zeroshard clips only when asked)"),
        f"  batch: {b.train_batch_size} = micro {b.micro_batch_size} x accumulation "
        f"{b.gradient_accumulation_steps} x ranks {topo.world_size}",
        f"  buckets: reduce {z.reduce_bucket_size:,} / all-gather {z.allgather_bucket_size:,} elements; "
        f"overlap_comm {'on' if z.overlap_comm else 'off'}; contiguous_gradients "
        f"{'on' if z.contiguous_gradients else 'off'}; reduce with "
        f"{'reduce-scatter' if z.reduce_scatter else 'all-reduce'}",
        f"  offload: optimizer {z.offload_optimizer.device.value}, parameters {z.offload_param.device.value}; "
        f"collective timeout {s.runtime.comm_timeout_s:g}s",
    ]
    if engine.host_threads:
        lines.append(f"  optimizer shards by tier: {engine.optimizer.tier_summary()}; host step: {kernel} "
                     f"{type(engine.optimizer.optimizer).__name__} kernel, {engine.host_threads}, "
                     + ("during backward (see 'optimizer step')" if engine.step_early
                        else "after backward at the accumulation boundary (as DeepSpeed)")
                     + ("" if topo.device.type == "cuda" else "; host and device are the same memory here: "
                        "no copies, the ledger's tiers say where each byte belongs"))
    lines += [f"  {line}" for line in getattr(engine, "nvme_lines", [])]
    lines.append(f"  host memory: {engine.heap_trim.line}")
    if z.stage == Stage.PARAMETERS:
        persistent = sum(bk.layout.numel for bk in engine.buckets if not isinstance(bk, UnitBucket))
        lines += [f"  {line}" for line in describe_units(engine.units, engine.unit_rule, persistent, z.stage3)]
    lines += [f"  note: {n}" for n in s.notes]
    return lines
