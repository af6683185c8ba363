"""`zeroshard launch`: run your own training script on N local ranks through torchrun.

    zeroshard launch --nproc 2 train.py --lr 1e-3
    zeroshard launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr head-node train.py   # on each node

zeroshard has no launcher of its own: this is `python -m torch.distributed.run` with
the rendezvous options spelled out, OMP_NUM_THREADS defaulted to 1 (torchrun's own
default, without its warning), and the same checks `zeroshard train` makes before any
rank starts. Everything after the script is passed to it unchanged.

The `deepspeed` launcher's single-node flags are accepted and mapped onto torchrun, so a
DeepSpeed command line only changes its first word:

    deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
    zeroshard launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

--num_gpus N is --nproc N; --include/--exclude localhost:0,2 pick devices on this host
(CUDA_VISIBLE_DEVICES, one rank each); --master_port/--master_addr/--node_rank are
--master-port/--master-addr/--node-rank; --num_nodes N is --nnodes N, run on every node.
torchrun gives ranks LOCAL_RANK in the environment, not a --local_rank argument
(--no_local_rank is accepted).

Several nodes from one command, with DeepSpeed's hostfile (`HOST slots=N` lines) and the
real tool (cli/multinode.py has the exact command lines):

    zeroshard launch --hostfile hosts --launcher pdsh|ssh|openmpi|mpich|impi|slurm train.py ...

--include/--exclude HOST[:SLOTS][@HOST...], --num_nodes, --num_gpus pick from the hostfile;
--launcher_args "..." go to the tool; --no_ssh runs this node's share only (--node_rank I).
Without --launcher, a hostfile of several hosts uses pdsh (DeepSpeed's default) and one host
runs here.

Elastic: `--nnodes MIN:MAX` runs torchrun's c10d rendezvous at --master-addr:--master-port (the
same on every node; --node-rank is assigned). A node that dies stops its peers' ranks; torchrun
starts them again (--max-restarts, 3 unless given) on the nodes left, as long as MIN remain, and
a node that joins is taken in the same way. The script resumes from its last checkpoint at the
new world size (zeroshard's checkpoints reshard on load; `zeroshard train` does it, keeping the
global batch by changing the gradient accumulation): docs/clusters.md, "Elastic jobs".
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import sys

from zeroshard.cli import deepspeed_shadow, multinode
from zeroshard.cli.devices import cuda_device_count
from zeroshard.cli.hostfile import HostfileError, active_resources, parse_hostfile
from zeroshard.cli.launch_config import config_problem

__all__ = ["add_rendezvous_arguments", "apply_deepspeed_flags", "check_nproc", "elastic", "elastic_note", "rank_target",
           "register", "run_torchrun", "torchrun_command"]

_LOCAL_HOSTS = ("localhost", "127.0.0.1")
ELASTIC_RESTARTS = 3  # --max-restarts of an elastic job that gives none: each lost or new node costs one


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="run your script on N ranks with torchrun (one node or many)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="ranks on this node (default 2)")
    add_rendezvous_arguments(p)
    add_deepspeed_launcher_arguments(p)
    deepspeed_shadow.add_arguments(p)
    p.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


class _Nnodes(argparse.Action):
    """`--nnodes N` or `--nnodes MIN:MAX` (elastic): `nnodes` is N or MAX, `min_nnodes` N or MIN."""

    def __call__(self, parser, namespace, value, option_string=None):
        low, sep, high = str(value).partition(":")
        try:
            lo, hi = int(low), int(high if sep else low)
        except ValueError:
            parser.error(f"--nnodes {value}: expected a number of nodes N or an elastic range MIN:MAX, e.g. 1:4")
        if not 1 <= lo <= hi:
            parser.error(f"--nnodes {value}: MIN must be at least 1 and at most MAX")
        namespace.nnodes, namespace.min_nnodes = hi, lo


def elastic(args: argparse.Namespace) -> bool:
    """True for `--nnodes MIN:MAX` with MIN < MAX (torchrun's elastic rendezvous)."""
    return getattr(args, "min_nnodes", args.nnodes) < args.nnodes


def elastic_note(args: argparse.Namespace) -> str | None:
    """The line that says what an elastic job chose where the command line was silent."""
    if not elastic(args):
        return None
    restarts = ELASTIC_RESTARTS if args.max_restarts is None else args.max_restarts
    chosen = " (the default for an elastic job)" if args.max_restarts is None else ""
    return (f"elastic job: {args.min_nnodes} to {args.nnodes} nodes of {args.nproc} ranks, rendezvous "
            f"{args.rdzv_id!r} at {args.master_addr}:{args.master_port}; up to {restarts} restarts{chosen}, "
            "each lost or joining node costs one")


def add_rendezvous_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", action=_Nnodes, default=1, metavar="N|MIN:MAX",
                   help="nodes in the job (default 1); MIN:MAX for an elastic job that goes on while MIN remain")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", help="address of node 0, reachable from every node (multi-node)")
    p.add_argument("--master-port", type=int, default=29500, help="port on node 0 (default 29500)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="when a rank fails, stop every rank and start them again, up to N times "
                        "(torchrun's --max-restarts; default 0, and 3 for --nnodes MIN:MAX)")
    p.add_argument("--rdzv-id", default="zeroshard", metavar="ID",
                   help="--nnodes MIN:MAX: the job's name in the rendezvous, the same on every node (default zeroshard)")
    p.add_argument("--rdzv-conf", default=None, metavar="K=V,...",
                   help="--nnodes MIN:MAX: torchrun's rendezvous settings, e.g. last_call_timeout=10,join_timeout=600")


