"""Real processes started the way mpirun and srun start them: the launcher's variables only,
none of torchrun's. They must form one world (comm/launchers.py), or, when they cannot, each
stop with one line and exit 2: never train as separate world-size-1 jobs.

- OpenMPI's variables, 2 processes on this host: one world of 2 whose losses equal those of
  the same script started with torchrun's variables.
- Slurm's variables of a 2-node, 4-task srun step (SLURM_STEP_NODELIST=node[03-04], the node
  names mapped to 127.0.0.1 in the script): one world of 4, through the drop-in's
  deepspeed.init_distributed(); rank 0 prints the start-up line naming node03.
- OpenMPI's variables saying 2 hosts and no MASTER_ADDR: one line, exit 2, on both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from zeroshard.bench.ranks import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "launcher_scripts", "tiny_train.py")
TIMEOUT_S = 180
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "PALS_")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN and not k.startswith(_LAUNCHER_PREFIXES)}
    src = os.path.join(ROOT, "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def start(per_rank: list[dict[str, str]], argv: list[str]) -> list[subprocess.CompletedProcess]:
    """One process per environment, all at once; every process group killed on timeout."""
    procs = [subprocess.Popen(argv, env={**_clean_env(), **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True, cwd=ROOT) for extra in per_rank]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return results


def _report(results) -> dict:
    for r in results:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(results[0].stdout.strip().splitlines()[-1])


def _openmpi(rank: int, size: int, local_size: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
            "OMPI_COMM_WORLD_NODE_RANK": str(rank // local_size)}


def test_openmpi_variables_form_one_world_that_trains_as_torchrun_does():
    port = free_port()
    mpi = start([{**_openmpi(r, 2, 2), "MASTER_PORT": str(port)} for r in range(2)], [sys.executable, SCRIPT])
    got = _report(mpi)
    assert got["world"] == 2 and got["ranks"] == [[0, 0], [1, 1]]
    assert f"zeroshard: world 2 from OpenMPI, master 127.0.0.1:{port} (every rank on this host" in mpi[0].stderr
    port = free_port()
    torchrun = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(2)]
    want = _report(start(torchrun, [sys.executable, SCRIPT]))
    assert got["losses"] == want["losses"], (got, want)  # the same world, bit for bit
    assert want["losses"][-1] < want["losses"][0]


def test_a_slurm_step_of_two_nodes_forms_one_world_of_four():
    port = free_port()
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[03-04]", "SLURM_JOB_NODELIST": "node[03-04]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_PORT": str(port), "ZS_TEST_HOSTS": "node03,node04"}
    ranks = [{**step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2), "SLURM_NODEID": str(r // 2)}
             for r in range(4)]
    results = start(ranks, [sys.executable, SCRIPT, "--deepspeed"])
    got = _report(results)
    assert got["world"] == 4 and got["ranks"] == [[0, 0], [1, 1], [2, 0], [3, 1]]
    assert (f"zeroshard: world 4 from Slurm, master node03:{port} (first node of SLURM_STEP_NODELIST; "
            "MASTER_PORT)") in results[0].stderr
    assert all("world 4 from Slurm" not in r.stderr for r in results[1:])  # rank 0 says it, once


def test_openmpi_ranks_that_cannot_join_each_stop_with_one_line():
    results = start([_openmpi(r, 2, 1) for r in range(2)],
                    [sys.executable, "-m", "zeroshard.cli.rank_main", SCRIPT])
    for rank, r in enumerate(results):
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert "OpenMPI started a world of 2 across hosts" in lines[0] and "MASTER_ADDR" in lines[0]
        assert lines[0].startswith("zeroshard launch" + ("" if rank == 0 else f" (rank {rank})") + ": ")
        assert "losses" not in r.stdout  # nothing trained
