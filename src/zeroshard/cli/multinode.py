"""`zeroshard launch --launcher L --hostfile FILE`: the command lines that start every rank on
every node, with the real tool, DeepSpeed's launchers' meanings (deepspeed/launcher/multinode_runner.py).

pdsh, ssh   on each host, over ssh: `cd CWD && env VARS python -u -m zeroshard.cli.main launch
            --nproc SLOTS --nnodes N --node-rank I --master-addr HOST0 --master-port P SCRIPT ARGS`,
            the one-node launcher (torchrun's static rendezvous, its signal handling and one-line
            errors) on every node. pdsh runs one command everywhere (`%n` is the node's rank), so
            its hosts need equal slots; ssh runs one `ssh -tt HOST CMD` per host. The remote
            launcher is in the session of ssh's terminal: a stop here ends ssh, the terminal
            hangs up, and each node's launcher stops its ranks.
openmpi     mpirun -n TOTAL --host h0:S0,h1:S1 -x VAR=VALUE... -x MASTER_ADDR=HOST0 -x MASTER_PORT=P
            [--launcher_args] python -u -m zeroshard.cli.rank_main SCRIPT ARGS
mpich, impi mpirun -n TOTAL -ppn S -hosts h0,h1 -genv VAR VALUE... -genv MASTER_ADDR HOST0
            -genv MASTER_PORT P -genv LOCAL_SIZE S [--launcher_args] python -u -m zeroshard.cli.rank_main ...
slurm       srun -n TOTAL --nodes N --ntasks-per-node S [--nodelist h0,h1] --export=ALL
            [--launcher_args] python -u -m zeroshard.cli.rank_main SCRIPT ARGS
            (the ranks find the master in the step's node list; --master_addr overrides it)

Under MPI and Slurm each rank finds its place from the launcher's variables (comm/launchers.py).
What the ranks get in their environment: PATH, LD_LIBRARY_PATH, the virtual environment,
PYTHONPATH (the working directory first, as DeepSpeed does, and the `deepspeed` zeroshard
serves), NCCL_*, PYTHON*, UCX_*, MV2_*, HF_*, TORCH_*, OMP_NUM_THREADS (1 unless set), and the
lines of ~/.deepspeed_env and ./.deepspeed_env (DS_ENV_FILE names another file).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections import OrderedDict

__all__ = ["LAUNCHERS", "build", "forwarded_env"]

LAUNCHERS = ("pdsh", "ssh", "openmpi", "mpich", "impi", "slurm")
PDSH_MAX_FAN_OUT = 1024
_NAMES = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "CUDA_DEVICE_ORDER")
_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "MV2_", "MLFLOW", "HF_", "TORCH_", "TRANSFORMERS_")
_NEVER = ("ZEROSHARD_CHANNEL", "ZEROSHARD_COMMAND")


def _deepspeed_env_files(cwd: str) -> list[str]:
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    return [os.path.join(d, name) for d in (os.path.expanduser("~"), cwd)]


def forwarded_env(env: dict[str, str], cwd: str, pythonpath: str) -> "OrderedDict[str, str]":
    """The variables every rank gets, in a stable order (the command lines are tested exactly)."""
    out: OrderedDict[str, str] = OrderedDict()
    for key in sorted(env):
        if key not in _NEVER and (key in _NAMES or key.startswith(_PREFIXES)):
            out[key] = env[key]
    out["PYTHONPATH"] = os.pathsep.join(p for p in [cwd, *pythonpath.split(os.pathsep)] if p)
    out["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    for path in _deepspeed_env_files(cwd):
        if os.path.isfile(path):
            with open(path) as fh:
                for line in fh:
                    key, sep, value = line.strip().partition("=")
                    if sep and key.strip() and not key.startswith("#"):
                        out[key.strip()] = value
    return out


def _rank_command(args: argparse.Namespace) -> list[str]:
    target = ["-m", args.script] if args.module else [args.script]
    return [sys.executable, "-u", "-m", "zeroshard.cli.rank_main", *target, *args.script_args]


def _node_command(args: argparse.Namespace, nproc: int, nnodes: int, node_rank: str) -> list[str]:
    cmd = [sys.executable, "-u", "-m", "zeroshard.cli.main", "launch", "--nproc", str(nproc), "--nnodes",
           str(nnodes), "--node-rank", node_rank, "--master-addr", args.master_addr, "--master-port",
           str(args.master_port)]
    if getattr(args, "real_deepspeed", False):
        cmd.append("--real-deepspeed")
    if args.module:
        cmd.append("-m")
    return [*cmd, args.script, *args.script_args]


def _remote_shell(cwd: str, exports: "OrderedDict[str, str]", slots: list[int], cmd: list[str]) -> str:
    env = [f"{k}={v}" for k, v in exports.items()]
    if slots != list(range(len(slots))):  # a subset of the host's devices (--include/--exclude)
        env.append("CUDA_VISIBLE_DEVICES=" + ",".join(str(s) for s in slots))
    return f"cd {shlex.quote(cwd)} && " + " ".join(shlex.quote(w) for w in ["env", *env, *cmd])


def _uniform(active: "OrderedDict[str, list[int]]", launcher: str) -> int:
    counts = {len(s) for s in active.values()}
    if len(counts) != 1:
        detail = ", ".join(f"{h}: {len(s)}" for h, s in active.items())
        raise ValueError(f"--launcher {launcher} starts the same number of ranks on every host, but the slots "
                         f"differ ({detail}); even them out with --num_gpus or the hostfile"
                         + (", or use --launcher ssh" if launcher == "pdsh" else ""))
    return counts.pop()


def _whole_hosts(active: "OrderedDict[str, list[int]]", launcher: str) -> None:
    for host, slots in active.items():
        if slots != list(range(len(slots))):
            raise ValueError(f"--launcher {launcher} cannot pick devices {slots} of {host} (as with deepspeed): "
                             "include or exclude whole hosts, or use --launcher ssh/pdsh")


def build(launcher: str, active: "OrderedDict[str, list[int]] | None", args: argparse.Namespace,
          exports: "OrderedDict[str, str]", cwd: str) -> tuple[list[list[str]], dict[str, str]]:
    """(the command lines to run here, in parallel; variables to add to their environment).
    Raises ValueError with the one-line problem."""
    if launcher == "slurm":
        return _slurm(active, args, exports)
    if not active:
        raise ValueError(f"--launcher {launcher} needs --hostfile (lines `HOST slots=N`)")
    hosts = list(active)
    total = sum(len(s) for s in active.values())
    extra = shlex.split(args.launcher_args or "")
    if launcher in ("pdsh", "ssh"):
        if launcher == "pdsh":
            per = _uniform(active, launcher)
            slots = active[hosts[0]]
            if any(s != slots for s in active.values()):
                raise ValueError("--launcher pdsh runs one command on every host, so every host must use the same "
                                 "devices; use --launcher ssh to pick devices per host")
            shell = _remote_shell(cwd, exports, slots, _node_command(args, per, len(hosts), "%n"))
            env = {"PDSH_RCMD_TYPE": "ssh",
                   "PDSH_SSH_ARGS_APPEND": " ".join([os.environ.get("PDSH_SSH_ARGS_APPEND", ""), "-tt",
                                                     *(["-p", str(args.ssh_port)] if args.ssh_port else [])]).strip()}
            return [["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(hosts), *extra, shell]], env
        port = ["-p", str(args.ssh_port)] if args.ssh_port else []
        return [["ssh", "-tt", *port, *extra, host,
                 _remote_shell(cwd, exports, slots, _node_command(args, len(slots), len(hosts), str(i)))]
                for i, (host, slots) in enumerate(active.items())], {}
    _whole_hosts(active, launcher)
    rank = _rank_command(args)
    if launcher == "openmpi":
        cmd = ["mpirun", "-n", str(total), "--host", ",".join(f"{h}:{len(s)}" for h, s in active.items())]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")  # OpenMPI refuses root otherwise (DeepSpeed passes it always)
        for key, value in [*exports.items(), ("MASTER_ADDR", args.master_addr), ("MASTER_PORT", str(args.master_port))]:
            cmd += ["-x", f"{key}={value}"]
        return [[*cmd, *extra, *rank]], {}
    if launcher in ("mpich", "impi"):
        per = _uniform(active, launcher)
        cmd = ["mpirun", "-n", str(total), "-ppn", str(per), "-hosts", ",".join(hosts)]
        for key, value in [*exports.items(), ("MASTER_ADDR", args.master_addr), ("MASTER_PORT", str(args.master_port)),
                           ("LOCAL_SIZE", str(per))]:
            cmd += ["-genv", key, value]
        return [[*cmd, *extra, *rank]], {}
    raise ValueError(f"--launcher {launcher}: not one of {', '.join(LAUNCHERS)}")


def _slurm(active, args: argparse.Namespace, exports) -> tuple[list[list[str]], dict[str, str]]:
    cmd = ["srun"]
    if active:
        _whole_hosts(active, "slurm")
        per = _uniform(active, "slurm")
        cmd += ["-n", str(per * len(active)), "--nodes", str(len(active)), "--ntasks-per-node", str(per),
                "--nodelist", ",".join(active)]
    elif args.num_nodes or args.num_gpus:
        nodes, per = args.num_nodes or 1, args.num_gpus or 1
        cmd += ["-n", str(nodes * per), "--nodes", str(nodes), "--ntasks-per-node", str(per)]
    cmd.append("--export=ALL")  # srun hands its whole environment (the variables below) to every task
    env = {**exports, "MASTER_PORT": str(args.master_port)}
    if args.master_addr:
        env["MASTER_ADDR"] = args.master_addr
    return [[*cmd, *shlex.split(args.launcher_args or ""), *_rank_command(args)]], env


KILL_AFTER_S = 20.0


def fan_out(cmds: list[list[str]], env: dict[str, str], names: list[str]) -> int:
    """Run the tool's command lines at once and wait for all; the first failure's exit status.

    A stop signal here (Ctrl-C, SIGTERM, SIGHUP) goes once, as SIGTERM, to each command's
    process group (mpirun and srun pass it to every rank; ssh and pdsh end, and with them the
    remote terminal, whose hang-up stops each node's launcher); a second signal, or the tools
    still running KILL_AFTER_S later, kills them."""
    import signal
    import subprocess
    import threading

    procs: list[subprocess.Popen] = []
    got: list[int] = []

    def kill_all(sig: int) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def on_signal(signum, frame) -> None:
        if got:
            kill_all(signal.SIGKILL)
            return
        got.append(signum)
        kill_all(signal.SIGTERM)
        timer = threading.Timer(KILL_AFTER_S, kill_all, args=(signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for cmd in cmds:
            try:
                procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            except OSError as exc:
                kill_all(signal.SIGTERM)
                print(f"zeroshard launch: cannot start {cmd[0]}: {exc}", file=sys.stderr)
                return 2
        codes = [p.wait() for p in procs]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        print(f"zeroshard launch: stopped by {signal.Signals(got[0]).name}; every node was told to stop",
              file=sys.stderr)
        return 128 + got[0]
    failed = [(n, c) for n, c in zip(names, codes) if c]
    if failed:
        name, code = failed[0]
        print(f"zeroshard launch: {name} exited with status {code}", file=sys.stderr)
        return code if code > 0 else 128 - code
    return 0
