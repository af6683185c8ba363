"""The sharded optimizer: fp32 master copies of this rank's shards, stepped by any torch optimizer.

Each bucket's owned shard gets one fp32 master tensor; the torch optimizer sees
those tensors (grouped by the user's param groups) as its parameters, so its states
are exactly K x (shard elements). Steps run in sub-groups of `sub_group_size`
elements (DeepSpeed's knob): only one sub-group's fp32 gradients exist at a time,
and each bucket's updated shard is handed back (`after_bucket`) for publishing while
the next sub-group steps.

Each bucket's master and states live on a tier (`zeroshard.offload`): the device, or the
host with `offload_optimizer` (ZeRO-Offload). A host sub-group's gradient shards are copied
to the host before it steps (on CUDA through pinned staging buffers on a side stream, the
next sub-group's copy overlapping this one's step) and its updated masters are written back
to the device shards. Where host and device are the same memory (a CPU-only machine) no
copy is made: the tier only says, in the ledger, where each byte belongs. Buckets on the
`nvme` tier are swapped in and out around their sub-group's step by `optim/nvme_swap.py`:
the optimizer's `store` (chosen once: `ResidentStates` in memory, or the swap pipeline) says
where masters and states rest between steps; the step loop is the same for both.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, ContextManager

import torch

from zeroshard.offload import DeviceTier, Tier
from zeroshard.offload.fences import CopyFences
from zeroshard.optim.lamb import LAMB_SHARDED
from zeroshard.partition import FlatBucket, MemoryLedger
from zeroshard.partition.layout import sub_groups
from zeroshard.policies import ConfigError

Builder = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class ShardedOptimizer:
    def __init__(self, buckets: list[FlatBucket], masters: list[torch.Tensor | None], build: Builder,
                 group_options: list[dict[str, Any]], memory: MemoryLedger, sub_group_size: int,
                 tiers: list[Tier] | None = None, swap_buffers: int = 3, comm: Any = None) -> None:
        """`masters[b]` is the fp32 value of bucket b's shard, taken before any cast to 16 bits,
        or None when the shard is fp32 already: then the shard itself is the master, unless
        bucket b's tier (`tiers[b]`, the device by default) is other memory than the shard's.
        `comm` gathers the buckets of an optimizer that needs whole matrices (Muon), if any."""
        self.buckets, self.memory = buckets, memory
        self.tiers = tiers or [DeviceTier(b.shard().device) for b in buckets]
        self.masters = []
        for m, b, tier in zip(masters, buckets, self.tiers):
            if m is not None:  # a separate fp32 master (already on its tier when the build put it there)
                self.masters.append(tier.place(m))
                continue
            shard = b.read_shard()  # a stage-3 shard kept in a file (offload_param nvme) is read once
            if tier.same_memory(shard.device):
                self.masters.append(shard)
            else:
                self.masters.append(tier.place(shard.detach().float(), copy=True))
        self._separate = [m.data_ptr() != b.shard().data_ptr() for m, b in zip(self.masters, buckets)]
        self._staging = _GradStaging(self.masters, buckets, memory)
        self.fences = CopyFences()  # a sub-group's masters, copied asynchronously to their device shards
        groups = [
            {**options, "params": [m for m, b in zip(self.masters, buckets) if b.layout.group == g]}
            for g, options in enumerate(group_options)
        ]
        self.optimizer = build(groups)
        _tell_tensors(self.optimizer, self.masters, buckets, comm)
        self._sub_groups = sub_groups([m.numel() for m in self.masters], sub_group_size)
        self._sub_group_of = {b: k for k, indices in enumerate(self._sub_groups) for b in indices}
        self._final: dict[int, set[int]] = {}  # sub-group -> its buckets whose gradients are final
        self._stepped: set[int] = set()  # sub-groups stepped early (during backward) this step
        self._queued: list[tuple[int, Any]] = []  # final sub-groups whose gradients are being staged
        # where masters and states rest between steps: in memory, or swapped to NVMe files
        self.store = _state_store(self, build, group_options, swap_buffers)
        self._count_states()

    # The torch optimizer's surface that users and LR schedulers reach for.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fences.wait_all()
        self.optimizer.load_state_dict(state)
        self.store.after_load()  # loaded states go to their files (nvme)
        self._count_states()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine and cleared after each step; nothing to do."""

    def step(self, grad_shard: Callable[[int], torch.Tensor], scale: float,
             after_bucket: Callable[[int], None]) -> None:
        """Step every master with `grad_shard(b) * scale` in fp32, then write it back to bucket b.

        `scale` folds loss-scale removal and clipping into one multiply. A gradient
        already in fp32 is scaled in place (the engine clears it after the step
        anyway); a 16-bit one is upcast into a temporary that lives for one sub-group."""
        self.step_queued(scale, after_bucket)  # none left after an engine backward; kept safe
        todo = [k for k in range(len(self._sub_groups)) if k not in self._stepped]
        staged = self._staging.start(self._sub_groups[todo[0]], grad_shard) if todo else None
        for i, k in enumerate(todo):
            grads = self._staging.finish(staged)
            if i + 1 < len(todo):  # the next sub-group's device->host copy overlaps this step
                staged = self._staging.start(self._sub_groups[todo[i + 1]], grad_shard)
            self._step_sub_group(k, grads, scale, after_bucket)
        self.store.end_step()  # nvme: writes land during the next forward; the next step's first read starts
        self.forget_early()
        self._count_states()

    @property
    def can_step_early(self) -> bool:
        """Whether sub-groups may step one by one as their gradients become final (during
        backward): the NVMe pipeline reads ahead along the order they stepped in last step, and
        an optimizer whose step gathers (Muon) needs every rank to step in the same order."""
        return self.store.can_step_early and not getattr(self.optimizer, "steps_collectively", False)

    def forget_early(self) -> None:
        """A new accumulation boundary: no sub-group has stepped early yet."""
        self._stepped.clear()
        self._final.clear()
        self._queued.clear()

    def grad_final(self, b: int, grad_shard: Callable[[int], torch.Tensor], scale: float,
                   after_bucket: Callable[[int], None]) -> None:
        """Bucket b's gradient shard is final (during backward). Once every bucket of its
        sub-group is, it steps: at once where its gradients are in the master's memory already,
        else their copy starts (a side stream on CUDA) and it steps at the next `step_queued`,
        which the engine calls right after the next reduction is issued, so that the copy
        overlaps backward. The next `step()` steps only the sub-groups not stepped this way."""
        k = self._sub_group_of[b]
        self._final.setdefault(k, set()).add(b)
        if k in self._stepped or len(self._final[k]) < len(self._sub_groups[k]):
            return
        self._stepped.add(k)
        if self._queued:  # two staging buffers: the queued sub-group steps before a third is filled
            self.step_queued(scale, after_bucket)
        staged = self._staging.start(self._sub_groups[k], grad_shard)
        self._queued.append((k, staged))
        if staged[1] is None:  # no copy to wait for (same memory, or done): step now
            self.step_queued(scale, after_bucket)

    def step_queued(self, scale: float, after_bucket: Callable[[int], None]) -> None:
        """Step the sub-groups whose gradients became final since the last call."""
        if not self._queued:
            return
        while self._queued:
            k, staged = self._queued.pop(0)
            grads = self._staging.finish(staged)
            self._step_sub_group(k, grads, scale, after_bucket)
        self._count_states()  # a first step creates states: the ledger sees them when they exist

    def _step_sub_group(self, k: int, grads: list[torch.Tensor], scale: float,
                        after_bucket: Callable[[int], None]) -> None:
        self.store.swap_in(k)  # nvme: and starts reading the sub-group expected next
        indices = self._sub_groups[k]
        upcast = 0
        for b, g in zip(indices, grads):
            if g.dtype == torch.float32:
                self.masters[b].grad = g.mul_(scale) if scale != 1.0 else g
            else:
                self.masters[b].grad = g.float().mul_(scale)
                upcast += g.numel() * 4
        self.memory.hold("grads", "fp32_subgroup", upcast, tier=self.tiers[indices[0]].name)
        self.fences.wait(k)  # last step's copies out of these masters have read them (CUDA)
        self.optimizer.step()
        for b in indices:
            self.masters[b].grad = None
            if self._separate[b]:  # into the shard's home (a file with offload_param nvme)
                self.buckets[b].write_shard(self.masters[b], asynchronous=True)
            after_bucket(b)
        if any(self._separate[b] for b in indices):
            self.fences.record(k)
        self.memory.release("grads", "fp32_subgroup")
        self.store.swap_out(k)  # nvme: written while the next sub-group steps

    # -- values of masters and states wherever they live (the NVMe tier keeps placeholders) --
    def master_value(self, b: int) -> torch.Tensor:
        """Bucket b's fp32 master values: the master itself, or a fresh copy read from its file."""
        return self.store.master_value(b)

    def state_value(self, b: int, name: str) -> Any:
        return self.store.state_value(b, name)

    def resident(self, b: int) -> ContextManager[None]:
        """A context in which bucket b's master and states are real tensors that may be edited."""
        self.fences.wait(self._sub_group_of[b])  # not while a copy out of the master is in flight
        return self.store.resident(b)

    def spill_states(self, b: int, states: dict[str, Any]) -> dict[str, Any]:
        """`states` for bucket b as they should be handed to load_state_dict: on the NVMe tier the
        per-element ones are written to the file now and replaced by placeholders (bounded memory)."""
        return self.store.spill(b, states)

    def close(self) -> None:
        """Finish pending I/O and remove the NVMe tier's files (nothing to do on other tiers)."""
        self.store.close()

    def _count_states(self) -> None:
        """Per tier. Masters that are the parameter shards themselves are counted as parameters."""
        master_bytes: dict[str, int] = defaultdict(int)
        state_bytes: dict[str, int] = defaultdict(int)
        for m, own, tier in zip(self.masters, self._separate, self.tiers):
            if own:
                master_bytes[tier.name] += m.nbytes
            states = self.optimizer.state.get(m, {}).values()  # per-element ones: not the scalar step counters
            state_bytes[tier.name] += sum(t.nbytes for t in states if torch.is_tensor(t) and t.dim() > 0)
        if self.tiers:  # a 1-bit optimizer's worker and server errors (optim/onebit.py), beside its states
            state_bytes[self.tiers[0].name] += getattr(self.optimizer, "error_bytes", 0)
        for name in {t.name for t in self.tiers}:
            self.memory.hold("optimizer_states", f"master.{name}", master_bytes[name], tier=name)
            self.memory.hold("optimizer_states", f"states.{name}", state_bytes[name], tier=name)

    def tier_summary(self) -> str:
        """'host 12.3M elements in 4 sub-group(s)', per tier, for the start-up lines."""
        parts = []
        for name in sorted({t.name for t in self.tiers}):
            idx = [b for b, t in enumerate(self.tiers) if t.name == name]
            parts.append(f"{name} {sum(self.masters[b].numel() for b in idx):,} elements "
                         f"({len(idx)} bucket shard(s))")
        return ", ".join(parts)