def add_deepspeed_launcher_arguments(p: argparse.ArgumentParser) -> None:
    ds = p.add_argument_group("deepspeed launcher flags", "accepted so a `deepspeed ...` command line runs unchanged")
    ds.add_argument("--num_gpus", "--num-gpus", type=int, default=None, help="ranks on this node (= --nproc)")
    ds.add_argument("--num_nodes", "--num-nodes", type=int, default=None, help="nodes (= --nnodes, run on each node)")
    ds.add_argument("--master_port", type=int, dest="master_port", default=argparse.SUPPRESS, help="= --master-port")
    ds.add_argument("--master_addr", dest="master_addr", default=argparse.SUPPRESS, help="= --master-addr")
    ds.add_argument("--node_rank", type=int, dest="node_rank", default=argparse.SUPPRESS, help="= --node-rank")
    ds.add_argument("-i", "--include", default=None, help="devices of this host to use, e.g. localhost:0,2")
    ds.add_argument("-e", "--exclude", default=None, help="devices of this host not to use, e.g. localhost:1")
    ds.add_argument("-H", "--hostfile", default=None, help="DeepSpeed's hostfile (`HOST slots=N` per line): start "
                    "ranks on every host with --launcher")
    ds.add_argument("--launcher", choices=multinode.LAUNCHERS, default=None,
                    help="the tool that starts the ranks of a hostfile (default pdsh, as deepspeed)")
    ds.add_argument("--launcher_args", "--launcher-args", default="", help="arguments for the launcher tool, one string")
    ds.add_argument("--no_ssh", action="store_true", help="start only this node's ranks (--node_rank I of the hostfile)")
    ds.add_argument("--ssh_port", type=int, default=None, help="ssh port for --launcher pdsh/ssh")
    ds.add_argument("--no_local_rank", action="store_true", help="accepted: torchrun passes LOCAL_RANK in the "
                    "environment, never --local_rank")


def _parse_hosts(spec: str, flag: str) -> tuple[list[int] | None, str | None]:
    """`localhost:0,2` -> ([0, 2], None); `localhost` -> (None, None) (every slot); else an error."""
    hosts = [h for h in spec.split("@") if h]
    if len(hosts) != 1:
        return None, (f"{flag} {spec}: zeroshard launch starts ranks on this host only; on each node run "
                      "`zeroshard launch --nproc G --nnodes N --node-rank I --master-addr HEAD script.py`")
    host, _, slots = hosts[0].partition(":")
    if host not in _LOCAL_HOSTS and host != socket.gethostname():
        return None, (f"{flag} {spec}: {host} is not this host; zeroshard launch starts ranks here only "
                      "(run it on that node, with --nnodes/--node-rank/--master-addr for several nodes)")
    if not slots:
        return None, None
    try:
        return sorted({int(s) for s in slots.split(",") if s.strip()}), None
    except ValueError:
        return None, f"{flag} {spec}: devices must be integers, e.g. localhost:0,2"


