"""comm's typed collectives (issue 26): plain, qwZ, qgZ (and its quantized all-to-all hops)
implement `AllGather` / `ReduceScatter` / `AllToAll`; nobody outside comm/ reads comm's
private names; ZeRO++'s constants have one home; a handle's `then` runs after its finish.
One process (world size 1): the 4-rank behaviour is test_zeropp's."""

from __future__ import annotations

import ast
import pathlib

import torch

import zeroshard.comm as comm_pkg
from zeroshard.comm import (AllGather, AllToAll, Comm, CommLedger, QuantizedAllGather, QuantizedAllToAll,
                            QuantizedHierarchicalReduceScatter, ReduceScatter, setup_topology)

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "zeroshard"
# Comm's private names no other class of zeroshard has (an attribute read by name: `x._issue`)
COMM_PRIVATE = {"_AG", "_RS", "_OPS", "_issue", "_check_sizes", "_exchange", "_reduce_scatter_direct",
                "_all_gather_direct"}


def _comm() -> Comm:
    topo = setup_topology(30.0)
    return Comm(topo, CommLedger(topo.world_size), 30.0)


def test_every_collective_implements_its_interface():
    comm = _comm()
    hierarchy = comm.topology.hierarchy(1, 30.0)
    assert isinstance(comm, AllGather) and isinstance(comm, ReduceScatter) and isinstance(comm, AllToAll)
    assert isinstance(QuantizedAllGather(comm), AllGather)
    assert isinstance(QuantizedAllToAll(comm), AllToAll)
    assert isinstance(QuantizedHierarchicalReduceScatter(comm, hierarchy), ReduceScatter)
    assert not isinstance(QuantizedAllGather(comm), ReduceScatter)
    assert set(comm_pkg.__all__) >= {"AllGather", "ReduceScatter", "AllToAll"}


def test_interfaces_work_at_world_size_one():
    comm = _comm()
    hierarchy = comm.topology.hierarchy(1, 30.0)
    x = torch.randn(3000)
    out = torch.empty(3000)
    QuantizedAllGather(comm).all_gather(out, x, "test").wait()
    assert torch.equal(out, x)  # nothing leaves the rank: nothing quantized
    QuantizedHierarchicalReduceScatter(comm, hierarchy).reduce_scatter(out, x.clone(), "test").wait()
    assert torch.equal(out, x)
    rows = torch.empty(1, 3000)
    QuantizedAllToAll(comm).all_to_all(rows, x.view(1, -1), "test").wait()
    assert torch.equal(rows[0], x)


def test_then_runs_after_the_finish_and_once():
    comm = _comm()
    seen: list[str] = []
    handle = comm.issue("all_reduce", torch.zeros(1), 1, "test", lambda: None, finish=lambda: seen.append("finish"))
    assert handle.then(lambda: seen.append("then")) is handle
    handle.wait()
    handle.wait()
    assert seen == ["finish", "then"] and handle.done and "all_reduce" in handle.what


def _private_reads(path: pathlib.Path) -> list[str]:
    """Private names of zeroshard.comm this file imports or reads as an attribute."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zeroshard.comm"):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in COMM_PRIVATE:
            found.append(f".{node.attr} (line {node.lineno})")
    return found


def test_no_private_comm_name_is_read_outside_comm():
    outside = [p for p in SRC.rglob("*.py") if "comm" not in p.relative_to(SRC).parts[:1]]
    assert len(outside) > 50
    bad = {str(p.relative_to(SRC)): r for p in outside if (r := _private_reads(p))}
    assert not bad, bad


def test_quantization_constants_have_one_home():
    from zeroshard.comm import blocks
    from zeroshard.estimate import comm as estimate_comm

    assert estimate_comm.QUANT_BLOCK_SIZE is blocks.QUANT_BLOCK_SIZE
    assert estimate_comm.QGZ_BITS is blocks.QGZ_BITS
    for path in list(SRC.rglob("*.py")):
        if path.name == "blocks.py" and path.parent.name == "comm":
            continue
        tree = ast.parse(path.read_text())
        assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert not assigned & {"QUANT_BLOCK_SIZE", "QGZ_BITS", "QWZ_BITS"}, path


def test_comm_files_stay_short():
    for path in (SRC / "comm").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path


class _Work:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def wait(self, **kwargs) -> bool:
        self.calls.append(kwargs)
        return True


def _wait_kwargs(comm: Comm, backend: str, cuda: bool, monkeypatch) -> dict:
    import dataclasses

    from zeroshard.comm import Handle

    comm.topology = dataclasses.replace(comm.topology, backend=backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    work = _Work()
    Handle(comm, work, "test", comm.ledger.record("all_reduce", torch.float32, 1, 1, comm.scope), 0.0).wait()
    return work.calls[0]


def test_the_host_blocks_with_a_timeout_except_on_nccl_with_cuda(monkeypatch):
    """gloo (and NCCL named without a GPU) wait with comm_timeout_s as before; NCCL on a CUDA
    machine waits without one (stream-ordered: the host does not block on the GPU)."""
    comm = _comm()
    assert "timeout" in _wait_kwargs(comm, "gloo", False, monkeypatch)
    assert "timeout" in _wait_kwargs(comm, "gloo", True, monkeypatch)
    assert "timeout" in _wait_kwargs(comm, "nccl", False, monkeypatch)
    assert _wait_kwargs(comm, "nccl", True, monkeypatch) == {}