class ResidentStates:
    """Masters and states that stay in memory (the device or host tier) between steps: the
    store's swap points do nothing and values are the tensors themselves."""

    can_step_early = True

    def __init__(self, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.masters, self.optimizer = masters, optimizer

    def swap_in(self, k: int) -> None: ...
    def swap_out(self, k: int) -> None: ...
    def end_step(self) -> None: ...
    def after_load(self) -> None: ...
    def close(self) -> None: ...

    def master_value(self, b: int) -> torch.Tensor:
        return self.masters[b]

    def state_value(self, b: int, name: str) -> Any:
        return self.optimizer.state[self.masters[b]][name]

    def resident(self, b: int) -> ContextManager[None]:
        return contextlib.nullcontext()

    def spill(self, b: int, states: dict[str, Any]) -> dict[str, Any]:
        return states


def _state_store(opt: ShardedOptimizer, build: Builder, group_options: list[dict[str, Any]], buffers: int):
    """Chosen once: the NVMe swap pipeline when any bucket's tier is nvme, else in memory."""
    if not any(t.name == "nvme" for t in opt.tiers):
        return ResidentStates(opt.masters, opt.optimizer)
    from zeroshard.optim.nvme_swap import SwapPipeline, state_count

    tier = next(t for t in opt.tiers if t.name == "nvme")
    return SwapPipeline(tier, opt.masters, [t.name == "nvme" for t in opt.tiers], opt._sub_groups, opt.optimizer,
                        state_count(build, group_options[0] if group_options else {}), buffers, opt.memory)


class _GradStaging:
    """Gradient shards on their master's memory for a sub-group's step. Same memory: the
    shard itself. CUDA device -> host: two pinned buffers of the largest sub-group, filled on
    a side stream, so the copy of sub-group k+1 overlaps the step of sub-group k."""

    def __init__(self, masters: list[torch.Tensor], buckets: list[FlatBucket], memory: MemoryLedger) -> None:
        self._memory = memory
        # where the gradient shard lands (the bucket's compute device), not where the parameter
        # shard rests: at stage 3 with offload_param the shard is on the host, the gradient not
        self._crossing = [m.device != b.device for m, b in zip(masters, buckets)]
        self._masters = masters
        self._stream = None
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        if any(self._crossing) and torch.cuda.is_available():
            self._stream = torch.cuda.Stream()

    def start(self, indices: list[int], grad_shard: Callable[[int], torch.Tensor]):
        grads = [grad_shard(b) for b in indices]
        if not any(self._crossing[b] for b in indices):
            return grads, None
        if self._stream is None:  # no CUDA: a plain copy (a device other than cpu without streams)
            return [g.to(self._masters[b].device) if self._crossing[b] else g for b, g in zip(indices, grads)], None
        need = sum(g.numel() for b, g in zip(indices, grads) if self._crossing[b])
        buffer = self._buffer(need, grads[0].dtype)
        self._stream.wait_stream(torch.cuda.current_stream())  # the gradients are final
        out, offset = [], 0
        with torch.cuda.stream(self._stream):
            for b, g in zip(indices, grads):
                if not self._crossing[b]:
                    out.append(g)
                    continue
                dst = buffer[offset: offset + g.numel()].view_as(g)
                dst.copy_(g, non_blocking=True)
                g.record_stream(self._stream)
                out.append(dst)
                offset += g.numel()
            event = torch.cuda.Event()
            event.record(self._stream)
        return out, event

    def finish(self, staged) -> list[torch.Tensor]:
        grads, event = staged
        if event is not None:
            event.synchronize()  # the host reads these buffers next
        return grads

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._turn ^= 1
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, dtype=dtype).pin_memory())
        buf = self._buffers[self._turn]
        if buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype).pin_memory()
            self._buffers[self._turn] = buf
            self._memory.hold("comm_buffers", f"grad_staging{self._turn}", buf.nbytes, tier="host")
        return buf


