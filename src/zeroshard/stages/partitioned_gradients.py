"""Stages 2 and 3's gradients: only this rank's shard of each bucket persists (an accumulator);
every micro-step reduce-scatters into it (stages/gradients.py has the lifecycle they share)."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.partition.buffer_pool import empty_from
from zeroshard.stages.gradients import BucketedGradients, _Scatter

# stages 2 and 3: buckets whose reduction may still run when the next one launches; with 1, at
# most two full gradient buffers exist (one reducing, one filling), as in FSDP, whose unit's
# reduce-scatter runs while the next unit computes (measured: bench/RESULTS.md, 2026-12-01 16:13)
MAX_IN_FLIGHT = 1


class PartitionedGradients(_Scatter, BucketedGradients):
    """Stage 2: only the shard accumulator persists; a bucket's full gradient exists from its first
    gradient until its reduce-scatter lands (`contiguous_gradients` copies each gradient into it on
    arrival; else they wait in `param.grad`); every micro-step reduces: nothing full is kept. With
    gloo on CPU no full buffer is filled at all: each gradient waits where autograd left it and
    is sent from there (`_reduces_in_place`), a copy of every gradient saved."""

    reduces_every_micro_step = True

    def __init__(self, *args, contiguous: bool = True, use_all_reduce: bool = False,
                 max_in_flight: int = MAX_IN_FLIGHT, reducer=None, pool=None, accum_dtype=None, **kwargs) -> None:
        self.contiguous, self.use_all_reduce, self.max_in_flight = contiguous, use_all_reduce, max_in_flight
        self.reducer, self.pool = reducer, pool  # pool: a BufferPool for the full buffers, or None
        super().__init__(*args, **kwargs)
        self.shards = [torch.zeros(b.layout.shard_numel, dtype=accum_dtype or b.dtype, device=b.device)
                       for b in self.buckets]  # accum_dtype: data_types.grad_accum_dtype
        for shard, bucket in zip(self.shards, self.buckets):
            self.memory.hold("grads", f"{bucket.key}.shard", shard.nbytes)
        self._full: dict[int, torch.Tensor] = {}
        self._written: dict[int, set[int]] = {}  # slots of each in-flight buffer already holding a gradient
        self._landed: set[int] = set()  # in-flight buckets whose reduction writes the accumulator itself
        self._stale: set[int] = set()  # emptied by zero_grads() (lazily: see there), not yet rewritten
        # gloo on CPU: each gradient is reduced from where autograd left it (Comm.reduce_scatter_pieces),
        # with no full buffer filled; the gradients wait here, by bucket and slot, until then
        self._kept: dict[int, dict[int, torch.Tensor]] = {}
        self._piecewise = [self._reduces_in_place(b) for b in range(len(self.buckets))]

    def _reduces_in_place(self, b: int) -> bool:
        """Whether bucket b is reduced piecewise: the comm serves it, and nothing needs the full
        buffer (a cast to another reduce dtype, an all-reduce, qgZ, pre- or post-scaling)."""
        bucket = self.buckets[b]
        return (self.comm.reduces_pieces(bucket.dtype, bucket.device) and self.reduce_dtype == bucket.dtype
                and not self.use_all_reduce and self.reducer is None and self.shards[b].dtype == bucket.dtype
                and self.scaling.factors(self.comm.world_size, True) == (1.0, 1.0, True))

    def _max_in_flight(self) -> int:
        return self.max_in_flight

    def begin_backward(self, boundary: bool, first_micro: bool, *early) -> None:
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        super().begin_backward(boundary, first_micro, *early)

    def _buffer(self, b: int) -> torch.Tensor:
        """The bucket's full gradient buffer, uninitialised: each slot is copied on its first
        gradient, and what no gradient reached is zeroed at launch (no full zero-fill)."""
        if b not in self._full:
            bucket = self.buckets[b]
            self._full[b] = empty_from(self.pool, bucket.layout.padded_numel, bucket.dtype, bucket.device)
            self._written[b] = set()
            self.memory.hold("grads", f"{bucket.key}.full", self._full[b].nbytes)
        return self._full[b]

    def _put(self, b: int, s: int, grad: torch.Tensor) -> None:
        slot, grad = self.buckets[b].slots[s], grad.to_dense() if grad.is_sparse else grad
        view = self._buffer(b)[slot.offset : slot.end].view(slot.shape)
        if s in self._written[b]:
            view.add_(grad)  # a second gradient for the slot in the same backward
        else:
            view.copy_(grad)
            self._written[b].add(s)

    def _arrive(self, b: int, s: int, param: nn.Parameter) -> None:
        if self._piecewise[b]:
            kept, grad = self._kept.setdefault(b, {}), param.grad
            if s in kept:
                kept[s].add_(grad)  # a second gradient for the slot in the same backward
            else:
                kept[s] = grad.to_dense() if grad.is_sparse else grad.contiguous()  # (a no-op when it is)
                self.memory.hold("grads", f"{self.buckets[b].key}.{s}", kept[s].nbytes)
            param.grad = None
            return
        if not self.contiguous:
            key = f"{self.buckets[b].key}.{s}"
            self.memory.hold("grads", key, param.grad.nbytes)
            return
        self._put(b, s, param.grad)
        param.grad = None

    def _launch(self, b: int) -> None:
        if not self._piecewise[b]:
            return super()._launch(b)
        self._state.launched[b] = True
        bucket, kept = self.buckets[b], self._kept.pop(b, {})
        pieces = [(slot.offset, kept[s].view(-1) if s in kept else  # unused this step: zero, as the buffer's
                   torch.zeros(slot.numel, dtype=bucket.dtype, device=bucket.device))
                  for s, slot in enumerate(bucket.slots)]
        accumulate = not (self._state.first or b in self._stale)  # else overwrite: lazily emptied
        handle = self.comm.reduce_scatter_pieces(self.shards[b], pieces, what=f"gradients of {bucket.label}",
                                                 average=True, accumulate=accumulate)

        def finish() -> None:
            for s in kept:
                self.memory.release("grads", f"{bucket.key}.{s}")
            pieces.clear()
            kept.clear()
            self._stale.discard(b)

        self._enqueue(b, handle, finish)

    def _full_grad(self, b: int) -> torch.Tensor:
        bucket = self.buckets[b]
        full = self._buffer(b)
        for s, (slot, p) in enumerate(zip(bucket.slots, bucket.params)):
            if not self.contiguous and p.grad is not None:
                self._put(b, s, p.grad)
                p.grad = None
                self.memory.release("grads", f"{bucket.key}.{s}")
            if s not in self._written[b]:  # no gradient this micro-step (unused): zero
                full[slot.offset : slot.end].zero_()
        full[bucket.layout.numel :].zero_()  # padding
        return full

    def _landing(self, b: int, wire: torch.Tensor) -> torch.Tensor:
        """A window's first micro-step writes the reduced shard straight into the accumulator (no copy
        after) when the buffer sent is the gradient itself (no cast) and it is a reduce-scatter."""
        if self._state.first and wire.dtype == self.shards[b].dtype and not self.use_all_reduce:
            self._landed.add(b)
            return self.shards[b]
        return super()._landing(b, wire)

    def _after_reduce(self, b: int, full: torch.Tensor) -> None:
        lo, hi = self.buckets[b].shard_range
        if b in self._landed:
            self._landed.discard(b)
        elif self._state.first or b in self._stale:
            self.shards[b].copy_(full[lo:hi])
        else:
            self.shards[b].add_(full[lo:hi])
        self._stale.discard(b)
        done = self._full.pop(b)
        if self.pool is not None:
            self.pool.give(done)
        self.memory.release("grads", f"{self.buckets[b].key}.full")

    def grad_shard(self, b: int) -> torch.Tensor:
        if b in self._stale:  # read with no reduction since zero_grads (a step without backward)
            self._stale.discard(b)
            self.shards[b].zero_()
        return self.shards[b]

    def zero_grads(self) -> None:
        """Lazily (a window's first micro-step overwrites every accumulator): _after_reduce, grad_shard."""
        self._stale.update(range(len(self.shards)))
