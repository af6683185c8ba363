"""comm/launchers.py and comm/hostlist.py without processes: which launcher started this
process, the world it describes, the rendezvous address chosen, and the errors that stand in
for a silent world of 1. (Real processes: test_launchers_real.py.)"""

from __future__ import annotations

import os
import socket
import sys
import types

import pytest

from zeroshard.comm.hostlist import expand_hostlist, expand_tasks_per_node
from zeroshard.comm.launchers import World, discover, join_launcher
from zeroshard.policies import CommError, ConfigError


@pytest.mark.parametrize("text, hosts", [
    ("node12", ["node12"]),
    ("node[03-04]", ["node03", "node04"]),
    ("node[03-04,07]", ["node03", "node04", "node07"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),  # zero padding kept across a digit
    ("n[8-10]", ["n8", "n9", "n10"]),  # no padding
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("node[03-04,07],gpu-a[1-2]", ["node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("a1,b[2],c", ["a1", "b2", "c"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),  # a product, left slowest
    ("x[1-2]y", ["x1y", "x2y"]),
    ("node[1,3-4,10]", ["node1", "node3", "node4", "node10"]),
    (" node[1-2] ", ["node1", "node2"]),
])
def test_nodelists_expand_as_scontrol_show_hostnames(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, words", [
    ("node[1-2", "'[' without ']'"),
    ("node1-2]", "']' without '['"),
    ("node[a-b]", "not a number"),
    ("node[4-2]", "runs backwards"),
    ("node[[1-2]]", "nested"),
    ("", "names no host"),
    ("node[1-99999999]", "more than"),
])
def test_bad_nodelists_are_one_clear_error(text, words):
    with pytest.raises(ConfigError, match="SLURM_STEP_NODELIST") as err:
        expand_hostlist(text, "SLURM_STEP_NODELIST")
    assert words in str(err.value)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="N\\(xM\\)"):
        expand_tasks_per_node("2x3")


def _ompi(rank, size, local_size, **extra):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
            **extra}


