"""Gradient storage and reduction for every stage: strategies over FlatBuckets.

One class, `BucketedGradients`, runs a bucket's gradient through a micro-step: arrive (post-
accumulate-grad hook) -> bucket complete -> reduction launched (overlapping backward) -> finished
at the end of backward. Subclasses choose where the gradient lives and which collective reduces it:

  stage 0  `AllReducedGradients`    full buffer kept; all-reduce at the boundary
  stage 1  `ScatteredGradients`     full buffer kept; reduce-scatter at the boundary
  stage 2  `PartitionedGradients`   (stages/partitioned_gradients.py) only a shard accumulator
  and 3                            persists; every micro-step reduces into it (stage 3: a unit's
                                   buckets, reduced as its backward ends; qgZ's reducer)

Gradients are pre-divided by the world size before the sum (or the collective averages): a
reduced gradient is the mean over ranks (fp16 sums do not overflow), unless the config's
GradientReducePolicy asks for DeepSpeed's other forms (sum, prescale, predivide).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from zeroshard.comm import Comm, Handle
from zeroshard.partition import FlatBucket, MemoryLedger, slot_views
from zeroshard.policies import GradientReducePolicy, ZeroShardError
from zeroshard.stages.hooks import Hooks

@dataclass
class _Pending:
    bucket: int
    handle: Handle
    finish: Callable[[], None]


@dataclass
class _MicroState:
    reduce: bool = False  # does this micro-step reduce gradients?
    boundary: bool = False  # the last micro-step of an accumulation window
    first: bool = True  # first micro-step of an accumulation window
    ready: list[set[int]] = field(default_factory=list)
    launched: list[bool] = field(default_factory=list)
    # stepping during backward: `on_final(b)` once bucket b's gradient shard is final (at the
    # accumulation boundary, its reduction landed), and `on_overlap()` right after the next
    # reduction is issued (and once when backward ends): what the engine does then (a
    # sub-group's step) overlaps that reduction instead of waiting in front of it
    on_final: Callable[[int], None] | None = None
    on_overlap: Callable[[], None] | None = None


class BucketedGradients:
    """Base strategy. `shard_count` is how many ways the optimizer state is split."""

    partitioned = True  # grad shards differ per rank: the norm needs an all-reduce
    local = False  # this step's gradients were not reduced: each rank holds its own (AllReducedGradients)
    publishes_params = True  # params must be all-gathered after the optimizer step
    reduces_every_micro_step = False  # else only at the accumulation boundary

    def __init__(self, buckets: list[FlatBucket], comm: Comm, memory: MemoryLedger,
                 reduce_dtype: torch.dtype, overlap: bool, ignore_unused: bool,
                 scaling: GradientReducePolicy = GradientReducePolicy()) -> None:
        self.buckets, self.comm, self.memory, self.scaling = buckets, comm, memory, scaling
        self.reduce_dtype, self.overlap, self.ignore_unused = reduce_dtype, overlap, ignore_unused
        self._state = _MicroState()
        self._pending: list[_Pending] = []
        self._hooks = Hooks()
        for b, bucket in enumerate(buckets):
            for s, p in enumerate(bucket.params):
                self._hooks.after_grad_accumulated(p, self._hook(b, s))

    # -- engine-facing lifecycle --------------------------------------------------
    def begin_backward(self, boundary: bool, first_micro: bool, on_final: Callable[[int], None] | None = None,
                       on_overlap: Callable[[], None] | None = None) -> None:
        """`on_final` / `on_overlap`: the engine's step during backward, at the boundary (see _MicroState)."""
        self._state = _MicroState(
            reduce=boundary or self.reduces_every_micro_step, boundary=boundary, first=first_micro,
            ready=[set() for _ in self.buckets], launched=[False] * len(self.buckets),
            on_final=on_final if boundary else None, on_overlap=on_overlap if boundary else None,
        )

    def end_backward(self) -> None:
        """Launch what backward did not complete (unused parameters count as zero), then wait."""
        st = self._state
        if st.reduce:
            missing = [self.buckets[b].slots[s].name for b in range(len(self.buckets))
                       for s in range(len(self.buckets[b].slots)) if s not in st.ready[b]]
            if missing and not self.ignore_unused:
                raise ZeroShardError(
                    f"{len(missing)} trainable parameters got no gradient this step (first: "
                    f"{missing[:3]}); set zero_optimization.ignore_unused_parameters=true to "
                    "treat them as zero, or freeze them (requires_grad=False)."
                )
            for b in range(len(self.buckets)):
                if not st.launched[b]:
                    self._launch(b)
        while self._pending:
            self._retire(self._pending.pop(0))
        if st.on_overlap is not None:
            st.on_overlap()
        self._state = _MicroState()  # a later backward outside the engine schedules nothing

    def remove_hooks(self) -> None:
        self._hooks.remove()

    # -- hooks ----------------------------------------------------------------------
    def _hook(self, b: int, s: int):
        def on_grad(param: nn.Parameter) -> None:
            st = self._state
            if not st.ready:  # backward outside engine.backward(): nothing to schedule
                return
            if s in st.ready[b] and st.launched[b]:
                raise ZeroShardError(
                    f"parameter '{self.buckets[b].slots[s].name}' received a second gradient in one "
                    "backward pass after its bucket was already reduced (a parameter used inside and "
                    "outside a reentrant checkpoint?); set zero_optimization.overlap_comm=false."
                )
            self._arrive(b, s, param)
            st.ready[b].add(s)
            if st.reduce and self.overlap and len(st.ready[b]) == len(self.buckets[b].slots):
                self._launch(b)
        return on_grad

    def _launch(self, b: int) -> None:
        self._state.launched[b] = True
        full = self._full_grad(b)
        before, after, average = self.scaling.factors(self.comm.world_size, self._can_average())
        if before != 1.0:
            full.mul_(before)
        wire = full if full.dtype == self.reduce_dtype else full.to(self.reduce_dtype)
        if wire is not full:
            self.memory.hold("comm_buffers", f"wire{b}", wire.nbytes)
        handle, land, out = self._collective(b, wire, average)

        def finish() -> None:
            if after != 1.0:
                out.mul_(after)  # in the wire's dtype, as DeepSpeed's post-scaling
            if wire is not full:
                land(wire, full)
                self.memory.release("comm_buffers", f"wire{b}")
            self._after_reduce(b, full)

        self._enqueue(b, handle, finish)

    def _enqueue(self, b: int, handle: Handle, finish: Callable[[], None]) -> None:
        """Bucket b's reduction is issued: `finish` runs once `handle` is waited on."""
        self._pending.append(_Pending(b, handle, finish))
        if self._state.on_overlap is not None:
            self._state.on_overlap()
        while len(self._pending) > self._max_in_flight():
            self._retire(self._pending.pop(0))

    def _retire(self, pending: _Pending) -> None:
        pending.handle.wait()
        pending.finish()
        if self._state.on_final is not None:
            self._state.on_final(pending.bucket)

    # -- what subclasses decide -------------------------------------------------------
    def _max_in_flight(self) -> int:
        return len(self.buckets)

    def _arrive(self, b: int, s: int, param: nn.Parameter) -> None:
        """A gradient for slot s of bucket b has been accumulated into param.grad."""

    def _full_grad(self, b: int) -> torch.Tensor:
        raise NotImplementedError

    def _can_average(self) -> bool:
        """Whether the collective can return the mean itself (else the gradient is divided by
        the world size before it is summed)."""
        return False

    def _collective(self, b: int, wire: torch.Tensor, average: bool):
        """Issue the reduction (the mean when `average`, else the sum); return (handle,
        copy-back function for a cast wire buffer, the tensor the reduced values land in)."""
        raise NotImplementedError

    def _after_reduce(self, b: int, full: torch.Tensor) -> None:
        """The reduction of bucket b has landed in `full`."""

    def grad_shard(self, b: int) -> torch.Tensor:
        """The reduced mean gradient of this rank's shard of bucket b."""
        raise NotImplementedError

    def zero_grads(self) -> None:
        raise NotImplementedError


