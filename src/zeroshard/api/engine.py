"""The Engine: forward, backward, step over a data-parallel, ZeRO-sharded model.

    engine = zeroshard.initialize(model, "ds_config.json")
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()          # acts only at the gradient-accumulation boundary

A micro-step is one backward; every `gradient_accumulation_steps` micro-steps the
optimizer steps (a global step). Gradients are averaged over ranks and micro-steps,
so N ranks with micro-batch b train like one process with batch N x b x accumulation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.stages.assembly import (
    broadcast_model,
    build_buckets,
    full_fp32_buckets,
    split_parameters,
    take_masters_and_cast,
)
from zeroshard.api.banner import startup_banner
from zeroshard.api.gathered import register_engine
from zeroshard.comm import Comm, CommLedger, Topology
from zeroshard.config.model_defaults import choose_for_model
from zeroshard.offload import host_step_threads, optimizer_offload_tier, optimizer_tiers, store_value
from zeroshard.optim.clipping import clip_coefficient, global_grad_norm
from zeroshard.optim.loss_scaler import make_loss_scaler
from zeroshard.optim.schedulers import build_scheduler
from zeroshard.optim.sharded import ShardedOptimizer
from zeroshard.optim.template import OptimizerArg, plan_optimizer
from zeroshard.partition import MemoryLedger
from zeroshard.partition.buffer_pool import BufferPool
from zeroshard.partition.heap_trim import HeapTrim
from zeroshard.policies import ConfigError, OffloadDevice, Settings, Stage
from zeroshard.stages.stage3_assembly import build_stage3, make_runtime
from zeroshard.stages.strategy import step_during_backward
from zeroshard.stages.train_state import TrainState
from zeroshard.stages import ParamPublisher, PartitionedParams, ReplicatedParams, build_gradients, shard_count_for

log = logging.getLogger("zeroshard")

SchedulerArg = torch.optim.lr_scheduler.LRScheduler | Callable[[torch.optim.Optimizer], Any] | None


class _Counter:
    """An Engine attribute that reads and writes the same-named field of `train_state.counters`."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, engine, owner=None) -> int:
        return self if engine is None else getattr(engine.train_state.counters, self.name)

    def __set__(self, engine, value: int) -> None:
        setattr(engine.train_state.counters, self.name, value)