def apply_deepspeed_flags(args: argparse.Namespace, device_count: int) -> tuple[str | None, dict[str, str]]:
    """Map the deepspeed launcher's flags onto --nproc/--nnodes; returns (problem, extra environment).
    `device_count` is the CUDA devices of this host (0 on CPU, where --include/--exclude count ranks)."""
    env: dict[str, str] = {}
    if args.num_gpus is not None:
        if args.nproc is not None and args.nproc != args.num_gpus:
            return f"--num_gpus {args.num_gpus} and --nproc {args.nproc} disagree; give one of them", env
        args.nproc = args.num_gpus
    if args.num_nodes is not None:
        if args.nnodes != 1 and args.nnodes != args.num_nodes:
            return f"--num_nodes {args.num_nodes} and --nnodes {args.nnodes} disagree; give one of them", env
        args.nnodes = args.num_nodes
        if args.num_nodes > 1 and not args.master_addr:
            return (f"--num_nodes {args.num_nodes}: torchrun starts the ranks of one node; run on each node "
                    f"`zeroshard launch --nproc G --nnodes {args.num_nodes} --node-rank I --master-addr HEAD "
                    "script.py` (node 0's address as HEAD)"), env
    include, exclude = getattr(args, "include", None), getattr(args, "exclude", None)
    if include and exclude:
        return "--include and --exclude cannot be used together", env
    if include or exclude:
        if args.num_gpus is not None or (args.num_nodes or 1) > 1:
            return "--include/--exclude cannot be combined with --num_gpus/--num_nodes (as with deepspeed)", env
        slots, problem = _parse_hosts(include or exclude, "--include" if include else "--exclude")
        if problem:
            return problem, env
        every = list(range(device_count if device_count else (args.nproc or 2)))
        if include:
            chosen = every if slots is None else slots
            missing = [s for s in chosen if device_count and s >= device_count]
            if missing:
                return f"--include {include}: this host has {device_count} CUDA device(s), no {missing[0]}", env
        else:
            chosen = [] if slots is None else [s for s in every if s not in slots]
        if not chosen:
            return f"--exclude {exclude} leaves no device on this host", env
        args.nproc = len(chosen)
        if device_count:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in chosen)
    return None, env


def check_nproc(nproc: int) -> str | None:
    """Why `nproc` ranks cannot run well on this machine for its backend, or None."""
    if nproc < 1:
        return f"--nproc must be at least 1, got {nproc}"
    devices = cuda_device_count()
    if devices:
        if nproc > devices:
            return (f"--nproc {nproc} but this machine has {devices} CUDA device(s); "
                    "NCCL needs one device per rank")
    elif nproc > 4 * (os.cpu_count() or 1):
        return (f"--nproc {nproc} is more than 4 ranks per CPU core ({os.cpu_count()} cores): "
                "the gloo ranks would thrash")
    return None


def check_rendezvous(args: argparse.Namespace) -> str | None:
    if args.nnodes < 1:
        return f"--nnodes must be at least 1, got {args.nnodes}"
    if elastic(args):
        if not args.master_addr:
            return (f"--nnodes {args.min_nnodes}:{args.nnodes} needs --master-addr: the host of the rendezvous, "
                    "the same on every node")
        if args.node_rank:
            return (f"--nnodes {args.min_nnodes}:{args.nnodes}: the rendezvous numbers the nodes; drop "
                    f"--node-rank {args.node_rank}")
        if getattr(args, "max_restarts", None) == 0:
            return (f"--nnodes {args.min_nnodes}:{args.nnodes} with --max-restarts 0 would end the job at the "
                    "first lost node; give --max-restarts N (N > 0) or a fixed --nnodes")
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes})"
    if args.nnodes > 1 and not args.master_addr:
        return f"--nnodes {args.nnodes} needs --master-addr (the address of node 0)"
    if not 0 < args.master_port < 65536:
        return f"--master-port {args.master_port} is not a TCP port"
    if (getattr(args, "max_restarts", 0) or 0) < 0:
        return f"--max-restarts must be 0 or more, got {args.max_restarts}"
    return check_outer_launcher(args.nnodes)


