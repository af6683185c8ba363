"""Stage 3 at run time: gather a unit before it computes, release it after, prefetch ahead.

State is explicit: the engine moves `phase` through IDLE -> FORWARD -> IDLE -> BACKWARD
-> IDLE; each unit is RELEASED, GATHERING (all-gather in flight) or GATHERED, and counts
its active users (stages/unit_state.py, which also keeps each parameter's `ds_status`). Its
hooks go through `stages/hooks.py`, kept per unit so that they can be detached and attached
again (DeepSpeed clients do around generation); each bucket owns its full buffer
(`UnitBucket.start_gather` / `finish_gather` / `release`). Outside the engine's passes (its
modules called directly, e.g. by `generate`) a unit is gathered around each forward (a unit of
several modules, e.g. a tied embedding and head, to the end of the model's: nesting.py), unrecorded.

- forward: a unit's pre-forward hook gathers it (waiting for a prefetch if one is in
  flight) and prefetches the next units of the recorded order; its post-forward hook
  releases it unless it is reused soon (`max_reuse_distance`) and memory allows
  (`max_live_parameters`), and registers a hook on its outputs that gathers it again
  when backward reaches them.
- backward: the unit is released once the gradients w.r.t. its inputs exist (an identity on
  the inputs tells: `hooks.after_inputs_grad`), or at the end of backward. A forward that
  runs *during* backward is an activation-checkpoint recompute: it gathers but never releases.
- order: the first step records the sequence of gathers; later steps prefetch along it.
  A step whose sequence differs (control flow changed) stops prefetching for the rest
  of the step, and its sequence becomes the new record. Every rank does the same.
- ZeRO++ (`Stage3Collectives`): the forward gather may be qwZ (int8); with hpZ each bucket keeps,
  from its first gather of a pass, its rank's slice of the full parameters in its hpZ group (the
  secondary partition, in the node), and backward gathers from those; dropped when the pass ends.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.policies import Stage3Policy
from zeroshard.stages.hooks import Handle, Hooks, after_inputs_grad, tensors_in, when_grad_reaches
from zeroshard.stages.nesting import ForwardNesting
from zeroshard.stages.unit_state import Unit, UnitState
from zeroshard.stages.outside_reads import OutsideReads

if TYPE_CHECKING:
    from zeroshard.comm import AllGather

log = logging.getLogger("zeroshard")


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Stage3Collectives:
    """What gathers a unit's bucket: `forward` / `backward` for trainable buckets, `*_frozen`
    for frozen ones (a plain Comm, or qwZ's quantized all-gather), `hpz`, the comm of this
    rank's hpZ group (None without hpZ), and `exact`, the plain all-gather of the primary shards
    that GatheredParameters uses (its values may be edited and written back)."""

    forward: AllGather
    backward: AllGather
    forward_frozen: AllGather
    backward_frozen: AllGather
    hpz: AllGather | None = None
    exact: AllGather | None = None

    @staticmethod
    def plain(comm: AllGather) -> "Stage3Collectives":
        return Stage3Collectives(comm, comm, comm, comm, exact=comm)


class Stage3Runtime:
    def __init__(self, units: list[Unit], policy: Stage3Policy, external_users: dict[int, list[nn.Module]],
                 collectives: Stage3Collectives, root: nn.Module | None = None) -> None:
        self.units, self.policy, self.collectives = units, policy, collectives
        self.phase = Phase.IDLE
        self._trace: list[int] = []  # recorded gather order of a whole step
        self._recording: list[int] = []
        self._on_trace = False  # the step so far follows the record: prefetch is safe
        self._backward_pending = False  # a forward with grad ran; its backward has not
        # each unit's hooks, on its module and on the modules outside it that read its parameters
        self._users = {u.index: [u.module, *external_users.get(u.index, [])] for u in units}
        self._hooks = {u.index: Hooks() for u in units}
        self._backward_off: set[int] = set()  # units whose backward hooks are detached
        self._nesting = ForwardNesting(root, self._release_deferred)
        self.attach_hooks()
        self._unit_of_param = {id(p): u for u in units for b in u.buckets for p in b.params}
        self._pinned: set[int] = set()  # units adopted by an outside read: kept until the pass ends
        self._external = {(id(m), u.index) for u in units for m in external_users.get(u.index, [])}
        self._reads = OutsideReads(self)
        self.keep = None  # a KeepGathered while engine.generation() runs (stages/generation.py)

    # -- phases, driven by the engine -------------------------------------------------
    def begin_forward(self) -> None:
        # the last forward never got a backward (an evaluation in between, without grad, lets
        # the pending step go on)
        if self._backward_pending and torch.is_grad_enabled():
            self._finish_pass(record=False)
        if not self._recording:
            self._on_trace = bool(self._trace)
        self.phase = Phase.FORWARD
        self._reads.__enter__()

    def end_forward(self) -> None:
        self._reads.__exit__(None, None, None)
        self.phase = Phase.IDLE
        if torch.is_grad_enabled():
            self._backward_pending = True
        elif not self._backward_pending:
            self._finish_pass(record=False)  # evaluation: nothing follows, nothing to record

    def begin_backward(self) -> None:
        self.phase = Phase.BACKWARD

    def end_backward(self) -> None:
        """Every unit is released; the pass's gather sequence becomes the record if it changed."""
        self._finish_pass(record=True)

    def _finish_pass(self, record: bool) -> None:
        self._pinned.clear()
        self._nesting.deferred.clear()
        for unit in self.units:
            unit.users = 0
            unit.active.clear()
            if self.keep is None or unit.index not in self.keep.kept:  # a generation keeps its units
                self._release(unit)
            if self.collectives.hpz is not None:  # the secondaries serve one pass only
                for bucket in unit.buckets:
                    bucket.drop_secondary()
        if record and self._recording and self._recording != self._trace:
            if self._trace:
                log.info("stage 3: execution order changed; re-recorded (%d gathers)", len(self._recording))
            self._trace = self._recording
        self._recording = []
        self._backward_pending = False
        self.phase = Phase.IDLE

    # -- hooks: attached or detached per unit (DeepSpeed clients detach them around generation) --
    def hooked_modules(self) -> set[int]:
        """Ids of the modules carrying a unit's hooks (its own module and its outside readers)."""
        return {id(m) for users in self._users.values() for m in users}

    def hooks_attached(self, unit: Unit) -> bool:
        return self._hooks[unit.index].attached

    def attach_hooks(self, units: list[Unit] | None = None) -> None:
        """(Re-)attach the forward and backward hooks of `units` (all by default)."""
        for unit in self.units if units is None else units:
            self._backward_off.discard(unit.index)
            if not self._hooks[unit.index].attached:
                for module in self._users[unit.index]:
                    self._register(module, unit)
        self._nesting.hooked(True)

    def detach_hooks(self, units: list[Unit] | None = None, backward_only: bool = False) -> None:
        """Detach the hooks of `units`: with `backward_only`, only what prepares their backward
        (regathering, release); else their module hooks too (a forward gathers nothing)."""
        for unit in self.units if units is None else units:
            self._backward_off.add(unit.index)
            if not backward_only:
                self._hooks[unit.index].remove()
        self._nesting.hooked(any(h.attached for h in self._hooks.values()))

    def hook_handle(self, unit: Unit, backward: bool = False) -> Handle:  # remove(): detach_hooks
        return Handle(lambda: self.detach_hooks([unit], backward_only=backward))

    remove_hooks = detach_hooks  # every unit's, and the model's own (the engine's close)

    def release_all(self) -> None:
        """Between passes: release every gathered unit (kept for reuse by a forward whose backward
        never came, or pinned) and forget that forward (DeepSpeed's `empty_partition_cache`)."""
        if self.phase is not Phase.IDLE:
            raise RuntimeError(f"stage 3: units cannot be released during the {self.phase.value} pass")
        self._finish_pass(record=False)

    def trace_invalid(self) -> bool:  # no recorded order to prefetch along (the next step records one)
        return not self._trace

    def invalidate_trace(self) -> None:  # forget the recorded order (and, between passes, the recording)
        self._trace, self._on_trace = [], False
        if self.phase is Phase.IDLE and not self._backward_pending:
            self._recording = []

    # -- gathering ------------------------------------------------------------------------
    def gather(self, unit: Unit, exact: bool = False) -> None:
        """Make `unit` usable now (collective: every rank must call it in the same order).
        `exact`: from the primary shards with a plain all-gather (no qwZ, no hpZ secondary kept),
        when the unit is released."""
        if unit.state is UnitState.RELEASED:
            self._make_room(unit.numel)
            self._start(unit, exact)
        if unit.state is UnitState.GATHERING:
            hpz = None if exact else self.collectives.hpz
            for bucket in unit.buckets:
                full = bucket.finish_gather()
                if hpz is not None and bucket.secondary is None:
                    bucket.keep_secondary(full, hpz.rank, hpz.world_size)
            unit.move(UnitState.GATHERED)

    def _start(self, unit: Unit, exact: bool = False) -> None:
        what = f"unit '{unit.label}' ({self.phase.value})"
        c = self.collectives
        backward = self.phase is Phase.BACKWARD
        for bucket in unit.buckets:
            if exact and c.exact is not None:
                bucket.start_gather(c.exact, what + " [exact]")
                continue
            # hpZ: any later gather of this pass (backward, a prefetch for backward issued at the end
            # of forward, a reused unit) comes from the secondaries, inside the node
            if c.hpz is not None and bucket.secondary is not None:
                bucket.start_gather(c.hpz, what + " [hpZ secondary]", source=bucket.secondary)
                continue
            trainable = bucket.params[0].requires_grad
            collective = (c.backward if trainable else c.backward_frozen) if backward else \
                (c.forward if trainable else c.forward_frozen)
            bucket.start_gather(collective, what)
        unit.move(UnitState.GATHERING)

    def _release(self, unit: Unit) -> None:
        if unit.state is UnitState.RELEASED or unit.index in self._pinned:
            return
        for bucket in unit.buckets:  # a prefetch nobody used is finished by the bucket, then dropped
            bucket.release()
        unit.move(UnitState.RELEASED)

    def _live(self) -> int:
        return sum(u.numel for u in self.units if u.state is not UnitState.RELEASED)

    def _make_room(self, numel: int) -> None:
        """Drop units kept for reuse (nobody is using them) while over max_live_parameters."""
        for unit in self.units:
            if self._live() + numel <= self.policy.max_live_parameters:
                return
            if unit.users == 0 and unit.state is not UnitState.RELEASED:
                self._release(unit)

    def _use(self, unit: Unit) -> None:
        """A unit is about to compute: record it, gather it, prefetch what follows it. Outside
        the engine's passes (its modules called directly, e.g. to generate) it is only gathered."""
        if self.phase is Phase.IDLE:
            self.gather(unit)
            return
        position = len(self._recording)
        self._recording.append(unit.index)
        if self._on_trace and (position >= len(self._trace) or self._trace[position] != unit.index):
            self._on_trace = False
        self.gather(unit)
        if self._on_trace and self.phase is not Phase.BACKWARD:
            self._prefetch(position + 1)

    def _prefetch(self, start: int) -> None:
        ahead = 0  # elements of the recorded order looked past, gathered or not
        for index in self._trace[start:]:
            unit = self.units[index]
            ahead += unit.numel
            if ahead > self.policy.prefetch_bucket_size:
                return
            if unit.state is not UnitState.RELEASED:
                continue
            if self._live() + unit.numel > self.policy.max_live_parameters:
                return
            self._start(unit)

    def _reused_soon(self, unit: Unit) -> bool:
        """Will the recorded order use `unit` again within max_reuse_distance elements?"""
        if not self._on_trace or not torch.is_grad_enabled() or self.phase is Phase.IDLE:
            return False
        distance = 0
        for index in self._trace[len(self._recording):]:
            if index == unit.index:  # strictly closer: max_reuse_distance 0 never keeps a unit
                return distance < self.policy.max_reuse_distance and \
                    self._live() <= self.policy.max_live_parameters
            distance += self.units[index].numel
        return False

    # -- hooks ------------------------------------------------------------------------------
    def _register(self, module: nn.Module, unit: Unit) -> None:
        self._hooks[unit.index].around_forward(module, lambda m, args, kwargs: self._pre_forward(m, unit, args, kwargs),
                                   lambda m, out: self._post_forward(m, unit, out))

    def _pre_forward(self, module: nn.Module, unit: Unit, args, kwargs):
        self._nesting.enter(module)
        unit.users += 1
        unit.active.add(id(module))
        self._use(unit)
        if not torch.is_grad_enabled() or unit.index in self._backward_off:
            return None
        # route the inputs through an identity whose backward tells when this unit's backward is over
        flat = [(i, None, a) for i, a in enumerate(args)] + [(None, k, v) for k, v in kwargs.items()]
        needs = [(i, k, t) for i, k, t in flat if torch.is_tensor(t) and t.requires_grad]
        if not needs:
            return None
        wrapped = after_inputs_grad([t for _, _, t in needs], lambda: self._post_backward(unit))
        args, kwargs = list(args), dict(kwargs)
        for (i, k, _), t in zip(needs, wrapped):
            if k is None:
                args[i] = t
            else:
                kwargs[k] = t
        return tuple(args), kwargs

    def adopt(self, param: nn.Parameter) -> None:
        """`param` is read while its unit is released, inside the forward of the innermost
        active module: gather the unit now (every rank reaches the same read), keep it for the
        rest of this pass, and from now on gather it around that module's forward too."""
        unit = self._unit_of_param[id(param)]
        reader = self._nesting.innermost()
        self.pin(unit)
        if reader is not None and (id(reader), unit.index) not in self._external:
            self._external.add((id(reader), unit.index))
            self._users[unit.index].append(reader)
            self._register(reader, unit)
            unit.users += 1  # the post-forward hook just registered will run for this call
            unit.active.add(id(reader))
            self._nesting.enter(reader)  # ... and pop this entry
            log.info("stage 3: unit '%s' is read inside the forward of %s; it is now gathered with it",
                     unit.label, type(reader).__name__)

    def external_params(self, module: nn.Module) -> list[nn.Parameter]:
        """Parameters of units `module` is an outside user of (read in its forward, not its own)."""
        own = {id(p) for p in module.parameters(recurse=False)}
        return [p for u in self.units if (id(module), u.index) in self._external
                for b in u.buckets for p in b.params if id(p) not in own]

    def units_of(self, params) -> list[Unit]:
        units = {self._unit_of_param[id(p)].index for p in params if id(p) in self._unit_of_param}
        return [self.units[i] for i in sorted(units)]

    def pin(self, unit: Unit, exact: bool = False) -> None:
        """Gather `unit` (a collective) and keep it so until `unpin` or the end of the pass."""
        self.gather(unit, exact)
        self._pinned.add(unit.index)

    def unpin(self, unit: Unit) -> None:
        self._pinned.discard(unit.index)
        if unit.users == 0 and self.phase is Phase.IDLE:
            self._release(unit)

    def manages(self, param) -> bool:
        return isinstance(param, nn.Parameter) and id(param) in self._unit_of_param

    def gathered_for_backward(self, param) -> None:
        """A weight stage 3's linear saved is read in backward: its unit is gathered then by the
        hooks; if it is not (released early for max_live_parameters), gather it now for the pass."""
        unit = self._unit_of_param[id(param)]
        if unit.state is not UnitState.GATHERED:
            self.pin(unit)

    def is_released(self, param) -> bool:
        unit = self._unit_of_param.get(id(param))
        return unit is not None and unit.state is not UnitState.GATHERED

    def _post_forward(self, module: nn.Module, unit: Unit, output):
        self._nesting.leave(module)
        unit.users -= 1
        unit.active.discard(id(module))
        if torch.is_grad_enabled() and unit.index not in self._backward_off:
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                when_grad_reaches(tensors, lambda: self._pre_backward(unit))
        if self.phase is Phase.BACKWARD:  # recompute for activation checkpointing: keep it
            return output
        if self.keep is not None and unit.users == 0 and self.keep.used(unit):  # generation: kept
            return output
        if unit.users == 0 and not self._reused_soon(unit):
            if self._read_again_in_this_forward(unit):
                self._nesting.deferred.add(unit.index)
            else:
                self._release(unit)
        self._release_deferred()
        return output

    def _release_deferred(self) -> None:  # the outermost forward is over
        for unit in [self.units[i] for i in self._nesting.ended() if self.units[i].users == 0]:
            self._release(unit)

    def _read_again_in_this_forward(self, unit: Unit) -> bool:
        """Outside training passes, a unit of several modules stays gathered to the end of the
        outermost forward; `_make_room` still releases it if max_live_parameters needs."""
        if self.phase is not Phase.IDLE and torch.is_grad_enabled():
            return False  # a training pass: the recorded order decides (_reused_soon)
        return self._nesting.inside() and len(self._users[unit.index]) > 1

    def _pre_backward(self, unit: Unit) -> None:
        if self.phase is Phase.BACKWARD:
            self._use(unit)

    def _post_backward(self, unit: Unit) -> None:
        """Gradients w.r.t. the unit's inputs are computed: its backward is over. (A unit whose
        inputs need no gradient, e.g. the embeddings, is released when backward ends.)"""
        if self.phase is Phase.BACKWARD and unit.users == 0:
            self._release(unit)
            # in backward, prefetch only once a unit is done: its gradients are reduced and
            # its parameters released, so the next unit's gather never overlaps them
            if self._on_trace:
                self._prefetch(len(self._recording))

