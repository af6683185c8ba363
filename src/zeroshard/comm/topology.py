"""Process group and device: one validated object, created once by `setup_topology`.

Uses the default process group when one exists (a user or a test made it), else
creates it from the launcher's environment (torchrun, mpirun, srun: comm/launchers.py), else
runs as a single process (world 1).
It remembers whether it created the group, and only then destroys it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.comm.launchers import DEFAULT_PORT, discover, join_launcher
from zeroshard.policies import ConfigError

log = logging.getLogger("zeroshard")


INTRA_NODE, INTER_NODE = "intra_node", "inter_node"
SCOPES = (INTRA_NODE, INTER_NODE)


class GroupRef:
    """The one reference zeroshard keeps to a process group it made on a user's default group.
    A gloo group's threads stop only when the group object is freed, not when it is destroyed;
    engines a script keeps alive (hooks on its parameters) would carry their groups into
    interpreter shutdown, where their destruction can abort the process. Destroying through
    the ref drops that reference; a collective on it afterwards is an error, never the
    default group."""

    __slots__ = ("pg",)

    def __init__(self, pg: Any):
        self.pg = pg

    def destroy(self) -> None:
        pg, self.pg = self.pg, _RELEASED
        if pg is not _RELEASED and dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # already destroyed by the user's own destroy call
                dist.destroy_process_group(pg)


_RELEASED = "a process group zeroshard has destroyed (engine.close() or the end of the script)"


@dataclass(frozen=True)
class Group:
    """A set of ranks zeroshard runs collectives on. `handle` is the process group (None: the
    default group); `rank` is this rank's index in `ranks`; `scope` says whether every rank
    of the group lives on one node (intra_node) or not (inter_node)."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    scope: str
    ref: GroupRef | None = None

    @property
    def handle(self) -> Any:
        return None if self.ref is None else self.ref.pg

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Hierarchy:
    """The groups ZeRO++ runs on, this rank's member of each: `intra` (this node's ranks),
    `inter` (the ranks of every node with this local rank), `hpz` (this rank's
    zero_hpz_partition_size consecutive ranks within the node)."""

    intra: Group
    inter: Group
    hpz: Group


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str  # "gloo", "nccl" or "none" (single process, no group)
    owns_group: bool
    # zeroshard's collectives run on `group`: the default group when zeroshard created it (with
    # comm_timeout_s), else a group of all ranks made here with comm_timeout_s, so a dead or
    # stuck peer is reported within it even where the backend blocks inside the call (gloo's
    # reduce-scatter), whatever timeout the user's own group has (30 minutes by default)
    group: GroupRef | None = None
    _hierarchies: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        return self.backend != "none"

    # -- nodes: torchrun's LOCAL_WORLD_SIZE consecutive ranks ---------------------------------
    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def scope_of(self, ranks) -> str:
        return INTRA_NODE if len({self.node_of(r) for r in ranks}) <= 1 else INTER_NODE

    @property
    def world(self) -> Group:
        """All ranks, on `group` (the default group or the one made with comm_timeout_s)."""
        ranks = tuple(range(self.world_size))
        return Group("world", ranks, self.rank, self.scope_of(ranks), self.group)

    def hierarchy(self, hpz_size: int, timeout_s: float) -> Hierarchy:
        """The intra-node, inter-node and hpZ groups, made once per topology (a collective:
        every rank calls it at the same point with the same `hpz_size`)."""
        if hpz_size in self._hierarchies:
            return self._hierarchies[hpz_size]
        lws, world = self.local_world_size, self.world_size
        if world % lws:
            raise ConfigError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={lws}: zeroshard's "
                              "node groups need the same number of ranks on every node; launch with torchrun "
                              "--nproc-per-node set alike on every node")
        if hpz_size < 1 or lws % hpz_size:
            raise ConfigError(f"zero_optimization.zero_hpz_partition_size = {hpz_size} does not divide the "
                              f"{lws} ranks per node (LOCAL_WORLD_SIZE); the secondary partition must stay inside "
                              f"a node: use 1 or a divisor of {lws}")
        group_rank = os.environ.get("GROUP_RANK")
        if group_rank is not None and group_rank.isdigit() and int(group_rank) != self.node:
            raise ConfigError(f"rank {self.rank}: GROUP_RANK={group_rank} but RANK // LOCAL_WORLD_SIZE = "
                              f"{self.node}: zeroshard takes a node to be LOCAL_WORLD_SIZE consecutive ranks, "
                              "as torchrun assigns them; launch with torchrun")
        node_sets = [tuple(range(m * lws, (m + 1) * lws)) for m in range(world // lws)]
        rail_sets = [tuple(range(l, world, lws)) for l in range(lws)]
        hpz_sets = [tuple(range(g * hpz_size, (g + 1) * hpz_size)) for g in range(world // hpz_size)]
        made: dict[tuple[int, ...], Any] = {}

        def member(name: str, sets: list[tuple[int, ...]]) -> Group:
            mine = None
            for ranks in sets:  # every rank creates every group, in the same order
                if ranks not in made:
                    made[ranks] = self._new_group(ranks, timeout_s)
                if self.rank in ranks:
                    mine = ranks
            assert mine is not None
            return Group(name, mine, mine.index(self.rank), self.scope_of(mine), made[mine])

        out = Hierarchy(member("intra_node", node_sets), member("inter_node", rail_sets),
                        member("hpz", hpz_sets))
        self._hierarchies[hpz_size] = out
        return out

    def _new_group(self, ranks: tuple[int, ...], timeout_s: float):
        if not self.distributed or len(ranks) == self.world_size:
            return self.group  # the whole world: the group zeroshard already runs on
        group = GroupRef(dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s)))
        _own_groups.append(group)
        return group

    def destroy(self) -> None:
        """Destroy the default group, but only if this topology created it; else only the
        group of its own that it made."""
        if self.owns_group and dist.is_initialized():
            for h in self._hierarchies.values():
                for g in (h.intra, h.inter, h.hpz):
                    _release(g.ref)
            self._hierarchies.clear()
            dist.destroy_process_group()
            _created.clear()
        else:
            self.release_group()

    def release_group(self) -> None:
        """Destroy the groups this topology made for itself (its own world group on a user's
        default group, and the node / hpZ groups)."""
        groups = [g.ref for h in self._hierarchies.values() for g in (h.intra, h.inter, h.hpz)]
        self._hierarchies.clear()
        for group in [*groups, self.group]:
            _release(group)


_created: list[bool] = []  # non-empty while a group zeroshard created is alive
# The launcher's rendezvous store, kept for the process's life once zeroshard made a default
# group on it (rank 0 hosts its server unless torchelastic's agent does), and how many default
# groups this process has made on it: each group rendezvouses under a prefix of its own.
_store: dict[tuple, Any] = {}
_made: list[int] = [0]
_own_groups: list[GroupRef] = []  # groups made on a user's default group, until released


def _release(group: GroupRef | None) -> None:
    """Destroy `group` if it is one of zeroshard's own that is still alive."""
    if group is not None and group in _own_groups:
        _own_groups.remove(group)
        group.destroy()

# Modules torch imports lazily on first use (building any torch.optim optimizer imports
# torch._dynamo). Imported after the process group exists, they keep a reference to it that
# destroy_process_group() does not drop: its gloo threads then live on into interpreter
# shutdown, where their destruction sometimes aborts the process ("terminate called without
# an active exception", SIGABRT) after training succeeded. Imported first, they hold nothing.
_IMPORT_BEFORE_GROUP = ("torch._dynamo",)


def _import_lazy_torch_modules() -> None:
    for name in _IMPORT_BEFORE_GROUP:
        with contextlib.suppress(ImportError):  # a torch build without it has nothing to capture the group either
            importlib.import_module(name)


def _group_store(timeout: datetime.timedelta) -> tuple[Any, int, int]:
    """(store, rank, world size) for the next default group zeroshard makes: torch's own env://
    rendezvous (MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, torchelastic's agent store when it
    has one), made once per process and kept, under a prefix per group. A store made and dropped
    with each group, as init_process_group's own is, lets a rank that closed its engine first
    start the next group on the server of a rank 0 still closing the last one: rank 1 joins the
    old server, rank 0's new one waits for it ("1/2 clients joined") until the timeout, a hang
    for whoever closes and re-creates engines (a notebook, a hyperparameter search)."""
    key = tuple(os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
    if key not in _store:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        _store[key] = (store, rank, world)
    store, rank, world = _store[key]
    store.set_timeout(timeout)
    _made[0] += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"zeroshard/{restart}/{_made[0]}/", store), rank, world


def _destroy_at_exit() -> None:
    """The groups zeroshard created (the default group, or its own groups on a user's default
    group, as under accelerate on CPU) are destroyed before interpreter shutdown even when
    the script never called `engine.close()`; a user's default group stays theirs."""
    for group in _own_groups:
        group.destroy()
    _own_groups.clear()
    if _created and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _created.clear()
    _store.clear()  # after the groups: the rendezvous store (rank 0: its server) closes last
    gc.collect()  # a group's gloo threads stop when the group object is freed


def world_size_hint() -> int:
    """World size before any group exists: the live group's, else the launcher's, else 1
    (a launcher's world zeroshard could not join raises CommError here, before any other work)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return discover(find_master=False).world_size


def _device_for(local_rank: int, backend: str) -> torch.device:
    if backend == "nccl" or (backend == "none" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def setup_topology(timeout_s: float, default_port: int = DEFAULT_PORT, launchers: bool = True) -> Topology:
    """The topology on the live default group, else on one made from the launcher's world
    (`join_launcher`: `default_port` for MPI on one host, `launchers=False` for torchrun's
    variables only), else a single process."""
    owns = False
    if not dist.is_initialized():
        world = join_launcher(default_port, launchers)
        if world.world_size == 1:
            if world.note:
                log.warning("zeroshard: %s", world.line())
            return Topology(0, 1, 0, 1, _device_for(world.local_rank, "none"), "none", False)
        log.info("zeroshard: %s", world.line())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = _device_for(local_rank, backend)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        _import_lazy_torch_modules()
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = _group_store(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        atexit.unregister(_destroy_at_exit)  # once, however many groups a process makes in turn
        atexit.register(_destroy_at_exit)
        _created[:] = [True]
        owns = True
    backend = dist.get_backend()
    device = _device_for(local_rank, "nccl" if "nccl" in str(backend) else "gloo")
    group = None
    if not owns:  # a collective: every rank of the user's group makes it at the same point
        group = GroupRef(dist.new_group(timeout=datetime.timedelta(seconds=timeout_s)))
        _own_groups.append(group)
        atexit.unregister(_destroy_at_exit)
        atexit.register(_destroy_at_exit)
    return Topology(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                    local_world_size=min(local_world, dist.get_world_size()), device=device, backend=str(backend),
                    owns_group=owns, group=group)
