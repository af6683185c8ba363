"""Publishing updated parameters (stages 1 and 2): all-gather each bucket's shards.

The optimizer writes this rank's shard into the bucket's parameter buffer; the
all-gather then fills every other shard in place. `allgather_bucket_size` caps the
elements of one all-gather: a larger bucket is gathered in chunks through a staging
buffer (counted as `comm_buffers`), one chunk in flight at a time.
"""

from __future__ import annotations

from zeroshard.comm import Comm, Handle
from zeroshard.partition import FlatBucket, MemoryLedger, chunk_ranges


class ParamPublisher:
    def __init__(self, buckets: list[FlatBucket], comm: Comm, memory: MemoryLedger,
                 allgather_bucket_size: int) -> None:
        self.buckets, self.comm, self.memory = buckets, comm, memory
        self.cap = allgather_bucket_size
        self._pending: list[Handle] = []

    def publish(self, b: int) -> None:
        """Start gathering bucket b (whole buckets asynchronously; chunked ones in order)."""
        bucket = self.buckets[b]
        if bucket.data.numel() <= self.cap:
            self._pending.append(self.comm.all_gather(bucket.data, bucket.shard(), what=f"parameter bucket {b}"))
            return
        n, size = self.comm.world_size, bucket.layout.shard_numel
        shard = bucket.shard()
        key = f"gather{b}"
        for lo, hi in chunk_ranges(size, max(1, self.cap // n)):
            width = hi - lo
            staging = bucket.data.new_empty(n * width)
            self.memory.hold("comm_buffers", key, staging.numel() * staging.element_size())
            self.comm.all_gather(staging, shard[lo:hi], what=f"parameter bucket {b} chunk {lo}").wait()
            for r in range(n):
                bucket.data[r * size + lo : r * size + hi].copy_(staging[r * width : (r + 1) * width])
            self.memory.release("comm_buffers", key)

    def wait(self) -> None:
        while self._pending:
            self._pending.pop(0).wait()
