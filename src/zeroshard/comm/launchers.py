"""Which launcher started this process, and the world it describes: one place, in this order.

1. torchrun (and anything that sets its variables: `zeroshard launch`, DeepSpeed's launcher):
   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
2. OpenMPI's mpirun: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE.
3. MPICH, Intel MPI, Cray PALS (PMI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID / MPI_LOCALNRANKS or
   PALS_LOCAL_RANKID; PMIx's PMIX_RANK when a size is known (PMI_SIZE).
4. A Slurm step (srun): SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS, SLURM_LOCALID,
   SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID, SLURM_STEP_NODELIST or SLURM_JOB_NODELIST. The batch
   script itself (no srun step variables) is one process, not a world.

The rendezvous address, when the launcher gives none:
- MASTER_ADDR / MASTER_PORT from the environment always win (mpirun -x, srun --export).
- Slurm: the first host of the step's node list (expanded as `scontrol show hostnames` does),
  port 15000 + SLURM_JOB_ID % 10000, so two jobs sharing a node do not collide.
- MPI with every rank on one host (local size = world size): 127.0.0.1, port 29500 (or the
  `default_port` given, DeepSpeed's `distributed_port`).
- MPI across hosts: rank 0's address broadcast by mpi4py when it is installed (as DeepSpeed's
  `mpi_discovery` does); else there is no way to join, and that is an error, never a world of 1.

`discover()` reads an environment and returns the `World`; `join_launcher()` exports it as
torchrun's variables (once per process) so torch.distributed's env:// rendezvous and everything
reading LOCAL_RANK follow it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

from zeroshard.comm.hostlist import expand_hostlist, expand_tasks_per_node
from zeroshard.policies import CommError

__all__ = ["DEFAULT_PORT", "World", "discover", "join_launcher", "joined_world"]

DEFAULT_PORT = 29500  # torchrun's and DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
SLURM_PORT_BASE = 15000
_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FIX = ("launch with one launcher that starts every rank: torchrun / `zeroshard launch`, "
       "`mpirun -n N` or `srun`; see docs/clusters.md")


@dataclass(frozen=True)
class World:
    """The world a launcher describes. `source` names the launcher ('torchrun', 'OpenMPI',
    'MPICH/Intel MPI (PMI)', 'Slurm', or 'single process'); `master_how` says where the
    rendezvous address came from; `node` is this rank's node index when the launcher says."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    master_how: str = ""
    node: int | None = None
    note: str = ""

    def line(self) -> str:
        """The start-up line: `world 8 from Slurm, master node12:15042 (first node of ...)`."""
        if self.world_size == 1 and self.master_addr is None:
            text = f"world 1 ({self.source})"
        else:
            text = f"world {self.world_size} from {self.source}, master {self.master_addr}:{self.master_port}"
            text += f" ({self.master_how})" if self.master_how else ""
        return text + (f"; {self.note}" if self.note else "")


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise CommError(f"{name}={value!r} is not an integer; {FIX}") from None


def _first(env: Mapping[str, str], *names: str) -> tuple[int | None, str | None]:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value, name
    return None, None


