"""`zeroshard launch --hostfile/--launcher` without processes: DeepSpeed's hostfile and
--include/--exclude/--num_nodes/--num_gpus (cli/hostfile.py), and the exact command line each
launcher gets (cli/multinode.py). The fan-out itself runs in test_launchers_real.py."""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict

import pytest

from zeroshard.cli import multinode
from zeroshard.cli.hostfile import HostfileError, active_resources, parse_hostfile
from zeroshard.cli.main import main

HOSTS = "# two nodes\nworker-0 slots=4\n\nworker-1 slots=4   # the second\n"
PY = sys.executable


def test_hostfile_is_read_as_deepspeed_reads_it():
    assert parse_hostfile(HOSTS) == OrderedDict([("worker-0", 4), ("worker-1", 4)])


@pytest.mark.parametrize("text, words", [
    ("worker-0 slots=4\nworker-0 slots=2", "listed twice"),
    ("worker-0 4", "is not `HOST slots=N`"),
    ("worker-0 slots=0", "at least one slot"),
    ("# nothing\n", "lists no host"),
])
def test_bad_hostfiles_say_which_line(text, words):
    with pytest.raises(HostfileError, match="hosts") as err:
        parse_hostfile(text, "hosts")
    assert words in str(err.value)


@pytest.mark.parametrize("kw, want", [
    ({}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ({"include": "worker-0@worker-1:0,2"}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
    ({"include": "worker-1:3"}, {"worker-1": [3]}),
    ({"exclude": "worker-1:0"}, {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}),
    ({"exclude": "worker-0"}, {"worker-1": [0, 1, 2, 3]}),
    ({"num_nodes": 1}, {"worker-0": [0, 1, 2, 3]}),
    ({"num_gpus": 2}, {"worker-0": [0, 1], "worker-1": [0, 1]}),
    ({"num_nodes": 1, "num_gpus": 1}, {"worker-0": [0]}),
])
def test_include_exclude_num_nodes_num_gpus(kw, want):
    assert active_resources(parse_hostfile(HOSTS), **kw) == OrderedDict(want)


@pytest.mark.parametrize("kw, words", [
    ({"include": "worker-2"}, "worker-2 is not in the hostfile"),
    ({"include": "worker-0:7"}, "no slot 7"),
    ({"include": "worker-0", "exclude": "worker-1"}, "cannot be used together"),
    ({"include": "worker-0", "num_gpus": 1}, "cannot be combined"),
    ({"exclude": "worker-0@worker-1"}, "leaves no slot"),
    ({"num_nodes": 3}, "lists 2 host(s)"),
    ({"num_gpus": 8}, "slots=4"),
    ({"include": "worker-0:x"}, "must be integers"),
])
def test_bad_filters_are_one_line(kw, words):
    with pytest.raises(HostfileError) as err:
        active_resources(parse_hostfile(HOSTS), **kw)
    assert words in str(err.value)


def _args(**kw):
    base = dict(script="train.py", script_args=["--lr", "1"], module=False, master_addr="worker-0", master_port=29500,
                launcher_args="", ssh_port=None, real_deepspeed=False, num_nodes=None, num_gpus=None)
    return argparse.Namespace(**{**base, **kw})


ACTIVE = OrderedDict([("worker-0", [0, 1]), ("worker-1", [0, 1])])
EXPORTS = OrderedDict([("NCCL_DEBUG", "WARN"), ("PATH", "/venv/bin:/bin"), ("PYTHONPATH", "/job:/x y"),
                       ("OMP_NUM_THREADS", "1")])
RANK = [PY, "-u", "-m", "zeroshard.cli.rank_main", "train.py", "--lr", "1"]


def _node(rank):
    return (f"cd /job && env NCCL_DEBUG=WARN PATH=/venv/bin:/bin 'PYTHONPATH=/job:/x y' OMP_NUM_THREADS=1 {PY} -u -m "
            f"zeroshard.cli.main launch --nproc 2 --nnodes 2 --node-rank {rank} --master-addr worker-0 "
            "--master-port 29500 train.py --lr 1")


def test_the_exact_command_lines(monkeypatch):
    monkeypatch.setattr(multinode.os, "geteuid", lambda: 1000)  # not root: no --allow-run-as-root
    monkeypatch.delenv("PDSH_SSH_ARGS_APPEND", raising=False)
    assert multinode.build("pdsh", ACTIVE, _args(launcher_args="-u 30"), EXPORTS, "/job") == (
        [["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-u", "30", _node("%n")]],
        {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-tt"})
    assert multinode.build("ssh", ACTIVE, _args(ssh_port=2222), EXPORTS, "/job") == (
        [["ssh", "-tt", "-p", "2222", "worker-0", _node(0)], ["ssh", "-tt", "-p", "2222", "worker-1", _node(1)]], {})
    assert multinode.build("openmpi", ACTIVE, _args(launcher_args="--mca btl tcp,self"), EXPORTS, "/job") == (
        [["mpirun", "-n", "4", "--host", "worker-0:2,worker-1:2", "-x", "NCCL_DEBUG=WARN", "-x", "PATH=/venv/bin:/bin",
          "-x", "PYTHONPATH=/job:/x y", "-x", "OMP_NUM_THREADS=1", "-x", "MASTER_ADDR=worker-0", "-x",
          "MASTER_PORT=29500", "--mca", "btl", "tcp,self", *RANK]], {})
    genv = ["-genv", "NCCL_DEBUG", "WARN", "-genv", "PATH", "/venv/bin:/bin", "-genv", "PYTHONPATH", "/job:/x y",
            "-genv", "OMP_NUM_THREADS", "1", "-genv", "MASTER_ADDR", "worker-0", "-genv", "MASTER_PORT", "29500",
            "-genv", "LOCAL_SIZE", "2"]
    for launcher in ("mpich", "impi"):
        assert multinode.build(launcher, ACTIVE, _args(), EXPORTS, "/job") == (
            [["mpirun", "-n", "4", "-ppn", "2", "-hosts", "worker-0,worker-1", *genv, *RANK]], {})
    assert multinode.build("slurm", ACTIVE, _args(master_addr=None), EXPORTS, "/job") == (
        [["srun", "-n", "4", "--nodes", "2", "--ntasks-per-node", "2", "--nodelist", "worker-0,worker-1",
          "--export=ALL", *RANK]], {**EXPORTS, "MASTER_PORT": "29500"})
    assert multinode.build("slurm", None, _args(master_addr=None, num_nodes=2, num_gpus=8, module=True), EXPORTS,
                           "/job")[0] == [["srun", "-n", "16", "--nodes", "2", "--ntasks-per-node", "8",
                                           "--export=ALL", PY, "-u", "-m", "zeroshard.cli.rank_main", "-m",
                                           "train.py", "--lr", "1"]]
    monkeypatch.setattr(multinode.os, "geteuid", lambda: 0)
    assert "--allow-run-as-root" in multinode.build("openmpi", ACTIVE, _args(), EXPORTS, "/job")[0][0]


def test_devices_of_a_host_reach_only_the_launchers_that_can_pick_them():
    picked = OrderedDict([("worker-0", [0, 2]), ("worker-1", [0, 1])])
    ssh = multinode.build("ssh", picked, _args(), EXPORTS, "/job")[0]
    assert "CUDA_VISIBLE_DEVICES=0,2 " in ssh[0][-1] and "CUDA_VISIBLE_DEVICES" not in ssh[1][-1]
    for launcher, words in (("openmpi", "cannot pick devices [0, 2] of worker-0"), ("pdsh", "same devices"),
                            ("mpich", "cannot pick devices")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            multinode.build(launcher, picked, _args(), EXPORTS, "/job")
    uneven = OrderedDict([("worker-0", [0, 1]), ("worker-1", [0])])
    with pytest.raises(ValueError, match=r"slots differ \(worker-0: 2, worker-1: 1\).*--launcher ssh"):
        multinode.build("pdsh", uneven, _args(), EXPORTS, "/job")
    assert len(multinode.build("ssh", uneven, _args(), EXPORTS, "/job")[0]) == 2


def test_forwarded_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ENV_FILE", "my_env")
    (tmp_path / "my_env").write_text("WANDB_MODE=offline\n# a comment\nEXTRA=a=b\n")
    env = {"PATH": "/bin", "NCCL_IB_HCA": "mlx5", "PYTHONPATH": "/old", "HOME": "/root", "SECRET_TOKEN": "x",
           "ZEROSHARD_CHANNEL": "/tmp/c", "VIRTUAL_ENV": "/venv"}
    got = multinode.forwarded_env(env, str(tmp_path), "/shadow:/old")
    assert got == OrderedDict([("NCCL_IB_HCA", "mlx5"), ("PATH", "/bin"), ("PYTHONPATH", f"{tmp_path}:/shadow:/old"),
                               ("VIRTUAL_ENV", "/venv"), ("OMP_NUM_THREADS", "1"), ("WANDB_MODE", "offline"),
                               ("EXTRA", "a=b")])


@pytest.mark.parametrize("argv, words", [
    (["--hostfile", "missing-hosts"], "No such file"),
    (["--launcher", "openmpi"], "needs --hostfile"),
    (["--hostfile", "HOSTS", "--launcher", "ssh", "--include", "nobody"], "nobody is not in the hostfile"),
    (["--hostfile", "HOSTS", "--launcher", "openmpi", "--include", "a:1"], "cannot pick devices"),
    (["--hostfile", "HOSTS", "--no_ssh", "--node_rank", "5"], "--node_rank 5 is not a host"),
])
def test_launch_refuses_in_one_line(capsys, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "HOSTS").write_text("a slots=2\nb slots=2\n")
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh, ssh, mpirun or srun here: refused before that matters
    assert main(["launch", *argv, "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroshard launch: ") and words in err and err.count("\n") == 1, err


def test_a_missing_tool_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "HOSTS").write_text("a slots=2\nb slots=2\n")
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["launch", "--hostfile", "HOSTS", "train.py"]) == 2  # pdsh: deepspeed's default launcher
    assert "`pdsh` is not on PATH" in capsys.readouterr().err


def test_one_host_without_launcher_and_no_ssh_run_here(tmp_path, monkeypatch):
    """DeepSpeed runs a one-host hostfile (and --no_ssh) on this node: torchrun, its share of slots."""
    from zeroshard.cli import launch_cmd
    from zeroshard.cli.main import build_parser

    seen = []
    monkeypatch.setattr(launch_cmd, "run_torchrun", lambda cmd, env=None, *a, **k: seen.append((cmd, env)) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "one").write_text("localhost slots=3\n")
    (tmp_path / "two").write_text("a slots=2\nb slots=2\n")
    assert launch_cmd.run(build_parser().parse_args(["launch", "--hostfile", "one", "train.py"])) == 0
    assert seen[-1][0][3:5] == ["--standalone", "--nproc-per-node=3"]
    args = build_parser().parse_args(["launch", "--hostfile", "two", "--no_ssh", "--node_rank", "1",
                                      "--include", "a@b:1", "train.py"])
    assert launch_cmd.run(args) == 0
    assert seen[-1][0][3:8] == ["--nnodes=2", "--node-rank=1", "--master-addr=a", "--master-port=29500",
                                "--nproc-per-node=1"]
    assert seen[-1][1]["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_launcher_started_n_times_by_srun_or_mpirun_is_refused(capsys, tmp_path, monkeypatch):
    """`srun -n 2 zeroshard launch --nproc 4 train.py` would be two separate jobs of 4 ranks."""
    (tmp_path / "train.py").write_text("")
    for key, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0",
                       "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}.items():
        monkeypatch.setenv(key, value)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert main(["launch", "--nproc", "4", str(tmp_path / "train.py")]) == 2
    err = capsys.readouterr().err
    assert "Slurm started 2 copies of this launcher but --nnodes is 1" in err and err.count("\n") == 1
    from zeroshard.cli.launch_cmd import check_rendezvous
    from zeroshard.cli.main import build_parser

    args = build_parser().parse_args(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", "n1", "t.py"])
    assert check_rendezvous(args) is None  # one launcher per node: srun --ntasks-per-node=1 zeroshard launch ...