def _slurm(rank, **extra):
    return {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "8",
            "SLURM_LOCALID": str(rank % 4), "SLURM_NODEID": str(rank // 4), "SLURM_STEP_NODELIST": "node[12-13]",
            "SLURM_JOB_NODELIST": "node[11-13]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", **extra}


def test_each_launcher_is_read():
    assert discover({}) == World("single process", 0, 1, 0, 1)
    run = discover({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (run.source, run.rank, run.world_size, run.local_rank, run.local_world_size) == ("torchrun", 3, 4, 1, 2)
    assert run.line() == "world 4 from torchrun, master head:29400"

    mpi = discover(_ompi(5, 8, 4, MASTER_ADDR="10.0.0.1", MASTER_PORT="29600"))
    assert (mpi.source, mpi.rank, mpi.world_size, mpi.local_rank, mpi.local_world_size) == ("OpenMPI", 5, 8, 1, 4)
    assert mpi.line() == "world 8 from OpenMPI, master 10.0.0.1:29600 (MASTER_ADDR)"
    one_host = discover(_ompi(1, 2, 2))
    assert (one_host.master_addr, one_host.master_port) == ("127.0.0.1", 29500)
    assert one_host.line() == "world 2 from OpenMPI, master 127.0.0.1:29500 (every rank on this host; default port)"
    assert discover(_ompi(1, 2, 2), default_port=12345).master_port == 12345  # init_distributed(distributed_port=)

    pmi = discover({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
                    "MASTER_ADDR": "n1", "MASTER_PORT": "1"})
    assert (pmi.source, pmi.rank, pmi.world_size, pmi.local_rank, pmi.local_world_size) == (
        "MPICH/Intel MPI (PMI)", 2, 4, 0, 2)
    pals = discover({"PMI_RANK": "3", "PMI_SIZE": "4", "PALS_LOCAL_RANKID": "3", "LOCAL_SIZE": "4"})
    assert (pals.local_rank, pals.local_world_size, pals.master_addr) == (3, 4, "127.0.0.1")
    pmix = discover({"PMIX_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (pmix.rank, pmix.world_size) == (1, 2)
    # DeepSpeed's MPICH runner: -genv WORLD_SIZE/LOCAL_SIZE/MASTER_ADDR/MASTER_PORT, PMI_RANK per rank, no RANK
    ds_mpich = discover({"PMI_RANK": "1", "PMI_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_SIZE": "1",
                         "MASTER_ADDR": "w0", "MASTER_PORT": "29500"})
    assert (ds_mpich.rank, ds_mpich.world_size, ds_mpich.local_world_size, ds_mpich.master_addr) == (1, 2, 1, "w0")

    slurm = discover(_slurm(6))
    assert (slurm.source, slurm.rank, slurm.world_size, slurm.local_rank, slurm.local_world_size, slurm.node) == (
        "Slurm", 6, 8, 2, 4, 1)
    assert (slurm.master_addr, slurm.master_port) == ("node12", 15000 + 123456 % 10000)  # the step's first node
    assert slurm.line() == ("world 8 from Slurm, master node12:18456 (first node of SLURM_STEP_NODELIST; "
                            "port 15000 + SLURM_JOB_ID % 10000)")
    uneven = discover(_slurm(4, SLURM_NTASKS="5", SLURM_STEP_TASKS_PER_NODE="4,1", SLURM_LOCALID="0"))
    assert (uneven.world_size, uneven.local_world_size) == (5, 1)
    job_list = {k: v for k, v in _slurm(0).items() if k != "SLURM_STEP_NODELIST"}
    assert discover(job_list).master_addr == "node11"  # no step list: the job's first node
    assert discover(_slurm(0, MASTER_ADDR="10.1.1.1")).master_addr == "10.1.1.1"


def test_launchers_are_read_in_order():
    torchrun_in_srun = {**_slurm(1, SLURM_NTASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_LOCALID="0",
                                 SLURM_NODEID="1"),
                        "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                        "MASTER_ADDR": "node12", "MASTER_PORT": "29500"}
    assert discover(torchrun_in_srun).source == "torchrun"  # `srun torchrun --nproc-per-node 8`: torchrun's world
    mpirun_in_sbatch = {**_ompi(1, 2, 2), "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert discover(mpirun_in_sbatch).source == "OpenMPI"
    assert discover({**_ompi(1, 2, 2), "PMI_RANK": "0", "PMI_SIZE": "2"}).source == "OpenMPI"
    pmix_under_srun = {**_slurm(3), "PMIX_RANK": "3"}  # PMIx without a size: Slurm's step says it
    assert discover(pmix_under_srun).source == "Slurm"


@pytest.mark.parametrize("env, words", [
    (_ompi(1, 2, 1), "OpenMPI started a world of 2 across hosts"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "no local size to tell whether it spans hosts"),
    ({**_ompi(0, 2, 2), "WORLD_SIZE": "3"}, "WORLD_SIZE=3 but OpenMPI says a world of 2"),
    ({"RANK": "0", "WORLD_SIZE": "1", **_ompi(0, 2, 2)}, "OpenMPI started 2 processes, but torchrun's variables"),
    ({"RANK": "0", "WORLD_SIZE": "1", **_slurm(0)}, "Slurm started 8 processes"),
    ({"RANK": "0", "WORLD_SIZE": "1", **_ompi(0, 2, 1)}, "OpenMPI started 2 processes"),
    ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT not set"),
    (_ompi(2, 2, 2), "rank 2 of a world of 2"),
    ({"OMPI_COMM_WORLD_SIZE": "x", "OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE='x' is not an integer"),
    ({k: v for k, v in _slurm(1).items() if "NODELIST" not in k}, "nothing says where rank 0 listens"),
    (_slurm(1, SLURM_NODEID="5"), "SLURM_NODEID=5"),
    ({"PMIX_RANK": "0"}, "PMIX_RANK=0 is set but no world size"),
])
def test_worlds_that_cannot_be_joined_are_errors(env, words):
    with pytest.raises(CommError) as err:
        discover(env)
    assert words in str(err.value)


def test_auto_mpi_discovery_off_reads_torchrun_only_but_never_splits_a_job():
    assert discover(_ompi(0, 1, 1), launchers=False).world_size == 1
    with pytest.raises(CommError, match="auto_mpi_discovery=False, but OpenMPI started 2 processes"):
        discover(_ompi(1, 2, 2), launchers=False)
    assert discover({**_ompi(1, 2, 2), "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
                    launchers=False).source == "torchrun"


def test_a_slurm_batch_script_is_one_process_and_says_so():
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}
    world = discover(batch)
    assert world.world_size == 1 and "not an srun step" in world.line()
    assert discover({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).note == ""


def test_mpi4py_shares_rank_0s_address(monkeypatch):
    """DeepSpeed's mpi_discovery: rank 0's address broadcast over MPI.COMM_WORLD."""
    sent = []

    class Comm:
        def Get_rank(self):
            return 1

        def bcast(self, value, root):
            sent.append((value, root))
            return "10.9.8.7"

    fake = types.ModuleType("mpi4py")
    fake.MPI = types.SimpleNamespace(COMM_WORLD=Comm())
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    world = discover(_ompi(1, 2, 1))
    assert (world.master_addr, world.master_how) == ("10.9.8.7", "rank 0's address, broadcast by mpi4py")
    assert sent == [(None, 0)]  # rank 1 sends nothing, receives rank 0's
    monkeypatch.setattr(Comm, "Get_rank", lambda self: 0)
    discover(_ompi(0, 2, 1))
    own = sent[-1][0]  # rank 0 sends its own address: one this host has
    assert own and socket.getaddrinfo(own, None)[0][4][0] == own


@pytest.fixture
def environ():
    """os.environ as it was, afterwards: join_launcher writes to it."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_join_exports_torchruns_variables(environ, monkeypatch):  # environ restored last
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _slurm(5, SLURM_STEP_NODELIST="localhost,node99").items():
        monkeypatch.setenv(name, value)
    world = join_launcher()
    assert world.source == "Slurm" and world.master_addr == "localhost"
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                        "MASTER_PORT", "GROUP_RANK")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "18456", "GROUP_RANK": "1"}  # the first node's name, resolved here
    assert join_launcher() is world  # once exported, still Slurm's world (not taken for torchrun's)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "no-such-node-zs[1-2]")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name)
    with pytest.raises(CommError, match="no-such-node-zs1 .*does not resolve.*MASTER_ADDR"):
        join_launcher()
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    assert join_launcher().source == "single process"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # a new launcher's variables: found again, not cached
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert join_launcher().source == "OpenMPI"


def test_the_environment_is_left_as_it_was():
    """After test_join_exports_torchruns_variables: nothing of its worlds stayed in os.environ."""
    assert not {"RANK", "GROUP_RANK", "OMPI_COMM_WORLD_SIZE"} & set(os.environ)