def check_outer_launcher(nnodes: int) -> str | None:
    """Why this launcher, itself started N times by mpirun or srun, would start N separate jobs."""
    from zeroshard.comm.launchers import discover
    from zeroshard.policies import CommError

    try:
        outer = discover(find_master=False)
    except CommError:
        return None  # the ranks will say what is wrong with the launcher's variables
    if outer.source in ("torchrun", "single process") or outer.world_size in (1, nnodes):
        return None
    return (f"{outer.source} started {outer.world_size} copies of this launcher but --nnodes is {nnodes}: they "
            "would train as separate jobs. Start one launcher per node with --nnodes N --node-rank I --master-addr "
            "HEAD, or start the script itself with mpirun/srun (docs/clusters.md)")


def torchrun_command(args: argparse.Namespace, target: list[str]) -> list[str]:
    """`python -m torch.distributed.run ...` for `target` (a script or `-m module` and its args),
    through zeroshard.cli.torchrun_main (the same torchrun; a stop or failure without tracebacks).

    One node without --master-addr: `--standalone` (a free port on localhost); `--nnodes MIN:MAX`:
    the c10d rendezvous at --master-addr:--master-port; otherwise the static rendezvous every node
    runs with the same --master-addr/--master-port."""
    cmd = [sys.executable, "-m", "zeroshard.cli.torchrun_main"]  # torch.distributed.run, quieter
    restarts = getattr(args, "max_restarts", None)
    if elastic(args):
        cmd += [f"--nnodes={args.min_nnodes}:{args.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={args.master_addr}:{args.master_port}", f"--rdzv-id={args.rdzv_id}"]
        if args.rdzv_conf:
            cmd.append(f"--rdzv-conf={args.rdzv_conf}")
        restarts = ELASTIC_RESTARTS if restarts is None else restarts
    elif args.nnodes == 1 and not args.master_addr:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                f"--master-addr={args.master_addr}", f"--master-port={args.master_port}"]
    if restarts:
        cmd.append(f"--max-restarts={restarts}")
    return [*cmd, f"--nproc-per-node={args.nproc}", *target]


def rank_target(target: list[str]) -> list[str]:
    """What torchrun starts in each rank: `target` under zeroshard.cli.rank_main (signals, one-line errors)."""
    return ["-m", "zeroshard.cli.rank_main", *target]


def run_torchrun(cmd: list[str], extra_env: dict[str, str] | None = None, command: str = "zeroshard launch",
                 describe_stop=None) -> int:
    """Run torchrun's `cmd` under the launcher's supervision (cli/supervise.py); its exit status."""
    from zeroshard.cli.supervise import supervise

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {})}
    if any(a.startswith("--max-restarts=") for a in cmd):  # written by torchrun_command when N > 0
        # torchrun shares its rendezvous store with the workers by default, and a restarted worker
        # can read the previous attempt's address of a peer from it and fail to connect
        # (pytorch/pytorch#135712; seen here as gloo "Connection refused" in the restarted attempt).
        # Without the sharing each round gets a fresh store.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return supervise(cmd, env, command, describe_stop)


def _hosts(args: argparse.Namespace):
    """The hostfile's active slots per host (None without --hostfile)."""
    if not args.hostfile:
        return None
    try:
        with open(args.hostfile) as fh:
            pool = parse_hostfile(fh.read(), args.hostfile)
    except OSError as exc:
        raise HostfileError(f"--hostfile {args.hostfile}: {exc.strerror}") from None
    return active_resources(pool, args.include or "", args.exclude or "", args.num_nodes or -1, args.num_gpus or -1)


