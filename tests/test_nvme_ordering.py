"""Issue 24: the NVMe parameter tier's reads ahead and its writes behind, on real files.

The optimizer writes a shard (during backward, or after it) while the read-ahead may already
be reading the same shard for the next forward, and a later read may come while the write is
still running. Whatever the timing, a fetch returns the newest values: an update is never
overtaken by a read of the old ones, and a read never overtakes an update.
"""

from __future__ import annotations

import threading

import torch

from zeroshard.offload.aio import IOEngine
from zeroshard.offload.nvme import NvmeTier
from zeroshard.policies import AioPolicy

CPU = torch.device("cpu")


def _tier(tmp_path, count=2):
    return NvmeTier(str(tmp_path), AioPolicy(), "params", 0, read_ahead=(count, 4096))


def _record_order(tier, homes, passes=2):
    for _ in range(passes):
        for home in homes:
            tier.fetch(home, CPU)


def test_an_update_while_its_read_ahead_is_in_flight_is_what_the_next_fetch_returns(tmp_path, monkeypatch):
    """Shard b's read for the next pass is in flight (slowed down here) when b is stored: the
    store waits for the read, and the fetch is served from the read buffer with the new values."""
    tier = _tier(tmp_path)
    try:
        homes = [tier.place(torch.full((1000,), float(i + 1))) for i in range(3)]
        _record_order(tier, homes)  # a, b, c, a, b, c: the chain is known
        gate = threading.Event()
        real = IOEngine._piece

        def slow(self, fds, t, offset, start, length, write, path):
            if not write:
                gate.wait(5)  # reads land only after the store below was issued
            return real(self, fds, t, offset, start, length, write, path)

        monkeypatch.setattr(IOEngine, "_piece", slow)
        tier.fetch(homes[0], CPU)  # starts reading b and c ahead
        assert id(homes[1]) in tier.ahead.inflight
        threading.Timer(0.2, gate.set).start()
        tier.store(homes[1], torch.full((1000,), 20.0))  # b's update, its old values still on their way
        got_b = tier.fetch(homes[1], CPU)
        got_c = tier.fetch(homes[2], CPU)
        assert torch.equal(got_b, torch.full((1000,), 20.0)), got_b[:3]
        assert torch.equal(got_c, torch.full((1000,), 3.0)), got_c[:3]
        assert tier.ahead.rewritten == 1
        monkeypatch.setattr(IOEngine, "_piece", real)
        tier.ahead.drop_all()
        # and the file holds it once every write has landed (a fresh read, no buffer involved)
        out = torch.empty(1000)
        tier.wait(tier.read(tier.region_of(homes[1]), out))
        assert torch.equal(out, torch.full((1000,), 20.0))
    finally:
        tier.close()


def test_a_read_of_a_shard_whose_write_is_still_running_gets_the_new_values(tmp_path, monkeypatch):
    """Shard a is stored while no read of it is in flight: its write runs behind (slowed down
    here). A fetch and a read-ahead of a before the write lands are served from its buffer."""
    tier = _tier(tmp_path, count=1)
    try:
        homes = [tier.place(torch.full((1000,), float(i + 1))) for i in range(3)]
        _record_order(tier, homes)
        tier.ahead.drop_all()
        gate = threading.Event()
        real = IOEngine._piece

        def slow(self, fds, t, offset, start, length, write, path):
            if write:
                gate.wait(5)
            return real(self, fds, t, offset, start, length, write, path)

        monkeypatch.setattr(IOEngine, "_piece", slow)
        tier.store(homes[0], torch.full((1000,), 10.0))  # returns before the write lands
        assert not gate.is_set()
        tier.fetch(homes[2], CPU)  # c, then the chain says a: its read-ahead copies the new values
        got = tier.fetch(homes[0], CPU)
        gate.set()
        assert torch.equal(got, torch.full((1000,), 10.0)), got[:3]
        assert tier.ahead.served >= 1
    finally:
        gate.set()
        tier.close()


def test_writes_behind_are_on_disk_after_close_of_the_pool(tmp_path):
    """Many stores of the same and of other shards in a row (more than the write buffers):
    each shard's last value is what the file holds, however the writes interleaved."""
    tier = _tier(tmp_path, count=2)
    try:
        homes = [tier.place(torch.zeros(1000)) for _ in range(4)]
        _record_order(tier, homes)
        for rnd in range(1, 6):
            for i, home in enumerate(homes):
                tier.store(home, torch.full((1000,), float(10 * rnd + i)))
                tier.fetch(homes[(i + 1) % 4], CPU)
        tier.ahead.drop_all()
        for i, home in enumerate(homes):
            out = torch.empty(1000)
            tier.wait(tier.read(tier.region_of(home), out))
            assert torch.equal(out, torch.full((1000,), float(50 + i))), (i, out[:3])
            assert torch.equal(tier.fetch(home, CPU), out)
    finally:
        tier.close()


def test_a_read_ahead_never_overtakes_a_write_still_landing_from_a_served_buffer(tmp_path, monkeypatch):
    """b is stored while its read-ahead is in flight (the buffer takes the new values and is
    written from), then fetched from that buffer, which retires while its write still runs
    (slowed down here). The next pass predicts b again: its read must wait for that write, or
    it reads the old values off the disk and the fetch returns them."""
    tier = _tier(tmp_path, count=3)  # a free buffer for b's read: the pool does not wait for the write
    try:
        homes = [tier.place(torch.full((1000,), float(i + 1))) for i in range(3)]
        _record_order(tier, homes)  # a, b, c, a, b, c
        gate = threading.Event()
        real = IOEngine._piece

        def slow(self, fds, t, offset, start, length, write, path):
            if write:
                gate.wait(5)  # b's write lands only after the next pass's read of b was issued
            return real(self, fds, t, offset, start, length, write, path)

        monkeypatch.setattr(IOEngine, "_piece", slow)
        tier.fetch(homes[0], CPU)  # reads b and c ahead
        tier.store(homes[1], torch.full((1000,), 20.0))  # into b's read buffer, written from it
        assert torch.equal(tier.fetch(homes[1], CPU), torch.full((1000,), 20.0))  # served; the buffer retires
        tier.fetch(homes[2], CPU)  # predicts a and b: b's write is still running
        threading.Timer(0.5, gate.set).start()
        tier.fetch(homes[0], CPU)
        got_b = tier.fetch(homes[1], CPU)
        assert torch.equal(got_b, torch.full((1000,), 20.0)), got_b[:3]
        monkeypatch.setattr(IOEngine, "_piece", real)
    finally:
        gate.set()
        tier.ahead.drop_all()
        tier.close()