def _tell_tensors(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], buckets: list[FlatBucket],
                  comm: Any = None) -> None:
    """An optimizer whose update needs whole tensors learns where each parameter lies in each
    master: Lamb's trust ratio (optim/lamb.py) only where a whole bucket is on the rank (stage 0);
    Muon's Newton-Schulz (optim/muon.py) at every stage, with a way to gather a sharded bucket."""
    place = getattr(optimizer, "place_matrices", None)
    if place is not None:
        for master, bucket in zip(masters, buckets):
            lo, hi = bucket.shard_range
            sharded = bucket.layout.shard_count > 1
            if sharded and comm is None:
                raise ConfigError("a sharded Muon step needs the engine's comm: this is a zeroshard bug, please "
                                  "report it")
            place(master, [(slot.offset, slot.shape) for slot in bucket.layout.slots], (lo, hi),
                  _gatherer(comm, bucket) if sharded else None)
    split = getattr(optimizer, "split_into_tensors", None)
    if split is None:
        return
    shards = getattr(optimizer, "place_shards", None)  # Lamb: per-tensor norms summed over the ranks
    if any(b.layout.shard_count > 1 for b in buckets) and (shards is None or comm is None):
        raise ConfigError(getattr(optimizer, "sharded_refusal", LAMB_SHARDED))
    for master, bucket in zip(masters, buckets):
        lay = bucket.layout
        if lay.shard_count == 1:
            split(master, [(slot.offset, slot.numel) for slot in lay.slots])
            continue
        lo = bucket.shard_range[0]
        pieces = [(a - lo, b - a, k) for k, slot in enumerate(lay.slots)
                  if (part := lay.slot_in_shard(slot, bucket.shard_index)) is not None for a, b in [part]]
        shards(master, pieces, len(lay.slots), _summer(comm, bucket))


def _summer(comm: Any, bucket: FlatBucket) -> Callable[[torch.Tensor], torch.Tensor]:
    """A small fp32 vector summed over the ranks sharing `bucket`, on the collective's device."""
    def total(x: torch.Tensor) -> torch.Tensor:
        on = x.to(bucket.device)
        comm.all_reduce(on, what=f"Lamb norms of {bucket.label}").wait()
        return on.to(x.device)
    return total


def _gatherer(comm: Any, bucket: FlatBucket) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's shard of values -> the whole padded bucket's, all-gathered on the bucket's
    device (the collective's) and handed back where the shard was (a host master)."""
    def gather(shard: torch.Tensor) -> torch.Tensor:
        whole = torch.empty(bucket.layout.padded_numel, dtype=shard.dtype, device=bucket.device)
        comm.all_gather(whole, shard.to(bucket.device), what=f"Muon update of {bucket.label}").wait()
        return whole.to(shard.device)
    return gather
