"""Parameter strategies: how parameters are held and published after a step.

Stages 1 and 2 all-gather each bucket's shards after the step (`ParamPublisher`).

The optimizer writes this rank's shard into the bucket's parameter buffer; the
all-gather then fills every other shard in place. `allgather_bucket_size` caps the
elements of one all-gather: a larger bucket is gathered in pieces, the same slice of
every rank's shard at a time, each straight into its place in the bucket and all in
flight at once (no staging buffer, nothing waited on before `wait()`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager, Iterator, Protocol

from torch import nn

from zeroshard.comm import Comm, Handle
from zeroshard.partition import FlatBucket
from zeroshard.partition.layout import gather_ranges

if TYPE_CHECKING:
    from zeroshard.stages.stage3 import Stage3Runtime


class ParamPublisher:
    def __init__(self, buckets: list[FlatBucket], comm: Comm, allgather_bucket_size: int) -> None:
        self.buckets, self.comm = buckets, comm
        self.cap = allgather_bucket_size
        self._pending: list[Handle] = []

    def publish(self, b: int) -> None:
        """Start gathering bucket b, in pieces of at most `allgather_bucket_size` elements."""
        bucket = self.buckets[b]
        if bucket.data.numel() <= self.cap:
            self._pending.append(self.comm.all_gather(bucket.data, bucket.shard(), what=f"parameter bucket {b}"))
            return
        n, size = self.comm.world_size, bucket.layout.shard_numel
        for lo, hi in gather_ranges(size, bucket.data.numel(), self.cap, n):
            views = [bucket.data[r * size + lo : r * size + hi] for r in range(n)]
            self._pending.append(self.comm.all_gather_into(views, views[self.comm.rank],
                                                           what=f"parameter bucket {b} chunk {lo}"))

    def wait(self) -> None:
        while self._pending:
            self._pending.pop(0).wait()


class ParamStrategy(Protocol):
    """How parameters are held between steps: what the engine calls around forward and
    backward, after each bucket's optimizer step (`publish`, then `wait`), and what
    `GatheredParameters` uses to have full values for a moment (`gathered`)."""

    def begin_forward(self) -> None: ...
    def end_forward(self) -> None: ...
    def begin_backward(self) -> None: ...
    def end_backward(self) -> None: ...
    def publish(self, b: int) -> None: ...
    def wait(self) -> None: ...
    def gathered(self, params: list[nn.Parameter]) -> ContextManager[None]: ...
    def remove_hooks(self) -> None: ...


class ReplicatedParams:
    """Stages 0-2: parameters are whole on every rank; after a step, stages 1/2 all-gather
    the updated shards (stage 0 updates whole buckets and publishes nothing)."""

    def __init__(self, publisher: ParamPublisher | None) -> None:
        self.publisher = publisher

    def begin_forward(self) -> None: ...
    def end_forward(self) -> None: ...
    def begin_backward(self) -> None: ...
    def end_backward(self) -> None: ...

    def publish(self, b: int) -> None:
        if self.publisher is not None:
            self.publisher.publish(b)

    def wait(self) -> None:
        if self.publisher is not None:
            self.publisher.wait()

    def gathered(self, params: list[nn.Parameter]) -> ContextManager[None]:
        """Whole already: nothing to gather."""
        return contextlib.nullcontext()

    def remove_hooks(self) -> None: ...


class PartitionedParams:
    """Stage 3: gather units on demand (the runtime's hooks); after a step only the buckets
    of persistent (small, whole) parameters are all-gathered; unit shards are already final."""

    def __init__(self, runtime: Stage3Runtime, publisher: ParamPublisher, persistent: set[int]) -> None:
        self.runtime, self.publisher, self.persistent = runtime, publisher, persistent
        # the phases and the hooks are the runtime's own
        self.begin_forward, self.end_forward = runtime.begin_forward, runtime.end_forward
        self.begin_backward, self.end_backward = runtime.begin_backward, runtime.end_backward
        self.remove_hooks = runtime.remove_hooks

    def publish(self, b: int) -> None:
        if b in self.persistent:
            self.publisher.publish(b)

    def wait(self) -> None:
        self.publisher.wait()

    @contextlib.contextmanager
    def gathered(self, params: list[nn.Parameter]) -> Iterator[None]:
        """The units holding `params` gathered and kept until the block ends (a collective); a
        released unit is gathered exactly (never quantized: its values may be written back)."""
        units = self.runtime.units_of(params)
        for unit in units:
            self.runtime.pin(unit, exact=True)
        try:
            yield
        finally:
            for unit in units:
                self.runtime.unpin(unit)