def _check(source: str, rank: int, size: int, local_rank: int, local_size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise CommError(f"{source} says rank {rank} of a world of {size}, which cannot be; {FIX}")
    if local_size < 1 or not 0 <= local_rank < local_size:
        raise CommError(f"{source} says local rank {local_rank} of {local_size} on this node in a world of "
                        f"{size}, which cannot be; {FIX}")


def _master(env: Mapping[str, str], default_port: int) -> tuple[str | None, int, str]:
    port = _int(env, "MASTER_PORT")
    return env.get("MASTER_ADDR") or None, default_port if port is None else port, "MASTER_ADDR"


def _torchrun(env: Mapping[str, str]) -> World:
    rank, size = _int(env, "RANK") or 0, _int(env, "WORLD_SIZE") or 1
    local_rank = _int(env, "LOCAL_RANK") or 0
    local_size = min(_int(env, "LOCAL_WORLD_SIZE") or size, size)  # as setup_topology always took it
    missing = [v for v in _TORCHRUN if v not in env]
    if size > 1 and missing:
        raise CommError(f"WORLD_SIZE={size} but {', '.join(missing)} not set: launch with `torchrun` (or "
                        "`zeroshard launch`), which sets all of them.")
    if size == 1:
        return World("single process" if missing else "torchrun", 0, 1, local_rank, 1)
    if not 0 <= rank < size:  # LOCAL_RANK is left as it was: a device index some setups choose themselves
        raise CommError(f"RANK={rank} but WORLD_SIZE={size}: a rank is 0..WORLD_SIZE-1; {FIX}")
    return World("torchrun", rank, size, local_rank, local_size, env["MASTER_ADDR"], _int(env, "MASTER_PORT"),
                 "", _int(env, "GROUP_RANK"))


def _mpi_master(env: Mapping[str, str], source: str, size: int, local_size: int | None,
                default_port: int) -> tuple[str, int, str]:
    addr, port, how = _master(env, default_port)
    if addr:
        return addr, port, how
    if local_size == size:
        return "127.0.0.1", port, f"every rank on this host; {'MASTER_PORT' if 'MASTER_PORT' in env else 'default port'}"
    shared = _mpi4py_master()
    if shared:
        return shared, port, "rank 0's address, broadcast by mpi4py"
    spread = "across hosts" if local_size else "with no local size to tell whether it spans hosts"
    raise CommError(f"{source} started a world of {size} {spread}, and nothing says where rank 0 listens: "
                    f"export MASTER_ADDR (rank 0's host) and MASTER_PORT to every rank (`mpirun -x MASTER_ADDR=HOST "
                    "-x MASTER_PORT=29500`), or install mpi4py, or use `zeroshard launch --launcher openmpi|mpich "
                    "--hostfile FILE`, which sets them. Refusing to train as separate world-size-1 jobs")


def _mpi4py_master() -> str | None:
    """Rank 0's address on every rank, through MPI (DeepSpeed's mpi_discovery), or None without mpi4py."""
    try:
        from mpi4py import MPI  # noqa: PLC0415  (optional: only MPI users have it)
    except (ImportError, RuntimeError, OSError):  # absent, or installed without an MPI library to load
        return None
    comm = MPI.COMM_WORLD
    addr = _own_address() if comm.Get_rank() == 0 else None
    return comm.bcast(addr, root=0)


def _own_address() -> str:
    """This host's address as other hosts reach it: the source address of a route outward
    (no packet is sent), else what the host name resolves to."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _mpi(env: Mapping[str, str], default_port: int, find_master: bool = True) -> World | None:
    """OpenMPI's or PMI's world, or None. `find_master=False`: the world only (master_addr None)."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        source = "OpenMPI"
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank, local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        node = _int(env, "OMPI_COMM_WORLD_NODE_RANK")
    elif "PMI_SIZE" in env and ("PMI_RANK" in env or "PMIX_RANK" in env):
        source = "MPICH/Intel MPI (PMI)"
        rank, _ = _first(env, "PMI_RANK", "PMIX_RANK")
        size = _int(env, "PMI_SIZE")
        local_rank, _ = _first(env, "MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "LOCAL_RANK")
        local_size, _ = _first(env, "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")
        node = None
    else:
        return None
    if rank is None or size is None:
        raise CommError(f"{source}'s variables give no rank or no world size; {FIX}")
    if size == 1:
        return World(source, 0, 1, 0, 1)
    addr, port, how = None, None, ""
    if find_master:
        addr, port, how = _mpi_master(env, source, size, local_size, default_port)
    if local_size is None:  # ranks per node unknown: one per node is the safe reading for node groups
        local_rank, local_size = 0, 1
    local_rank = 0 if local_rank is None else local_rank
    _check(source, rank, size, local_rank, local_size)
    return World(source, rank, size, local_rank, local_size, addr, port, how, node)


def _slurm(env: Mapping[str, str]) -> World | None:
    step = any(v in env for v in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"))
    if "SLURM_PROCID" not in env or not step:
        return None
    rank = _int(env, "SLURM_PROCID")
    size, _ = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if rank is None or size is None:
        raise CommError(f"SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is; {FIX}")
    if size == 1:
        return World("Slurm", 0, 1, 0, 1)
    list_name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    hosts = expand_hostlist(env[list_name], list_name) if list_name in env else []
    node = _int(env, "SLURM_NODEID")
    local_rank = _int(env, "SLURM_LOCALID") or 0
    per_node_name = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else "SLURM_TASKS_PER_NODE"
    if per_node_name in env and node is not None:
        counts = expand_tasks_per_node(env[per_node_name], per_node_name)
        if node >= len(counts):
            raise CommError(f"SLURM_NODEID={node} but {per_node_name}={env[per_node_name]!r} lists {len(counts)} "
                            f"node(s); {FIX}")
        local_size = counts[node]
    else:
        nodes = _int(env, "SLURM_STEP_NUM_NODES") or len(hosts) or 1
        local_size = size // nodes if size % nodes == 0 else size
    addr, port, how = _master(env, SLURM_PORT_BASE + (_int(env, "SLURM_JOB_ID") or 0) % 10000)
    port_how = "MASTER_PORT" if "MASTER_PORT" in env else "port 15000 + SLURM_JOB_ID % 10000"
    if addr:
        how = f"MASTER_ADDR; {port_how}"
    elif hosts:
        addr, how = hosts[0], f"first node of {list_name}; {port_how}"
    else:
        raise CommError(f"Slurm step of {size} tasks but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST nor "
                        f"MASTER_ADDR is set: nothing says where rank 0 listens; export MASTER_ADDR. {FIX}")
    _check("Slurm", rank, size, local_rank, local_size)
    return World("Slurm", rank, size, local_rank, local_size, addr, port, how, node)


def _outer(env: Mapping[str, str], default_port: int) -> World | None:
    """What MPI or Slurm says, ignoring torchrun's variables (None: neither started this process)."""
    return _mpi(env, default_port, find_master=False) or _slurm(env)


def discover(env: Mapping[str, str] | None = None, default_port: int = DEFAULT_PORT, find_master: bool = True,
             launchers: bool = True) -> World:
    """The world `env` (default: os.environ) describes. `launchers=False`: torchrun's variables
    only, but still an error when an MPI or Slurm launcher started several processes (DeepSpeed's
    `auto_mpi_discovery=False`). `find_master=False`: rank and sizes only (an MPI world's master,
    which may need mpi4py, is left None). Raises CommError where the processes cannot form one world."""
    env = os.environ if env is None else env
    if "RANK" in env:
        world = _torchrun(env)
        if world.world_size == 1:
            outer = _quiet_outer(env, default_port)
            if outer is not None and outer.world_size > 1:
                raise CommError(f"{outer.source} started {outer.world_size} processes, but torchrun's variables "
                                f"here say WORLD_SIZE=1: each would train alone as a separate job. Unset RANK/"
                                f"WORLD_SIZE so zeroshard joins {outer.source}'s world, or {FIX}")
        return world
    outer = None
    if launchers:
        outer = _mpi(env, default_port, find_master) or _slurm(env)
    else:
        found = _quiet_outer(env, default_port)
        if found is not None and found.world_size > 1:
            raise CommError(f"auto_mpi_discovery=False, but {found.source} started {found.world_size} processes "
                            "and torchrun's variables are not set: each would train alone. Pass "
                            f"auto_mpi_discovery=True, or {FIX}")
    if outer is not None:
        size = _int(env, "WORLD_SIZE")
        if size is not None and size != outer.world_size:
            raise CommError(f"WORLD_SIZE={size} but {outer.source} says a world of {outer.world_size}; {FIX}")
        return outer
    if launchers and "PMIX_RANK" in env:  # a PMIx launcher, but no size: cannot tell the world from one
        raise CommError(f"PMIX_RANK={env['PMIX_RANK']} is set but no world size (PMI_SIZE, or an srun step's "
                        f"SLURM_NTASKS): zeroshard cannot tell which world to join; {FIX}")
    world = _torchrun(env)  # WORLD_SIZE alone (> 1) is an error; else a single process
    if "SLURM_NTASKS" in env and (_int(env, "SLURM_NTASKS") or 1) > 1 and "SLURM_PROCID" in env:
        return World(world.source, 0, 1, 0, 1, note=f"a Slurm batch script with SLURM_NTASKS={env['SLURM_NTASKS']}"
                     ", not an srun step: start the ranks with `srun python ...` to train on all of them")
    return world


def _quiet_outer(env: Mapping[str, str], default_port: int) -> World | None:
    """MPI's or Slurm's world for a consistency check, or None; a launcher whose own variables
    cannot be read is no reason to refuse torchrun's."""
    try:
        return _outer(env, default_port)
    except CommError:
        return None


_joined: list[tuple[World, dict, bool]] = []  # the world found, the variables as it left them, `launchers`
_READ_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "PMIX_RANK", "MPI_LOCAL", "PALS_", "SLURM_")
_READ = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "GROUP_RANK")


def _snapshot() -> dict[str, str]:
    """The variables `discover` reads, as they are now."""
    return {k: v for k, v in os.environ.items() if k in _READ or k.startswith(_READ_PREFIXES)}


def _resolve(host: str, how: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise CommError(f"the rendezvous host {host} ({how}) does not resolve on this node ({exc}): export "
                        "MASTER_ADDR with an address of rank 0's node that every node can reach") from None


def join_launcher(default_port: int = DEFAULT_PORT, launchers: bool = True) -> World:
    """Discover the world and export it as torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and GROUP_RANK where the launcher names the node.
    A host name zeroshard chose (Slurm's first node) is resolved here, so a name that does not
    resolve is one clear error, not a rendezvous timeout. Called again while those variables are
    still what it exported, it returns the same world (its launcher, not 'torchrun')."""
    if _joined:
        world, seen, how = _joined[-1]
        if how == launchers and seen == _snapshot():
            return world
        _joined.clear()
    world = discover(os.environ, default_port, launchers=launchers)
    if world.source not in ("torchrun", "single process") and world.world_size > 1:
        addr = world.master_addr or "127.0.0.1"
        if "MASTER_ADDR" not in os.environ and world.source == "Slurm":
            addr = _resolve(addr, world.master_how)
        os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.world_size), LOCAL_RANK=str(world.local_rank),
                          LOCAL_WORLD_SIZE=str(world.local_world_size), MASTER_ADDR=addr,
                          MASTER_PORT=str(world.master_port))
        if world.node is not None:
            os.environ["GROUP_RANK"] = str(world.node)
    _joined.append((world, _snapshot(), launchers))
    return world


def joined_world() -> World | None:
    """The world `join_launcher` last found in this process, or None before it ran."""
    return _joined[-1][0] if _joined else None
