"""comm/cma.py: ranks of one host copy each other's messages out of the sender's memory, with
gloo carrying only addresses, sizes and acknowledgements. On 3 ranks: the direct collectives
(all-gather, reduce-scatter, reduce-scatter of pieces) give what they give over TCP, no
message larger than the descriptors goes through gloo, a pair without the channel keeps TCP
beside pairs with it, `ZEROSHARD_CMA=0` on one rank turns it off for its pairs without a hang,
a peer whose descriptor does not match what was posted is a CommError, not a wrong result, and
what a rank sent in a collective it left early (a stop signal during a checkpoint's exchange)
stays readable for the peer that copies it later."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

WORLD = 3


def _collectives(comm, rank: int) -> list[torch.Tensor]:
    size = 5
    full = torch.arange(WORLD * size, dtype=torch.float32) * (rank + 1) + 0.5 * rank
    rs = torch.empty(size)
    comm.reduce_scatter(rs, full.clone(), what="rs", average=True).wait()
    ag = torch.empty(WORLD * size)
    comm.all_gather(ag, torch.full((size,), float(rank + 1)), what="ag").wait()
    pieces = torch.full((size,), 7.0)
    comm.reduce_scatter_pieces(pieces, [(0, full[:7].clone()), (7, full[7:13].clone())], what="pieces",
                               accumulate=True).wait()
    return [rs, ag, pieces]


def _worker(rank: int, world_size: int, mode: str):
    import os

    import zeroshard.comm.cma as cma
    from zeroshard.comm import Comm, CommLedger, setup_topology

    if mode == "off-on-rank-1" and rank == 1:
        os.environ["ZEROSHARD_CMA"] = "0"
    if mode == "pair-0-1":  # rank 2 reads nobody and nobody reads it
        real = cma.CmaChannel.probe

        def probe(on_group, tag, timeout_s):
            channel = real(on_group, tag, timeout_s)
            if channel is not None:
                channel.peers = {p: pid for p, pid in channel.peers.items() if {p, rank} == {0, 1}}
            return channel if channel is not None and channel.peers else None

        cma.CmaChannel.probe = probe
    topology = setup_topology(30.0)
    comm = Comm(topology, CommLedger(world_size), 30.0)
    sent = []
    isend = dist.isend
    dist.isend = lambda tensor, *a, **k: (sent.append(tensor.nbytes), isend(tensor, *a, **k))[1]
    out = _collectives(comm, rank)
    dist.isend = isend
    channel = next(iter(comm._channels.values()))
    peers = sorted(channel.peers) if channel is not None else []
    comm.close()
    topology.destroy()
    return out, peers, max(sent)


@pytest.fixture(scope="module")
def tcp():
    import os

    os.environ["ZEROSHARD_CMA"] = "0"
    try:
        return run_ranks(_worker, WORLD, "tcp", timeout=120)
    finally:
        del os.environ["ZEROSHARD_CMA"]


def _available() -> bool:
    import sys

    return sys.platform.startswith("linux")


@pytest.mark.parametrize("mode", ["all", "pair-0-1", "off-on-rank-1"])
def test_intra_host_copies_equal_tcp(mode, tcp):
    if not _available():
        pytest.skip("cross-memory attach is Linux's")
    got = run_ranks(_worker, WORLD, mode, timeout=120)
    for rank, ((out, peers, biggest), (want, tcp_peers, tcp_biggest)) in enumerate(zip(got, tcp)):
        assert tcp_peers == [] and tcp_biggest >= 5 * 4
        for a, b in zip(out, want):
            assert torch.equal(a, b), (mode, rank, a, b)
        expect = {"all": [p for p in range(WORLD) if p != rank],
                  "pair-0-1": {0: [1], 1: [0], 2: []}[rank],
                  "off-on-rank-1": {0: [2], 1: [], 2: [0]}[rank]}[mode]
        if mode == "all" and peers == []:
            pytest.skip("this machine does not let its processes read each other (ptrace policy)")
        assert peers == expect, (mode, rank, peers)
        if mode == "all":  # only descriptors (address, bytes) and acknowledgements went through gloo
            assert biggest <= 2 * 8 * 2, biggest


def _probed(world_size: int, timeout_s: float):
    """(topology, Comm) after a first all-gather has probed the channel; None where the ranks
    cannot read each other."""
    from zeroshard.comm import Comm, CommLedger, setup_topology

    topology = setup_topology(30.0)
    comm = Comm(topology, CommLedger(world_size), timeout_s)
    comm.all_gather(torch.empty(4), torch.ones(2), what="probe").wait()
    return (topology, comm) if next(iter(comm._channels.values())) is not None else None


def _mismatch_worker(rank: int, world_size: int):
    from zeroshard.policies import CommError

    probed = _probed(world_size, 5.0)
    if probed is None:
        return "no channel"
    comm = probed[1]
    cut = 6 if rank == 0 else 7  # the ranks disagree on the pieces' sizes (a bug upstream), not their count
    try:
        comm.reduce_scatter_pieces(torch.empty(5), [(0, torch.ones(cut)), (cut, torch.ones(10 - cut))],
                                   what="mismatched").wait()
    except CommError as exc:
        return str(exc)
    finally:
        comm.close()
    return "no error"


def test_a_size_mismatch_is_a_comm_error():
    """Rank 1 expects 2 + 3 elements from rank 0, which sends 1 + 4: rank 1 says so, without
    reading past what was sent; rank 0, whose sends are never acknowledged, fails too (its wait
    times out, or rank 1's exit closes the connection first), naming the collective."""
    texts = run_ranks(_mismatch_worker, 2, timeout=120)
    if "no channel" in texts:
        pytest.skip("this machine does not let its processes read each other (ptrace policy)")
    assert "mismatched" in texts[1] and "were expected" in texts[1], texts[1]
    assert "reduce_scatter of 10 float32 elements (mismatched)" in texts[0], texts[0]


def _abandon_worker(rank: int, world_size: int):
    import gc
    import time

    probed = _probed(world_size, 30.0)
    if probed is None:
        return "no channel"
    topology, comm = probed
    n, every, reused = 1024, torch.empty(2 * 1024), None
    if rank == 1:
        out = torch.empty(2 * n)  # what an all-gather sends is this rank's chunk of its output
        handle = comm.all_gather(out, torch.full((n,), 7.0), what="left early")
        address = out.data_ptr()
        del out, handle  # as a stop signal raised out of wait() leaves it: rank 0 has not copied yet
        gc.collect()
        reuse = [torch.full((2 * n,), -1.0) for _ in range(16)]  # what would be written where it lay
        reused = any(t.data_ptr() == address for t in reuse)
    else:
        time.sleep(1.0)  # rank 1 has left the collective by now
        comm.all_gather(every, torch.full((n,), 3.0), what="left early").wait()
    dist.barrier()  # rank 1 stays alive until rank 0 has copied
    comm.close()
    topology.destroy()
    return {"reused": reused, "from rank 1": every[n:].unique().tolist()}


def test_what_a_rank_sent_before_leaving_a_collective_stays_readable():
    """Rank 1 drops its all-gather unwaited (a stop signal in a checkpoint's record exchange,
    session 54: rank 0 then decoded garbage) and reuses memory; rank 0 copies 1 s later and reads
    exactly what rank 1 sent: an abandoned collective's sent tensors live until the peers acknowledge."""
    if not _available():
        pytest.skip("cross-memory attach is Linux's")
    got = run_ranks(_abandon_worker, 2, timeout=120)
    if "no channel" in got:
        pytest.skip("this machine does not let its processes read each other (ptrace policy)")
    assert got[1]["reused"] is False, got  # its memory was not handed out again
    assert got[0]["from rank 1"] == [7.0], got
