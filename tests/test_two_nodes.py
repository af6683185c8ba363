"""Two nodes on loopback: two torchrun agents, one rank each, on 127.0.0.1.

Run A: `torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`
on both "nodes" (node 0 hosts the rendezvous store), `-m zeroshard.cli.train.worker`, 6 steps with a
checkpoint at steps 3 and 6. Run B: `zeroshard train --nnodes 2 --node-rank I --master-addr 127.0.0.1`
(the static rendezvous zeroshard's own launcher writes) on both nodes, in a folder that holds only
A's step-3 checkpoint: it resumes there, and its step-6 checkpoint equals A's bit for bit. Each
rank sees LOCAL_WORLD_SIZE 1, so zeroshard's topology is two nodes of one rank. Ports are chosen
free at run time; a run that does not finish within the timeout is killed with its process group.

Runs A and B are marked `slow` (`python -m pytest -m slow`). The default run has the short form:
`zeroshard train --nnodes 2` (zeroshard's own launcher, as run B) on both nodes from scratch, 2 steps
and a checkpoint at the end, which must be one stage-3 job of both nodes' ranks that saves both shards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from checkpoint_files import assert_bit_equal, checkpoint_tensors, client_state

TIMEOUT_S = 300
TRAIN = ["--model", "tiny", "--seq-len", "16", "--micro-batch", "4", "--steps", "6", "--save-every", "3",
         "--report", ""]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZEROSHARD_FAULT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def run_nodes(commands: list[list[str]], cwd) -> list[subprocess.CompletedProcess]:
    """Start one agent per command at once, wait for all; on timeout kill every process group."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd in commands]
    results = []
    try:
        for cmd, p in zip(commands, procs):
            out, err = p.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return results


def _zeroshard_nodes(train: list[str], save: str) -> list[list[str]]:
    port = free_port()
    return [[sys.executable, "-m", "zeroshard.cli.main", "train", "--nproc", "1", "--nnodes", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             *train, "--save", save] for node in (0, 1)]


def _show(results) -> str:
    return "\n".join(f"--- node {i} rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
                     for i, r in enumerate(results))


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("two_nodes")
    port = free_port()
    a = run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zs-two-nodes",
                    "--rdzv-conf", f"is_host={int(node == 0)}", "--node-rank", str(node),
                    "-m", "zeroshard.cli.train.worker", *TRAIN, "--save", "a"] for node in (0, 1)], cwd)
    if all(r.returncode == 0 for r in a):
        os.makedirs(cwd / "b")
        shutil.copytree(cwd / "a" / "global_step3", cwd / "b" / "global_step3")
        (cwd / "b" / "latest").write_text("global_step3")
        b = run_nodes(_zeroshard_nodes(TRAIN, "b"), cwd)
    else:
        b = None
    return cwd, a, b


SHORT_TRAIN = ["--model", "tiny", "--seq-len", "16", "--micro-batch", "4", "--steps", "2", "--save-every", "2",
               "--report", ""]


@pytest.mark.timeout(900)  # two agents and ranks in one run
def test_short_form_zeroshard_train_on_two_nodes_trains_and_saves(tmp_path):
    results = run_nodes(_zeroshard_nodes(SHORT_TRAIN, "s"), tmp_path)
    assert all(r.returncode == 0 for r in results), _show(results)
    out = " ".join("".join(r.stdout for r in results).split())
    assert out.count("zeroshard train: summary") == 1  # rank 0 prints it, on whichever node it is
    assert "3 / 2 (gloo)" in out  # stage 3 over both nodes' ranks
    assert "for 2 steps" in out and "resumed" not in out
    assert (tmp_path / "s" / "latest").read_text().strip() == "global_step2"
    assert sorted(os.listdir(tmp_path / "s" / "global_step2")) == [
        "meta.json", "rank00000.model.safetensors", "rank00000.optim.safetensors",
        "rank00001.model.safetensors", "rank00001.optim.safetensors"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # four agents and ranks in two runs; ~1 min on an idle 2-core machine
def test_two_torchrun_agents_with_c10d_rendezvous_train_and_save(two_node_runs):
    cwd, a, _ = two_node_runs
    assert all(r.returncode == 0 for r in a), _show(a)
    out = "".join(r.stdout for r in a)
    assert out.count("zeroshard train: summary") == 1  # rank 0 prints it, on whichever node it is
    assert "3 / 2 (gloo)" in out  # stage 3 over both nodes' ranks
    assert (cwd / "a" / "latest").read_text().strip() == "global_step6"
    assert sorted(os.listdir(cwd / "a" / "global_step6")) == [
        "meta.json", "rank00000.model.safetensors", "rank00000.optim.safetensors",
        "rank00001.model.safetensors", "rank00001.optim.safetensors"]


@pytest.mark.slow
def test_a_second_two_node_run_resumes_the_checkpoint_and_ends_bit_equal(two_node_runs):
    cwd, a, b = two_node_runs
    assert b is not None, "run A failed"
    assert all(r.returncode == 0 for r in b), _show(b)
    out = " ".join("".join(r.stdout for r in b).split())
    assert out.count("zeroshard train: summary") == 1 and "3 / 2 (gloo)" in out  # one job of both nodes' ranks
    assert "resumed at step 3 from b/global_step3" in out
    assert "for 3 steps" in out  # steps 3-5 only
    assert_bit_equal(checkpoint_tensors(cwd / "a" / "global_step6"), checkpoint_tensors(cwd / "b" / "global_step6"))
    assert client_state(cwd / "a" / "global_step6")["losses"] == client_state(cwd / "b" / "global_step6")["losses"]