class _PersistentGradients(BucketedGradients):
    """Stages 0 and 1: a full gradient buffer per bucket; `param.grad` is a view into it,
    so autograd accumulates micro-steps in place and nothing is copied."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grads = [bucket.zeros_like_data() for bucket in self.buckets]
        for g, bucket in zip(self.grads, self.buckets):
            self.memory.hold("grads", bucket.key, g.nbytes)
        self._views = [slot_views(g, bucket.layout) for g, bucket in zip(self.grads, self.buckets)]
        self._attach()

    def _attach(self) -> None:
        for bucket, views in zip(self.buckets, self._views):
            for p, v in zip(bucket.params, views):
                if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                    if p.grad is not None:  # someone replaced the view: keep what it holds
                        v.add_(p.grad)
                    p.grad = v

    def begin_backward(self, boundary: bool, first_micro: bool, *early) -> None:
        self._attach()
        super().begin_backward(boundary, first_micro, *early)

    def _arrive(self, b: int, s: int, param: nn.Parameter) -> None:
        view = self._views[b][s]
        if param.grad is not view and param.grad.data_ptr() != view.data_ptr():
            view.add_(param.grad)  # autograd stole the slot (e.g. after zero_grad(set_to_none))
            param.grad = view

    def _full_grad(self, b: int) -> torch.Tensor:
        return self.grads[b]

    def zero_grads(self) -> None:
        for g in self.grads:
            g.zero_()
        self._attach()


class AllReducedGradients(_PersistentGradients):
    """Stage 0: plain data parallelism, bucketed all-reduce. An optimizer that reduces by itself in
    some steps (optim/onebit.py) is asked before each backward (`hand_reduction_to`); when it says no,
    nothing is reduced, `local` is true and `grad_shard(b)` is this rank's own gradient."""

    partitioned, publishes_params, owner = False, False, None

    def hand_reduction_to(self, owner) -> None:
        self.owner = owner

    def begin_backward(self, boundary: bool, first_micro: bool, *early) -> None:
        self.local = self.owner is not None and not self.owner.reduces_gradients()
        super().begin_backward(boundary and not self.local, first_micro, *early)  # local: as between boundaries

    def _collective(self, b, wire, average):
        handle = self.comm.all_reduce(wire, what=f"gradients of {self.buckets[b].label}")
        return handle, lambda w, full: full.copy_(w), wire

    def grad_shard(self, b: int) -> torch.Tensor:
        return self.grads[b]


