"""The optimizer's swap pipeline over the NVMe tier (ZeRO-Infinity).

A bucket shard whose tier is `nvme` has its fp32 master and its per-element optimizer states
(Adam's exp_avg / exp_avg_sq, SGD's momentum) in the tier's file. In memory each is a
placeholder (its shape, no storage), so the torch optimizer, the ledger and checkpoints see
the right shapes while the bytes are on disk. The sharded optimizer steps sub-group by
sub-group; around each sub-group this pipeline

    swap_in(k)   waits for sub-group k's read, binds masters and states to its host buffer
                 (`.data` of the very tensors the torch optimizer holds), then starts reading
                 the sub-group that came after k last step into the buffer used longest ago;
    swap_out(k)  starts writing k's buffer back and puts the placeholders back; the buffer
                 keeps k's values until it is taken for another sub-group (a swap_in of k
                 before then reads nothing);
    end_step()   the order of this step's swap_ins becomes the order read ahead along, and the
                 first sub-group of the next step starts coming in; writes are not waited for
                 (they land while the next forward runs);

so reading the next, stepping k and writing the previous overlap, in whatever order the
sub-groups step: 0, 1, 2 after backward, or the units' reverse order when they step during
backward as their gradients become final (`can_step_early`). A file region is never read
while a write of it is in flight: a sub-group's regions are written only from the buffer
that holds its values, and that buffer's writes are waited for before it takes another.

The host buffers are `buffer_count` aligned buffers of the largest sub-group's (1 + K) x
elements x 4 bytes (K: the optimizer's per-element states, found by stepping a probe once);
3 give the full overlap, 2 read ahead only, 1 is serial; more keep more sub-groups' values
between steps (not read again while still held; their files are written every step).
Host-resident optimizer bytes never exceed the buffers. A sub-group's first step with torch's
Adam / AdamW starts from zeroed states in its buffer (`optim.first_state`); with other optimizers
torch creates the states, which adds that sub-group's states for the time of its step.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch

from zeroshard.offload.aio import Handle, after, align_up, aligned_empty
from zeroshard.offload.nvme import NvmeTier, Region, check_space
from zeroshard.optim.first_state import first_state_in
from zeroshard.partition.flat_bucket import placeholder
from zeroshard.partition import MemoryLedger

FULL_PIPELINE = 3  # read k+1, step k, write k-1


def state_count(build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], options: dict[str, Any]) -> int:
    """How many per-element state tensors the optimizer keeps per parameter: step it once on a
    probe with a zero gradient and count."""
    probe = torch.zeros(8, requires_grad=True)
    opt = build([{**options, "params": [probe]}])
    probe.grad = torch.zeros_like(probe)
    opt.step()
    return sum(1 for v in opt.state.get(probe, {}).values() if torch.is_tensor(v) and v.dim() > 0)


def buffer_plan(buffer_count: int) -> tuple[int, str]:
    """Slots used for `offload_optimizer.buffer_count`, and the start-up line saying why."""
    if buffer_count <= 0:
        return 1, (f"buffer_count={buffer_count} cannot hold a sub-group: using 1 buffer (serial read, step, "
                   f"write); set buffer_count: {FULL_PIPELINE} to overlap reads and writes with the step")
    if buffer_count == 1:
        return 1, (f"buffer_count=1: serial read, step, write per sub-group; set buffer_count: {FULL_PIPELINE} "
                   "for read k+1 / step k / write k-1")
    if buffer_count == 2:
        return 2, (f"buffer_count=2: sub-group k+1 is read during step k, but k-1's write finishes first; "
                   f"set buffer_count: {FULL_PIPELINE} to overlap the writes too")
    extra = "" if buffer_count == FULL_PIPELINE else (
        f"; the other {buffer_count - FULL_PIPELINE} keep the values of sub-groups stepped earlier, so a sub-group "
        "still in a buffer at its next step is not read again (its file is still written every step)")
    return buffer_count, f"{buffer_count} buffers: read next / step k / write previous overlap{extra}"


class _Slot:
    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.sub_group = -1  # whose data the buffer holds or is receiving
        self.in_use = False  # bound to the optimizer's tensors (between swap_in and swap_out)
        self.reads: list[Handle] = []
        self.writes: list[Handle] = []
        self.tick = -1  # when it was last taken or used: the one used longest ago is taken next


class SwapPipeline:
    def __init__(self, tier: NvmeTier, masters: list[torch.Tensor], swapped: list[bool],
                 sub_groups: list[list[int]], optimizer: torch.optim.Optimizer, states_per_param: int,
                 buffer_count: int, memory: MemoryLedger) -> None:
        self.tier, self.masters, self.swapped, self.optimizer = tier, masters, swapped, optimizer
        self.sub_groups = sub_groups
        self.k = states_per_param
        self.slots_used, self.buffer_line = buffer_plan(buffer_count)
        self._piece = [align_up(m.numel() * 4) for m in masters]  # bytes of one tensor of bucket b, aligned
        self.slot_bytes = max([sum(self._piece[b] * (1 + self.k) for b in g if swapped[b]) for g in sub_groups]
                              or [0])
        self._slots = [_Slot() for _ in range(self.slots_used)]
        self._states: dict[tuple[int, str], Region] = {}
        self._memory = memory
        self.io_wait_s = 0.0
        self._order: list[int] = []  # the sub-groups in the order they stepped last step
        self._next: dict[int, int] = {}  # sub-group -> the one after it in that order (the last: the first)
        self._seq: list[int] = []  # this step's order so far
        self._clock = 0
        self.reused = 0  # swap_ins whose values were still in a buffer (no read)
        # staging, not model state: with the other I/O buffers (NVMe read-ahead, activation staging),
        # so the model states and the summary's plain-DP baseline count the states themselves
        memory.hold("comm_buffers", "nvme_swap_buffers", 0, tier="host")

    # -- buffers -----------------------------------------------------------------------------
    def _on_disk(self, k: int) -> bool:  # sub-group k has a bucket on the nvme tier
        return any(self.swapped[b] for b in self.sub_groups[k])

    def _slot_of(self, k: int) -> _Slot | None:
        """The buffer holding (or receiving) sub-group k's values, if any."""
        return next((s for s in self._slots if s.sub_group == k), None)

    def _claim(self, writes_may_run: bool = False) -> _Slot | None:
        """The buffer used longest ago among those not bound to the optimizer, its I/O finished
        (with `writes_may_run`, its writes may still run: the caller's reads wait for them)."""
        free = [s for s in self._slots if not s.in_use]
        if not free:
            return None
        slot = min(free, key=lambda s: s.tick)
        if not writes_may_run:
            self._wait(slot.writes)
        self._wait(slot.reads)
        slot.sub_group = -1
        if slot.buffer is None and self.slot_bytes:
            slot.buffer = aligned_empty(self.slot_bytes, torch.float32)
            self._memory.hold("comm_buffers", "nvme_swap_buffers",
                              sum(s.buffer.numel() * 4 for s in self._slots if s.buffer is not None), tier="host")
        return slot

    def _touch(self, slot: _Slot) -> None:
        slot.tick, self._clock = self._clock, self._clock + 1

    def _after(self, k: int) -> int | None:
        """The sub-group expected to step after k: last step's order, or on the first step the
        direction this step has gone so far."""
        if k in self._next:
            return self._next[k]
        down = len(self._seq) >= 2 and self._seq[-1] < self._seq[-2]
        nxt = k - 1 if down else k + 1
        return nxt if 0 <= nxt < len(self.sub_groups) else None

    def _views(self, slot: _Slot, k: int, whole: bool = False) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """(b, [master view, state views...]) of sub-group k's swapped buckets in `slot`; with
        `whole`, each view covers its aligned piece (what the I/O moves: O_DIRECT needs it)."""
        offset = 0
        for b in self.sub_groups[k]:
            if not self.swapped[b]:
                continue
            n = self._piece[b] // 4 if whole else self.masters[b].numel()
            views = []
            for _ in range(1 + self.k):
                views.append(slot.buffer[offset // 4: offset // 4 + n])
                offset += self._piece[b]
            yield b, views

    def state_names(self, b: int) -> list[str]:
        m = self.masters[b]
        return sorted(name for name, v in self.optimizer.state.get(m, {}).items()
                      if torch.is_tensor(v) and v.dim() > 0 and v.numel() == m.numel() and v.dtype == torch.float32)

    def _state_region(self, b: int, name: str) -> Region:
        key = (b, name)
        if key not in self._states:
            self._states[key] = self.tier.allocate(self.masters[b].numel() * 4)
        return self._states[key]

    def _wait(self, handles: list[Handle]) -> None:
        for h in handles:
            self.tier.wait(h)
            self.io_wait_s += h.wait_s
        handles.clear()

    # -- the pipeline --------------------------------------------------------------------------
    def prefetch(self, k: int | None, behind_writes: bool = False) -> None:
        """Start reading sub-group k into a buffer after that buffer's last writes are done:
        waited for here, or with `behind_writes` by the read itself (the caller goes on)."""
        if k is None or k >= len(self.sub_groups) or not self._on_disk(k):
            return
        if (held := self._slot_of(k)) is not None:  # coming, or its values still in a buffer: kept from claims
            return self._touch(held)
        slot = self._claim(writes_may_run=behind_writes)
        if slot is None:  # every buffer is bound (1 slot, stepping): read it at its swap_in
            return
        slot.sub_group = k
        self._touch(slot)
        requests = []
        for b, views in self._views(slot, k, whole=True):
            requests.append((self.tier.region_of(self.masters[b]), views[0]))
            requests += [(self._state_region(b, name), view) for name, view in zip(self.state_names(b), views[1:])]
        if behind_writes and slot.writes:
            slot.reads.append(after(slot.writes, lambda: [self.tier.read(r, v) for r, v in requests],
                                    sum(v.nbytes for _, v in requests), f"read of sub-group {k}"))
        else:
            slot.reads += [self.tier.read(r, v) for r, v in requests]

    def swap_in(self, k: int) -> None:
        """Sub-group k's masters and states are in host memory, in the tensors the optimizer holds."""
        self._seq.append(k)
        if not self._on_disk(k):
            self.prefetch(self._after(k))
            return
        slot = self._slot_of(k)
        if slot is not None and not slot.reads:
            self.reused += 1
        self.prefetch(k)
        slot = self._slot_of(k)
        self._wait(slot.reads)
        slot.in_use = True
        self._touch(slot)
        for b, views in self._views(slot, k):
            self.masters[b].data = views[0]
            if first_state_in(self.optimizer, self.masters[b], views[1:]):
                continue
            state = self.optimizer.state.get(self.masters[b], {})
            for name, view in zip(self.state_names(b), views[1:]):
                state[name].data = view
        self.prefetch(self._after(k))

    def swap_out(self, k: int) -> None:
        """Start writing sub-group k back; masters and states become placeholders again."""
        if not self._on_disk(k):
            return
        slot = self._slot_of(k)
        for b, views in self._views(slot, k):
            m = self.masters[b]
            state = self.optimizer.state.get(m, {})
            names = self.state_names(b)
            if len(names) > self.k:
                raise RuntimeError(f"optimizer keeps {len(names)} per-element states, the swap buffers were "
                                   f"sized for {self.k}")
            tensors = [m] + [state[n] for n in names]
            for t, view in zip(tensors, views):
                if t.data_ptr() != view.data_ptr():  # states the optimizer just created, or loaded ones
                    view.copy_(t.detach().reshape(-1))
            whole = next(v for i, v in self._views(slot, k, whole=True) if i == b)  # aligned pieces: O_DIRECT
            slot.writes.append(self.tier.write(self.tier.region_of(m), whole[0]))
            for name, view in zip(names, whole[1:]):
                slot.writes.append(self.tier.write(self._state_region(b, name), view))
            m.data = placeholder(m.shape, m.dtype)
            for name in names:
                state[name].data = placeholder(m.shape, torch.float32)
        slot.in_use = False  # on their way home; the buffer keeps the values until it is taken
        self._touch(slot)

    def end_step(self) -> None:
        """This step's order is the one to read ahead along; the next step's first sub-groups
        start coming in, one per buffer, each read behind its buffer's writes: the disk works
        while the next forward runs."""
        if self._seq:
            self._order, self._seq = self._seq, []
            self._next = {k: self._order[(i + 1) % len(self._order)] for i, k in enumerate(self._order)}
            first = [k for k in self._order if self._on_disk(k)][:self.slots_used]
            for i, k in enumerate(first):
                self.prefetch(k, behind_writes=i > 0)

    def drain(self) -> None:
        """Every read and write finished: the files hold the whole optimizer state, and no
        buffer is taken for a sub-group (the next swap_in reads from the file)."""
        for slot in self._slots:
            self._wait(slot.reads)
            self._wait(slot.writes)
            slot.sub_group = -1

    # -- outside the step: one bucket at a time ------------------------------------------------
    can_step_early = True  # sub-groups step in any order; the read-ahead follows last step's

    def master_value(self, b: int) -> torch.Tensor:
        """Bucket b's master values: a fresh tensor read from the file, or the master itself
        where bucket b is not on the nvme tier."""
        if not self.swapped[b]:
            return self.masters[b]
        self.drain()
        out = torch.empty(self.masters[b].shape, dtype=torch.float32)
        self.tier.wait(self.tier.read(self.tier.region_of(self.masters[b]), out))
        return out

    def state_value(self, b: int, name: str) -> torch.Tensor:
        if not self.swapped[b]:
            return self.optimizer.state[self.masters[b]][name]
        self.drain()
        if name not in self.state_names(b):
            return self.optimizer.state[self.masters[b]][name]
        out = torch.empty(self.masters[b].shape, dtype=torch.float32)
        self.tier.wait(self.tier.read(self._state_region(b, name), out))
        return out

    @contextlib.contextmanager
    def resident(self, b: int):
        """Bucket b's master and states in memory for in-place edits (fresh tensors read from the
        file and written back on exit, where bucket b is swapped)."""
        if not self.swapped[b]:
            yield
            return
        self.drain()
        m = self.masters[b]
        state = self.optimizer.state.get(m, {})
        names = self.state_names(b)
        m.data = self.master_value(b)
        for name in names:
            state[name].data = self.state_value(b, name)
        try:
            yield
        finally:
            self._spill(b)

    def spill(self, b: int, states: dict[str, Any]) -> dict[str, Any]:
        """`states` to hand to load_state_dict for bucket b: where it is swapped, its per-element
        states are written to the file now and replaced by placeholders."""
        return self._spill(b, states) if self.swapped[b] else states

    def after_load(self) -> None:
        """The optimizer just loaded its states: those of swapped buckets go to the file."""
        for b, swapped in enumerate(self.swapped):
            if swapped:
                self._spill(b)

    def _spill(self, b: int, states: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Write bucket b's in-memory master (and `states`, or its optimizer states) to the file
        and leave placeholders; `states` is returned with placeholders in place of what went."""
        self.drain()  # no buffer keeps values the file is about to replace
        m = self.masters[b]
        if m.numel() > 0 and m.stride() != (0,) and m.dim() == 1:
            self.tier.wait(self.tier.write(self.tier.region_of(m), m.detach().contiguous()))
            m.data = placeholder(m.shape, m.dtype)
        target = states if states is not None else self.optimizer.state.get(m, {})
        for name, v in list(target.items()):
            if (torch.is_tensor(v) and v.dim() > 0 and v.numel() == m.numel() and v.dtype == torch.float32
                    and v.stride() != (0,)):
                self.tier.wait(self.tier.write(self._state_region(b, name), v.detach().contiguous().reshape(-1)))
                if states is not None:
                    target[name] = placeholder(m.shape, torch.float32)
                else:
                    v.data = placeholder(m.shape, torch.float32)
        return states

    def close(self) -> None:
        self.drain()
        self.tier.close()


def prepare_disk(tier: NvmeTier, sizes: list[int], build, group_options: list[dict[str, Any]], sharers: int,
                 policy, unwritten: int = 0) -> list[str]:
    """Before anything is written: the disk space the optimizer's files need (masters and K
    states of the `sizes` shards, aligned, plus `unwritten` bytes other files on this disk are
    still to take) checked against the free space, the I/O path's self-test, and the start-up
    lines saying what each knob became."""
    k = state_count(build, group_options[0] if group_options else {})
    need = sum(align_up(n * 4) for n in sizes) * (1 + k) + unwritten
    space = check_space(tier.folder, need, sharers)
    self_test = tier.self_test_line()
    _, buffers = buffer_plan(policy.buffer_count)
    lines = [f"nvme tier: {tier.describe()}",
             f"nvme optimizer files: {len(sizes)} shard(s), master + {k} state(s) each; {space}"
             + (f" (counting {unwritten / 2**30:.2f} GiB of parameter shards still to be written there)"
                if unwritten else "")
             + (f"; removed {len(tier.removed_stale)} stale run folder(s)" if tier.removed_stale else ""),
             self_test,
             f"nvme swap: {buffers}; reads ahead and writes behind whenever the buffers allow",
             f"offload_optimizer.pin_memory={str(policy.pin_memory).lower()}: "
             + ("swap buffers are page-aligned host memory (no CUDA here to pin for)"
                if not torch.cuda.is_available() else "swap buffers are page-aligned pageable host memory")]
    return lines + [f"  {line}" for line in tier.aio_lines]


class MasterWriter:
    """Stage 3 in 16 bits with every master on the NVMe tier: each unit's fp32 masters go to
    the optimizer's file as the unit is built, so the build never holds more than one unit's
    masters (the whole model's would be 4 bytes per parameter). `prepare` runs the space check
    and self-test of `prepare_disk` first, on the shard sizes the unit plan implies."""

    def __init__(self, tier: NvmeTier, build, group_options: list[dict[str, Any]], sharers: int, policy) -> None:
        self.tier, self._build, self._options, self._sharers, self._policy = tier, build, group_options, sharers, policy
        self.lines: list[str] = []

    def prepare(self, sizes: list[int], other: tuple[str, int] | None = None) -> None:
        """`other` = (folder, bytes) of files another tier (stage 3's parameter shards) is about
        to write too: counted when that folder is on this tier's disk, as nothing is written yet."""
        unwritten = 0
        if other is not None and os.stat(other[0]).st_dev == os.stat(self.tier.folder).st_dev:
            unwritten = other[1]
        self.lines = prepare_disk(self.tier, sizes, self._build, self._options, self._sharers, self._policy,
                                  unwritten)

    def __call__(self, master: torch.Tensor) -> torch.Tensor:
        return self.tier.place(master)
