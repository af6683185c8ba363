"""`deepspeed.comm` for scripts: rank, world size, barrier, and `init_distributed`.

The process group is zeroshard's (`setup_topology`: the existing default group, else one
made from the launcher's environment, torchrun's, mpirun's or srun's (comm/launchers.py),
gloo on CPU and NCCL on CUDA, else a single process).
The barrier is a 1-element all-reduce through zeroshard's `Comm`, so it has a timeout
and names itself if a rank never arrives.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys

import torch
import torch.distributed as dist

from zeroshard.comm import Comm, CommLedger, join_launcher, setup_topology
from zeroshard.policies import ConfigError, RuntimePolicy

__all__ = ["barrier", "get_local_rank", "get_rank", "get_world_size", "init_distributed", "is_initialized"]

log = logging.getLogger("zeroshard")
_DEFAULT_TIMEOUT_S = RuntimePolicy().comm_timeout_s


def _timeout_s(timeout) -> float:
    """None (the default), a timedelta or a number of seconds, as seconds."""
    if timeout is None:
        return _DEFAULT_TIMEOUT_S
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config=None, rank: int = -1, world_size: int = -1) -> None:
    """Join the process group the launcher describes (or run as one process without one).

    As DeepSpeed's: without torchrun's variables and with `auto_mpi_discovery`, the world
    comes from mpirun's (OpenMPI, MPICH, Intel MPI) or srun's variables, and an MPI world on
    one host meets at 127.0.0.1:`distributed_port` (across hosts: MASTER_ADDR, or rank 0's
    address through mpi4py). With `auto_mpi_discovery=False` only torchrun's variables count,
    and processes an MPI or Slurm launcher started without them are an error, not separate
    jobs. zeroshard chooses the backend (NCCL on CUDA, gloo on CPU); a different
    `dist_backend` is noted, not obeyed. `init_method`, `rank` and `world_size` are not taken."""
    if init_method is not None or rank >= 0 or world_size >= 0:
        raise ConfigError("init_distributed(init_method=/rank=/world_size=) is not supported by zeroshard: "
                          "launch with `zeroshard launch` or torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR "
                          "and MASTER_PORT for every rank")
    if dist_init_required is False:
        return
    made = not is_initialized()
    topo = setup_topology(_timeout_s(timeout), default_port=distributed_port, launchers=auto_mpi_discovery)
    if made and verbose and topo.distributed and topo.rank == 0 and not (log.hasHandlers()
                                                                        and log.isEnabledFor(logging.INFO)):
        print(f"zeroshard: {join_launcher(distributed_port, auto_mpi_discovery).line()}", file=sys.stderr)
    if dist_backend and topo.distributed and dist_backend != topo.backend:
        log.info("init_distributed: backend %r asked for, zeroshard uses %r on this machine", dist_backend,
                 topo.backend)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None) -> None:
    """Wait until every rank arrives (a no-op on one process). Only the default group."""
    if group is not None:
        raise ConfigError("comm.barrier(group=...) is not supported by zeroshard: only the default group")
    if not is_initialized():
        return
    topo = setup_topology(_DEFAULT_TIMEOUT_S)  # the live group: nothing is created here
    comm = Comm(topo, CommLedger(topo.world_size), _DEFAULT_TIMEOUT_S)
    comm.all_reduce(torch.zeros(1, device=topo.device), what="deepspeed.comm.barrier()").wait()
