"""The Engine: forward, backward, step over a data-parallel, ZeRO-sharded model.

    engine = zeroshard.initialize(model, "ds_config.json")
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()          # acts only at the gradient-accumulation boundary

A micro-step is one backward; every `gradient_accumulation_steps` micro-steps the
optimizer steps (a global step). Gradients are averaged over ranks and micro-steps,
so N ranks with micro-batch b train like one process with batch N x b x accumulation.
What the stage decides (buckets, strategies, tiers, the sharded optimizer) is built by
`stages.build.assemble`; the Engine runs the loop over it.
"""

from __future__ import annotations

import logging
import math
import gc
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.api.banner import log_startup, log_step
from zeroshard.api.compiled import take_over_module_compiles
from zeroshard.api.gathered import register_engine, unregister_engine
from zeroshard.api.offload_states import EngineStates
from zeroshard.api.surface import EngineSurface, autocast_forward, cast_floats, needs_grad
from zeroshard.comm import Comm, CommLedger, Topology
from zeroshard.monitor import open_monitors
from zeroshard.monitor.flops import open_flops_profiler
from zeroshard.offload import activations
from zeroshard.optim.clipping import clip_coefficient, global_grad_norm, nonfinite_parameters, square_norm
from zeroshard.optim.loss_scaler import make_loss_scaler
from zeroshard.optim.schedulers import make_scheduler
from zeroshard.optim.template import NO_OPTIMIZER, OptimizerArg
from zeroshard.partition import MemoryLedger
from zeroshard.partition.buffer_pool import BufferPool
from zeroshard.policies import ConfigError, Settings
from zeroshard.stages.build import assemble
from zeroshard.stages.generation import generation
from zeroshard.stages.state_dict import full_state_dict
from zeroshard.stages.train_state import TrainState

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