class _Scatter:
    """Reduce-scatter into the owner's slice of the full buffer, in place.

    With `use_all_reduce` (zero_optimization.reduce_scatter=false) it all-reduces the
    whole bucket instead, as DeepSpeed does, and keeps the owned slice: 2x the volume."""

    use_all_reduce = False
    reducer = None  # a collective with Comm's reduce_scatter (ZeRO++ qgZ); None: the comm's own
    buckets: list[FlatBucket]
    comm: Comm

    def _can_average(self) -> bool:
        return not self.use_all_reduce and self.reducer is None  # Comm.reduce_scatter(average=True)

    def _landing(self, b: int, wire: torch.Tensor) -> torch.Tensor:
        """Where the reduced shard of bucket b is written: its slice of the buffer sent."""
        lo, hi = self.buckets[b].shard_range
        return wire[lo:hi]

    def _collective(self, b, wire, average):
        lo, hi = self.buckets[b].shard_range
        what = f"gradients of {self.buckets[b].label}"
        out = wire[lo:hi]
        if self.use_all_reduce:
            handle = self.comm.all_reduce(wire, what=what)
        elif self.reducer is not None:
            handle = self.reducer.reduce_scatter(out, wire, what=what)
        else:
            out = self._landing(b, wire)
            handle = self.comm.reduce_scatter(out, wire, what=what, average=average)
        return handle, lambda w, full: full[lo:hi].copy_(w[lo:hi]), out


class ScatteredGradients(_Scatter, _PersistentGradients):
    """Stage 1: full gradients kept across micro-steps, reduce-scattered at the boundary."""

    def __init__(self, *args, use_all_reduce: bool = False, **kwargs) -> None:
        self.use_all_reduce = use_all_reduce
        super().__init__(*args, **kwargs)

    def grad_shard(self, b: int) -> torch.Tensor:
        lo, hi = self.buckets[b].shard_range
        return self.grads[b][lo:hi]