def _here(args: argparse.Namespace, active, node_rank: int) -> dict[str, str]:
    """Make `args` start this node's share of `active` with torchrun; the extra environment."""
    hosts = list(active)
    slots = active[hosts[node_rank]]
    args.nproc, args.nnodes, args.node_rank = len(slots), len(hosts), node_rank
    if len(hosts) > 1:
        args.master_addr = args.master_addr or hosts[0]
    args.hostfile = args.include = args.exclude = args.num_gpus = args.num_nodes = None
    return {} if slots == list(range(len(slots))) else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}


def run_multinode(args: argparse.Namespace) -> int | None:
    """`--hostfile`/`--launcher`: fan out with the tool and return its status, or, for one host
    without --launcher or for --no_ssh, set `args` up for this node and return None."""
    try:
        active = _hosts(args)
    except HostfileError as exc:
        print(f"zeroshard launch: {exc}", file=sys.stderr)
        return 2
    launcher = args.launcher
    if active is not None and (args.no_ssh or (launcher is None and len(active) == 1)):
        if not 0 <= args.node_rank < len(active):
            print(f"zeroshard launch: --no_ssh: --node_rank {args.node_rank} is not a host of the hostfile "
                  f"(0..{len(active) - 1})", file=sys.stderr)
            return 2
        args.launcher_env = _here(args, active, args.node_rank)
        return None
    launcher = launcher or "pdsh"
    if launcher != "slurm":
        args.master_addr = args.master_addr or (next(iter(active)) if active else None)
    problem = None if args.module or os.path.isfile(args.script) else f"{args.script}: no such script"
    served_problem, served_env, served_line = deepspeed_shadow.shadow_env(args)
    cwd = os.getcwd()
    exports = multinode.forwarded_env(dict(os.environ), cwd, served_env.get("PYTHONPATH", ""))
    try:
        cmds, tool_env = multinode.build(launcher, active, args, exports, cwd) if not problem else ([], {})
    except ValueError as exc:
        problem = str(exc)
    problem = problem or served_problem
    if not problem and not shutil.which(cmds[0][0]):
        problem = f"--launcher {launcher}: `{cmds[0][0]}` is not on PATH here; install it or pick another --launcher"
    if problem:
        print(f"zeroshard launch: {problem}", file=sys.stderr)
        return 2
    print(served_line, flush=True)
    for cmd in cmds:
        print(f"zeroshard launch: {launcher}: {shlex.join(cmd)}", flush=True)
    names = [f"{launcher} {h}" for h in active] if launcher == "ssh" else [launcher]
    return multinode.fan_out(cmds, {**os.environ, **exports, **tool_env}, names)


def run(args: argparse.Namespace) -> int:
    # the script's DeepSpeed config, read before any rank starts (and before torch is imported)
    problem = config_problem(args.script_args, (args.nproc or 2) * (getattr(args, "nnodes", None) or 1))
    if problem:
        print(f"zeroshard launch: {problem}", file=sys.stderr)
        return 2
    if args.hostfile or args.launcher:
        status = run_multinode(args)
        if status is not None:
            return status
    problem, extra_env = apply_deepspeed_flags(args, cuda_device_count())
    args.nproc = 2 if args.nproc is None else args.nproc
    problem = problem or check_nproc(args.nproc) or check_rendezvous(args)
    if not problem and not args.module and not os.path.isfile(args.script):
        problem = f"{args.script}: no such script"
    served_problem, served_env, served_line = deepspeed_shadow.shadow_env(args)
    problem = problem or served_problem
    if problem:
        print(f"zeroshard launch: {problem}", file=sys.stderr)
        return 2
    print(served_line, flush=True)  # a notice, not an error: stdout
    if elastic_note(args):
        print(f"zeroshard launch: {elastic_note(args)}", flush=True)
    extra_env = {**extra_env, **getattr(args, "launcher_env", {}), **served_env}
    target = ["-m", args.script] if args.module else [args.script]
    return run_torchrun(torchrun_command(args, rank_target([*target, *args.script_args])), extra_env)