class Engine(EngineSurface):
    def __init__(self, module: nn.Module, settings: Settings, topology: Topology,
                 optimizer: OptimizerArg = None, lr_scheduler: SchedulerArg = None) -> None:
        self.topology, self.module = topology, module
        self.memory = MemoryLedger()
        self.pool = BufferPool(self.memory)  # large transient buffers reused, not re-faulted
        self.comm = Comm(topology, CommLedger(topology.world_size), settings.runtime.comm_timeout_s, pool=self.pool)
        run = assemble(module, settings, self.comm, self.memory, self.pool, optimizer)
        self.settings = settings = run.settings
        self.compute_dtype = settings.precision.compute.dtype
        self.plan, self.buckets, self.frozen_buckets = run.plan, run.buckets, run.frozen_buckets
        self.grads, self.params, self.optimizer = run.grads, run.params, run.optimizer
        self.units, self.unit_rule, self.param_tiers = run.units, run.unit_rule, run.param_tiers
        self.step_early, self.step_mode, self.heap_trim = run.step_early, run.step_mode, run.heap_trim
        self.inference_only = run.inference_only  # built without an optimizer: forward only
        self.lr_scheduler = make_scheduler(lr_scheduler, optimizer, self.optimizer.optimizer, settings.scheduler)
        self.loss_scaler = make_loss_scaler(settings.precision.loss_scale)
        self.train_state = TrainState(self.module, settings, self.comm, self.buckets, self.frozen_buckets,
                                      self.optimizer, self.loss_scaler, self.lr_scheduler,
                                      self.refresh_params_from_masters)
        self._grad_norm: float | None = None
        self._stepping_early = False  # the last backward stepped sub-groups as their gradients were final
        self._early_squares: dict[int, torch.Tensor] = {}  # bucket -> square_norm, taken as it became final
        self._boundary_said: bool | None = None  # set_gradient_accumulation_boundary (None: the counter decides)
        self._window_open = False  # a backward since the last optimizer step or zero_grad
        self._window_micro = 0  # backwards in the open window (for the caller-driven check)
        self._warned_window = False
        self._warned_no_sync = False
        self._timers: dict[str, float] = defaultdict(float)
        self.states = EngineStates(self)  # offload_states / reload_states
        self.compiled = None  # engine.compile()'s CompiledRegions (api/compiled.py)
        self._compiles_checked = False
        self.comm.where = "step 0"
        self.memory.reset_peaks()  # peaks count from training on; building is a one-off
        register_engine(self)
        # zeroshard's checkpoint function (zeroshard.checkpoint_activations, deepspeed.checkpointing)
        # keeps segment inputs where the config says, counted in this engine's memory ledger
        store = activations.ActivationOffload(settings.activations, settings.aio, self.memory, topology.rank)
        self.activation_offload = activations.configure(store)
        if topology.rank == 0:
            log_startup(run, topology, self.lr_scheduler, self.memory.stats(), [f"  {store.describe()}"])
        self.monitors = open_monitors(settings.monitors, topology.rank)  # rank 0's writers, if any
        self.flops_profiler = open_flops_profiler(settings.raw.get("flops_profiler"), module, [
            b.layout for b in (*self.buckets, *self.frozen_buckets)], topology.rank)
        section = settings.raw.get("compile") or {}
        if section.get("enabled"):  # the config's compile section: compiled now, as engine.compile()
            self.compile(section.get("backend"), section.get("kwargs"))

    # -- the training loop ------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.states.check("forward")
        self.comm.where = f"step {self.global_steps}, forward"
        if self.settings.runtime.cast_forward_inputs and self.compute_dtype != torch.float32:
            args, kwargs = cast_floats((args, kwargs), self.compute_dtype)
        started = time.perf_counter()
        # an inference-only engine's parameters are frozen and it never runs a backward of its own:
        # at stage 3 nothing would gather its units for a backward through it to its inputs
        if self.inference_only and self.units and torch.is_grad_enabled() and needs_grad((args, kwargs)):
            raise ConfigError("an input of this engine's forward requires a gradient, but the engine has no "
                              "optimizer (inference only) and at stage 3 serves no backward: run it under "
                              "torch.no_grad(), detach the input, or give initialize() an optimizer")
        if self.flops_profiler:
            self.flops_profiler.begin_forward(self.global_steps, args, kwargs)
        if self.compiled is not None:
            self.compiled.step_begins()
        if self.stage3 is not None and not self._compiles_checked:
            self._compiles_checked = True  # checked once, at the first forward (Accelerate compiles after initialize)
            take_over_module_compiles(self.stage3)
        self.params.begin_forward()
        try:
            with autocast_forward(self.settings.runtime.autocast, self.topology.device):
                out = self.module(*args, **kwargs)
        finally:
            self.params.end_forward()
            if self.flops_profiler:
                self.flops_profiler.end_forward()
        self._timers["forward"] += time.perf_counter() - started
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` (scaled for fp16 and, unless `scale_wrt_gas=False`, divided by the
        accumulation steps); gradient reductions run inside, overlapping backward where the stage allows."""
        if self.inference_only:
            raise ConfigError(NO_OPTIMIZER)
        self.states.check("backward")
        self.comm.where = f"step {self.global_steps}, backward (micro-step {self.micro_steps})"
        gas = self.settings.batch.gradient_accumulation_steps
        started = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        # the first backward of a window overwrites the accumulated gradient: counted by micro-steps,
        # or, where the caller announces boundaries, the first backward since a step or zero_grad
        first = self.micro_steps % gas == 0 if self._boundary_said is None else not self._window_open
        self._window_open = True
        self._window_micro = 1 if first else self._window_micro + 1
        self._stepping_early = self.step_early and boundary
        if self._stepping_early:
            self.optimizer.forget_early()
            self._early_squares.clear()
            self.grads.begin_backward(boundary, first, self._grad_final, self._step_queued)
        else:
            self.grads.begin_backward(boundary, first)
        self.params.begin_backward()
        scale = self.loss_scaler.scale / gas if scale_wrt_gas else self.loss_scaler.scale
        try:
            if self.monitors:
                self.monitors.saw_loss(loss)
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            self.grads.end_backward()
        finally:
            self.params.end_backward()
        self._timers["backward"] += time.perf_counter() - started
        return loss

    def _grad_final(self, b: int) -> None:
        """Bucket b's reduced gradient is final (during backward): its sub-group may step, and its
        share of the gradient norm is taken now, overlapping backward, not in `step()`."""
        if self.settings.zero.compute_grad_norm:
            self._early_squares[b] = square_norm(self.grads.grad_shard(b))
        self.optimizer.grad_final(b, self.grads.grad_shard, 1.0, self.params.publish)

    def _step_queued(self) -> None:
        """A reduction was just issued: step the final sub-groups now, overlapping it."""
        self.optimizer.step_queued(1.0, self.params.publish)

    def step(self) -> None:
        """At the accumulation boundary: clip, step the sharded optimizer, publish parameters."""
        if self.inference_only:
            raise ConfigError(NO_OPTIMIZER)
        self.states.check("step")
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
        if overflow and self._stepping_early:  # sub-groups already stepped in backward
            log.warning("step %d: gradient norm is %s; the optimizer steps during backward, so this "
                        "step is applied, not skipped (set zeroshard.step_during_backward=false to skip "
                        "steps with non-finite gradients)", self.global_steps, raw)
            overflow = False
        if overflow:
            self.skipped_steps += 1
            log.warning("step %d skipped: gradient norm is %s at loss scale %g (%d skipped so far); "
                        "non-finite gradients on rank %d: %s", self.global_steps, raw, loss_scale, self.skipped_steps,
                        self.rank, nonfinite_parameters(self.buckets, self.grads.grad_shard) or "none in its shard")
        else:
            coef = clip_coefficient(self._grad_norm or 0.0, self.settings.gradient_clipping) / loss_scale
            self.optimizer.step(self.grads.grad_shard, coef, self.params.publish)
            self.params.wait()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.loss_scaler.update(overflow)
        self.grads.zero_grads()
        self._window_open = False
        self.pool.end_period()  # idle pooled buffers: at most what this step had out at once
        self.heap_trim()  # free heap pages back to the system (partition/malloc_trim.py)
        self.global_steps += 1
        self.micro_steps += 1
        self._timers["step"] += time.perf_counter() - started
        self.comm.where = f"step {self.global_steps}"
        if self.compiled is not None:
            self.compiled.step_ends()
        log_step(self)
        self.monitors.after_step(self)
        if self.flops_profiler:
            self.flops_profiler.finish(self)

    def _raw_grad_norm(self) -> float | None:
        """Norm of the still loss-scaled gradient; inf or nan means overflow on some rank.
        None when `compute_grad_norm` is off (and no fp16 overflow check is needed)."""
        if not (self.settings.zero.compute_grad_norm or self.settings.precision.loss_scale):
            return None
        shards = [self.grads.grad_shard(b) for b in range(len(self.buckets))]
        known = self._early_squares if self._stepping_early else None
        if self.grads.local:  # each rank's own gradient (a 1-bit optimizer's step): the ranks' RMS norm
            return global_grad_norm(shards, self.comm, True) / math.sqrt(self.comm.world_size)
        return global_grad_norm(shards, self.comm, self.grads.partitioned, known)

    def compile(self, backend=None, compile_kwargs: dict | None = None) -> None:
        """Compile each stage-3 unit, or each repeated block below stage 3, in place (its forward,
        with torch.compile(backend, **compile_kwargs)); zeroshard's hooks stay eager around it
        (api/compiled.py). A second call does nothing."""
        if self.compiled is not None:
            return
        from zeroshard.api.compiled import compile_regions

        self.compiled = compile_regions(self.module, self.stage3, backend, compile_kwargs)
        if self.rank == 0:
            log.info("%s: %s", self.compiled.describe(), ", ".join(self.compiled.names[:4]) +
                     (", ..." if len(self.compiled.names) > 4 else ""))

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None

    @property
    def stage3(self):
        """Stage 3's runtime (`stages.stage3.Stage3Runtime`: units, their hooks, the gather order),
        or None below stage 3."""
        return getattr(self.params, "runtime", None)

    def empty_partition_cache(self) -> None:
        """Release every stage-3 unit still gathered (a forward whose backward never came keeps its
        units for it: that backward is then impossible) and the reusable gather buffers, as
        DeepSpeed's; call it between steps. Below stage 3: only the buffers."""
        if self.stage3 is not None:
            self.stage3.release_all()
        self.pool.clear()

    def generation(self, max_bytes: int | None = None):
        """A context for generating at stage 3: each unit is gathered once and kept across forwards
        while the kept units fit `max_bytes` (None: no limit), least recently used released first;
        everything is released on exit (stages/generation.py). Below stage 3: `torch.no_grad()`."""
        return generation(self.stage3, max_bytes) if self.stage3 is not None else torch.no_grad()

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Free the device memory of the states in `include` (DeepSpeed's OffloadStateTypeEnum names; all
        by default) until `reload_states()`, keeping their bytes on the host (api/offload_states.py)."""
        self.states.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """The states `offload_states` moved, back where they were, bit for bit."""
        self.states.reload(non_blocking)

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

    # the step counters live in the TrainState (checkpoints read and restore them there)
    global_steps = _Counter()
    micro_steps = _Counter()
    skipped_steps = _Counter()

    # -- state -------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor on CPU} on every rank, trainable values from the fp32 masters,
        gathered one bucket at a time (peak: one bucket in fp32). Tied parameters appear
        under each of their names. A collective: every rank must call it."""
        return full_state_dict(self.train_state, self.grads.partitioned)

    def refresh_params_from_masters(self) -> None:
        """Write every fp32 master shard into its bucket (in the compute dtype) and publish
        it to all ranks, as after an optimizer step. For checkpoint loading and user edits."""
        for b, bucket in enumerate(self.buckets):
            master = self.optimizer.master_value(b)  # read from its file on the nvme tier
            if master.data_ptr() != bucket.shard().data_ptr():
                bucket.write_shard(master)  # in memory, or in its nvme file (offload_param)
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
        unregister_engine(self)
        self.grads.remove_hooks()
        self.params.remove_hooks()
        self.optimizer.close()  # the nvme tier's files go
        for tier in self.param_tiers:
            tier.close()
        self.activation_offload.close()  # its files go
        self.monitors.close()
        self.comm.close()  # its intra-host copy threads (comm/cma.py)
        self.topology.destroy()
        # the engine's parts refer to each other (hooks, the ledger, the optimizer), so the process
        # groups it released stay alive, with their gloo threads and sockets, until the next cyclic
        # collection: collect now (a loop of 20 engines grew to 5 live groups, 45 fds, 27 threads)
        gc.collect()