class Engine:
    def __init__(self, module: nn.Module, settings: Settings, topology: Topology,
                 optimizer: OptimizerArg = None, lr_scheduler: SchedulerArg = None) -> None:
        self.settings, self.topology = settings, topology
        self.comm = Comm(topology, CommLedger(topology.world_size), settings.runtime.comm_timeout_s)
        self.memory = MemoryLedger()
        self.pool = BufferPool(self.memory)  # large transient buffers reused, not re-faulted
        self.comm.pool = self.pool
        self.compute_dtype = settings.precision.compute.dtype
        if settings.zero.stage != Stage.PARAMETERS:
            module.to(topology.device)  # stage 3 moves one unit at a time
        self.module = module
        parts = split_parameters(module)
        # bucket sizes the config left out are chosen for this model (and printed)
        self.settings = settings = choose_for_model(settings, sum(p.numel() for p in parts.trainable))
        zero = settings.zero
        self.plan = plan_optimizer(optimizer, settings.optimizer, parts.trainable, topology.device)
        offload = optimizer_offload_tier(zero.offload_optimizer, topology.device, settings.aio, topology.rank)
        self._master_writer = self._early_masters(offload)
        if zero.stage == Stage.PARAMETERS:
            masters = self._assemble_stage3(parts)
        else:
            masters = self._assemble_replicated(parts)
        sharded = {id(p) for bucket in self.frozen_buckets for p in bucket.params}  # counted by their buckets
        self.memory.hold("params", "frozen", sum(p.numel() * p.element_size() for p in parts.frozen
                                                 if id(p) not in sharded))
        # a sub-group's 16-bit gradients are upcast to fp32 together: at most one bucket's worth
        sub_group = min(zero.sub_group_size, zero.reduce_bucket_size)
        sizes = [b.shard().numel() for b in self.buckets]
        tiers = optimizer_tiers(zero.offload_optimizer, sizes, topology.device, offload)
        self.host_threads = host_step_threads(topology.local_world_size)[1] if any(
            t.name in ("host", "nvme") for t in tiers) else ""
        self.nvme_lines = self._prepare_nvme(tiers, sizes)
        self.optimizer = ShardedOptimizer(self.buckets, masters, self.plan.build, self.plan.group_options,
                                          self.memory, sub_group, tiers, zero.offload_optimizer.buffer_count)
        self.lr_scheduler = self._make_scheduler(lr_scheduler, optimizer)
        self.step_early, self.step_mode = step_during_backward(settings, self.optimizer.can_step_early)
        host_in_use = topology.device.type == "cpu" or any(t.name in ("host", "nvme") for t in tiers) \
            or zero.offload_param.device is not OffloadDevice.NONE
        self.heap_trim = HeapTrim(settings.runtime.trim_host_memory, host_in_use)
        self.loss_scaler = make_loss_scaler(settings.precision.loss_scale)

        self.train_state = TrainState(self.module, settings, self.comm, self.buckets, self.frozen_buckets,
                                      self.optimizer, self.loss_scaler, self.lr_scheduler,
                                      self.refresh_params_from_masters)
        self._grad_norm: float | None = None
        self._boundary_said: bool | None = None  # set_gradient_accumulation_boundary (None: the counter decides)
        self._window_open = False  # a backward since the last optimizer step or zero_grad
        self._window_micro = 0  # backwards in the open window (for the caller-driven check)
        self._warned_window = False
        self._warned_no_sync = False
        self._timers: dict[str, float] = defaultdict(float)
        self.comm.where = "step 0"
        self.memory.reset_peaks()  # peaks count from training on; building is a one-off
        register_engine(self)
        if topology.rank == 0:
            for line in startup_banner(self, parts):
                log.info(line)

    def _assemble_replicated(self, parts) -> list[torch.Tensor]:
        """Stages 0-2: whole parameters in buckets; optimizer state split `shards` ways."""
        zero, topo = self.settings.zero, self.topology
        shards = shard_count_for(zero.stage, topo.world_size)
        self.buckets = build_buckets(parts, self.plan.group_of, zero.reduce_bucket_size, shards,
                                     topo.rank if shards > 1 else 0, self.memory, self.compute_dtype)
        broadcast_model(self.module, self.buckets, self.comm)
        masters = take_masters_and_cast(self.buckets, self.compute_dtype)
        self._cast_rest()
        self.frozen_buckets: list = []
        self.units: list = []
        self.grads = build_gradients(self.settings, self.buckets, self.comm, self.memory, self.pool)
        publisher = ParamPublisher(self.buckets, self.comm, zero.allgather_bucket_size)
        self.params = ReplicatedParams(publisher if self.grads.publishes_params else None)
        return masters

    def _assemble_stage3(self, parts) -> list[torch.Tensor]:
        """Stage 3: units sharded at rest, small parameters whole, gathered by the runtime."""
        topo = self.topology
        s3 = build_stage3(self.module, parts, self.plan.group_of, self.settings, self.comm, self.memory,
                          topo.device, self._master_writer)
        self.buckets = s3.trainable
        masters = s3.masters
        self._cast_rest()
        self.frozen_buckets = s3.frozen
        self.units = s3.units
        for unit in self.units:
            for bucket in unit.buckets:
                bucket.pool = self.pool
        self.unit_rule = s3.rule
        self.grads = build_gradients(self.settings, self.buckets, self.comm, self.memory, self.pool)
        runtime = make_runtime(s3, self.comm, self.memory, self.settings)
        publisher = ParamPublisher(self.buckets, self.comm, self.settings.zero.allgather_bucket_size)
        self.params = PartitionedParams(runtime, publisher, s3.persistent)
        return masters

    def _param_tiers(self) -> list:
        """The tiers holding stage-3 parameter shards away from the device (offload_param)."""
        homes = {id(t): t for u in getattr(self, "units", []) for b in u.buckets
                 if (t := getattr(b, "_home", None)) is not None}
        return list(homes.values())

    def _early_masters(self, offload):
        """Stage 3 in 16 bits with every master in NVMe files: the build writes each unit's fp32
        masters to the file as it goes (`MasterWriter`) instead of holding them all until the
        optimizer is made. None otherwise (fp32 steps the shards themselves; a `ratio` below 1
        decides per shard once every size is known)."""
        zero = self.settings.zero
        if (offload is None or offload.name != "nvme" or zero.stage != Stage.PARAMETERS
                or zero.offload_optimizer.ratio < 1.0 or self.compute_dtype == torch.float32):
            return None
        from zeroshard.optim.nvme_swap import MasterWriter

        return MasterWriter(offload, self.plan.build, self.plan.group_options, self.topology.local_world_size,
                            zero.offload_optimizer)

    def _prepare_nvme(self, tiers, sizes: list[int]) -> list[str]:
        """offload_optimizer: nvme: space check and I/O self-test before any shard is written
        (done by the build already when it wrote the masters as it went)."""
        nvme = [t for t in tiers if t.name == "nvme"]
        params = [line for t in self._param_tiers() for line in getattr(t, "startup_lines", [])]
        if not nvme:
            return params
        if self._master_writer is not None:
            return params + self._master_writer.lines + [
                "nvme optimizer masters: written to the file unit by unit as the model was built"]
        from zeroshard.optim.nvme_swap import prepare_disk

        return params + prepare_disk(nvme[0], [n for n, t in zip(sizes, tiers) if t.name == "nvme"], self.plan.build,
                            self.plan.group_options, self.topology.local_world_size,
                            self.settings.zero.offload_optimizer)

    def _cast_rest(self) -> None:
        if self.compute_dtype != torch.float32:
            self.module.to(self.compute_dtype)  # parameters outside buckets and buffers

    # -- the training loop ------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.comm.where = f"step {self.global_steps}, forward"
        if self.settings.runtime.cast_forward_inputs and self.compute_dtype != torch.float32:
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        started = time.perf_counter()
        self.params.begin_forward()
        try:
            out = self.module(*args, **kwargs)
        finally:
            self.params.end_forward()
        self._timers["forward"] += time.perf_counter() - started
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` (scaled for fp16 and, unless `scale_wrt_gas=False`, divided by the
        accumulation steps); gradient reductions run inside, overlapping backward where the stage allows."""
        self.comm.where = f"step {self.global_steps}, backward (micro-step {self.micro_steps})"
        gas = self.settings.batch.gradient_accumulation_steps
        started = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        # the first backward of a window overwrites the accumulated gradient: counted by micro-steps,
        # or, where the caller announces boundaries, the first backward since a step or zero_grad
        first = self.micro_steps % gas == 0 if self._boundary_said is None else not self._window_open
        self.grads.begin_backward(boundary, first)
        self._window_open = True
        self._window_micro = 1 if first else self._window_micro + 1
        early = self.step_early and boundary
        self.grads.on_final = self._grad_final if early else None
        self.grads.on_overlap = self._step_queued if early else None
        if early:
            self.optimizer.forget_early()
        self.params.begin_backward()
        scale = self.loss_scaler.scale / gas if scale_wrt_gas else self.loss_scaler.scale
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            self.grads.end_backward()
        finally:
            self.params.end_backward()
        self._timers["backward"] += time.perf_counter() - started
        return loss

    def _grad_final(self, b: int) -> None:
        """Bucket b's reduced gradient is final (during backward): its sub-group may step."""
        self.optimizer.grad_final(b, self.grads.grad_shard, 1.0, self.params.publish)

    def _step_queued(self) -> None:
        """A reduction was just issued: step the final sub-groups now, overlapping it."""
        self.optimizer.step_queued(1.0, self.params.publish)

    def step(self) -> None:
        """At the accumulation boundary: clip, step the sharded optimizer, publish parameters."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        self._check_caller_window()
        self.comm.where = f"step {self.global_steps}, optimizer step"
        started = time.perf_counter()
        loss_scale = self.loss_scaler.scale
        raw = self._raw_grad_norm()
        overflow = raw is not None and not math.isfinite(raw)
        self._grad_norm = raw / loss_scale if raw is not None else None
        if overflow and self.grads.on_final is not None:  # sub-groups already stepped in backward
            log.warning("step %d: gradient norm is %s; the optimizer steps during backward, so this "
                        "step is applied, not skipped (set zeroshard.step_during_backward=false to skip "
                        "steps with non-finite gradients)", self.global_steps, raw)
            overflow = False
        if overflow:
            self.skipped_steps += 1
            log.warning("step %d skipped: gradient norm is %s at loss scale %g (%d skipped so far); "
                        "non-finite gradients on rank %d: %s", self.global_steps, raw, loss_scale,
                        self.skipped_steps, self.rank, self.grads.nonfinite_parameters() or "none in its shard")
        else:
            coef = clip_coefficient(self._grad_norm or 0.0, self.settings.gradient_clipping) / loss_scale
            self.optimizer.step(self.grads.grad_shard, coef, self.params.publish)
            self.params.wait()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.loss_scaler.update(overflow)
        self.grads.zero_grads()
        self._window_open = False
        self.heap_trim()  # free heap pages back to the system (partition/heap_trim.py)
        self.global_steps += 1
        self.micro_steps += 1
        self._timers["step"] += time.perf_counter() - started
        self.comm.where = f"step {self.global_steps}"
        self._maybe_print()

    def _raw_grad_norm(self) -> float | None:
        """Norm of the still loss-scaled gradient; inf or nan means overflow on some rank.
        None when `compute_grad_norm` is off (and no fp16 overflow check is needed)."""
        if not (self.settings.zero.compute_grad_norm or self.settings.precision.loss_scale):
            return None
        shards = [self.grads.grad_shard(b) for b in range(len(self.buckets))]
        return global_grad_norm(shards, self.comm, self.grads.partitioned)

    # -- DeepSpeed-style accessors ----------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """The caller's word (`set_gradient_accumulation_boundary`) where it gave one, else the
        micro-step counter against gradient_accumulation_steps."""
        if self._boundary_said is not None:
            return self._boundary_said
        return (self.micro_steps + 1) % self.settings.batch.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Let the caller decide (as DeepSpeed's engine does for Accelerate and Trainer, which call
        `step()` only at the boundary): the next backward reduces for, and the next `step()` takes,
        an optimizer step exactly when `is_boundary` is True. None gives the decision back to the
        micro-step counter."""
        self._boundary_said = None if is_boundary is None else bool(is_boundary)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last optimizer step: the next backward starts
        a new accumulation window."""
        self.grads.zero_grads()
        self._window_open = False

    def _check_caller_window(self) -> None:
        """A caller-announced boundary after a different number of backwards than the config's
        gradient_accumulation_steps: the caller decides, and says so once."""
        gas = self.settings.batch.gradient_accumulation_steps
        if self._boundary_said is None or self._window_micro in (0, gas) or self._warned_window:
            return
        self._warned_window = True
        log.warning("step %d: the caller announced the accumulation boundary after %d backward(s), the config "
                    "says gradient_accumulation_steps=%d; the optimizer steps at the caller's boundary (the "
                    "loss is still divided by %d unless backward(scale_wrt_gas=False))", self.global_steps,
                    self._window_micro, gas, gas)

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (None before any step)."""
        return self._grad_norm

    def gradient_accumulation_steps(self) -> int:
        return self.settings.batch.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.batch.micro_batch_size

    def train_batch_size(self) -> int:
        return self.settings.batch.train_batch_size

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    # the step counters live in the TrainState (checkpoints read and restore them there)
    global_steps = _Counter()
    micro_steps = _Counter()
    skipped_steps = _Counter()

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @contextlib.contextmanager
    def no_sync(self):
        """Accepted for code written for DDP or Accelerate, and harmless: the engine already
        reduces only at the accumulation boundary (stages 0/1) or must reduce every micro-step
        to keep gradients sharded (stage 2). Use `gradient_accumulation_steps` instead."""
        if not self._warned_no_sync:
            log.warning("engine.no_sync() does nothing: accumulation follows gradient_accumulation_steps")
            self._warned_no_sync = True
        yield

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # -- ledgers ------------------------------------------------------------------------------
    def comm_stats(self, by_scope: bool = False) -> dict:
        """Per collective: calls, elements (full logical tensor), bytes (as sent: quantized
        payload + scales where quantized), sent_bytes, seconds. With `by_scope`, the same per
        scope: {"intra_node": {op: ...}, "inter_node": {op: ...}}; a call on a group whose
        ranks all live on one node (LOCAL_WORLD_SIZE consecutive ranks) is intra-node."""
        return self.comm.ledger.stats(by_scope=by_scope)

    def reset_comm_stats(self) -> None:
        self.comm.ledger.reset()

    def memory_stats(self) -> dict[str, int]:
        """Bytes held now by category (params, grads, optimizer_states, comm_buffers), and peak_*."""
        return self.memory.stats()

    def reset_memory_stats(self) -> None:
        self.memory.reset_peaks()

    def timers(self) -> dict[str, float]:
        """Cumulative seconds in forward, backward and step (wall_clock_breakdown)."""
        return dict(self._timers)

    # -- state -------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor on CPU} on every rank, trainable values from the fp32 masters,
        gathered one bucket at a time (peak: one bucket in fp32). Tied parameters appear
        under each of their names. A collective: every rank must call it."""
        where = {id(p): (b, s) for b, bucket in enumerate(self.buckets) for s, p in enumerate(bucket.params)}
        frozen = {id(p): (b, s) for b, bucket in enumerate(self.frozen_buckets)
                  for s, p in enumerate(bucket.params)}
        full_of: dict[int, torch.Tensor] = {}
        masters = (self.optimizer.master_value(b) for b in range(len(self.buckets)))  # one at a time (nvme)
        for bucket, full in full_fp32_buckets(self.buckets, masters, self.comm,
                                              self.grads.partitioned):
            full_of[id(bucket)] = full.cpu()
        for bucket in self.frozen_buckets:
            full = bucket.new_full()
            self.comm.all_gather(full, bucket.gather_input(),
                                 what=f"full state dict, frozen unit '{bucket.name}'").wait()
            full_of[id(bucket)] = full.float().cpu()
            self.memory.release("params", f"{bucket.key}.full")
        out: dict[str, torch.Tensor] = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in where or id(t) in frozen:
                b, s = where[id(t)] if id(t) in where else frozen[id(t)]
                bucket = self.buckets[b] if id(t) in where else self.frozen_buckets[b]
                slot = bucket.slots[s]
                out[name] = full_of[id(bucket)][slot.offset : slot.end].view(slot.shape).clone()
            else:
                t = t.detach()
                out[name] = (t.float() if t.is_floating_point() else t).cpu().clone()
        return out

    def refresh_params_from_masters(self) -> None:
        """Write every fp32 master shard into its bucket (in the compute dtype) and publish
        it to all ranks, as after an optimizer step. For checkpoint loading and user edits."""
        for b, bucket in enumerate(self.buckets):
            master = self.optimizer.master_value(b)  # read from its file on the nvme tier
            if master.data_ptr() != bucket.shard().data_ptr():
                store_value(bucket.shard(), master)  # in memory, or in its nvme file (offload_param)
            self.params.publish(b)
        self.params.wait()

    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: dict | None = None,
                        keep_last: int | None = None) -> str:
        """Every rank writes its shards under `save_dir/<tag>`, then `latest` names it (zeroshard.checkpoint)."""
        from zeroshard.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag, client_state, keep_last)

    def load_checkpoint(self, load_dir, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> dict:
        """Load a checkpoint of any world size, stage and bucket sizes; returns its client_state."""
        from zeroshard.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)

    def save_16bit_model(self, save_dir, max_shard_size: int | str = "5GB") -> list[str]:
        """The model's weights in the compute dtype as Hugging Face style safetensors (rank 0 writes)."""
        from zeroshard.checkpoint import save_16bit_model

        return save_16bit_model(self, save_dir, max_shard_size)

    def save_adapter(self, save_dir) -> list[str]:
        """The LoRA adapter in peft's format (adapter_model.safetensors + adapter_config.json);
        rank 0 writes, call on every rank. Stage 3 gathers trainable buckets only."""
        from zeroshard.checkpoint.adapter import save_adapter

        return save_adapter(self, save_dir)

    def close(self) -> None:
        """Remove hooks, and destroy the process group if `initialize` created it."""
        self.grads.remove_hooks()
        self.params.remove_hooks()
        self.optimizer.close()  # the nvme tier's files go
        for tier in self._param_tiers():
            tier.close()
        if getattr(self, "activation_offload", None) is not None:  # set by initialize(); its files go
            self.activation_offload.close()
        self.topology.destroy()

    # -- internals ----------------------------------------------------------------------------
    def _make_scheduler(self, arg: SchedulerArg, user_optimizer: OptimizerArg):
        inner = self.optimizer.optimizer
        if arg is None:
            spec = self.settings.scheduler
            return build_scheduler(spec, inner) if spec is not None else None
        if isinstance(arg, torch.optim.lr_scheduler.LRScheduler):
            if arg.optimizer is not user_optimizer:
                raise ConfigError("lr_scheduler must be built over the optimizer given to initialize(), "
                                  "or be a callable optimizer -> scheduler")
            return _rebind_scheduler(arg, inner)
        return arg(inner)

    def _maybe_print(self) -> None:
        every = self.settings.steps_per_print
        if not every or self.global_steps % every or self.rank != 0:
            return
        mem = self.memory_stats()
        log.info("step %d | lr %s | grad norm %.4g | loss scale %g | skipped %d | MB params %.1f grads %.1f "
                 "optim %.1f", self.global_steps, ", ".join(f"{lr:.3g}" for lr in self.get_lr()),
                 self._grad_norm or 0.0, self.loss_scale, self.skipped_steps, mem["params"] / 2**20,
                 mem["grads"] / 2**20, mem["optimizer_states"] / 2**20)
        if self.settings.wall_clock_breakdown:
            log.info("time (s): %s", ", ".join(f"{k} {v:.3f}" for k, v in self._timers.items()))
        if self.settings.comms_logger.enabled:
            for op, s in self.comm_stats().items():
                if s["calls"]:
                    log.info("comm %-14s calls %d elements %d sent MB %.2f s %.3f", op, s["calls"],
                             s["elements"], s["sent_bytes"] / 2**20, s["seconds"])


def _rebind_scheduler(scheduler, inner: torch.optim.Optimizer):
    """Point a scheduler built over the user's optimizer at the shard optimizer (same
    groups, same order, so its base_lrs hold). torch marks the optimizer's `step` so the
    scheduler can check the call order; the new optimizer gets the same mark."""
    scheduler.optimizer = inner
    for group, lr in zip(inner.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    step = inner.step

    def tracked_step(*args, **kwargs):
        inner._opt_called = True
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True
    inner.step = tracked_step
    return scheduler


def _cast_floats(obj, dtype: torch.dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj

