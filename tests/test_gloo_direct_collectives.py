"""gloo's all-gather and reduce-scatter, done as point-to-point sends straight into place.

torch's gloo `reduce_scatter_tensor` clones the whole input on the calling thread and
all-reduces the clone (twice a reduce-scatter's bytes); its `all_gather_into_tensor` gathers
into a new flat tensor and copies every chunk out (51 ms against 14 ms for a 25 MiB bucket on
2 ranks). zeroshard's Comm sends each chunk to the rank that needs it instead. This checks, on
3 ranks: the results (a sum of three values, in place and out of place, fp32, bf16 and fp16,
summed and averaged), that torch's gloo collectives are never called, that the ledger's wire
bytes are (N-1)/N of the tensor, and that many collectives in flight at once, issued in the
same order on every rank, each receive their own messages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import run_ranks

WORLD = 3


def _comm(world_size: int):
    from zeroshard.comm import Comm, CommLedger, setup_topology
    import zeroshard.comm.collectives as collectives

    topology = setup_topology(30.0)

    def refuse(*args, **kwargs):
        raise AssertionError("a torch gloo collective was called")

    collectives._RS = collectives._AG = refuse  # what Comm calls for the native collectives
    dist.reduce_scatter_tensor = dist.all_gather_into_tensor = refuse
    return topology, Comm(topology, CommLedger(world_size), 30.0)


def _reduce_worker(rank: int, world_size: int):
    topology, comm = _comm(world_size)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        numel = 4 * world_size
        full = (torch.arange(numel, dtype=torch.float32) * (rank + 1)).to(dtype)
        separate = torch.empty(numel // world_size, dtype=dtype)
        comm.reduce_scatter(separate, full.clone(), what="test").wait()
        in_place = full.clone()
        mine = in_place[rank * 4:(rank + 1) * 4]
        comm.reduce_scatter(mine, in_place, what="test in place").wait()
        mean = torch.empty(numel // world_size, dtype=dtype)
        comm.reduce_scatter(mean, full.clone(), what="test mean", average=True).wait()
        out[str(dtype)] = (separate.float(), mine.float(), mean.float())
    stats = comm.ledger.stats()["reduce_scatter"]
    topology.destroy()
    return out, stats


def test_reduce_scatter_sums_every_rank_and_sends_a_reduce_scatters_bytes():
    ranks = run_ranks(_reduce_worker, WORLD, timeout=120)
    total = sum(r + 1 for r in range(WORLD))  # rank r contributes (r + 1) * arange
    for rank, (out, stats) in enumerate(ranks):
        expect = torch.arange(rank * 4, (rank + 1) * 4, dtype=torch.float32) * total
        for dtype, (separate, in_place, mean) in out.items():
            assert torch.equal(separate, expect), (dtype, separate, expect)
            assert torch.equal(in_place, expect), (dtype, in_place, expect)
            if dtype == "torch.float16":  # divided before the sum (a sum of fp16 may overflow):
                # three roundings of a third, each within fp16's half-ulp (2**-11 relative)
                assert torch.allclose(mean, expect / WORLD, rtol=3 * 2**-11, atol=0), (mean, expect / WORLD)
            else:  # summed, then divided: the mean of these integers is exact in fp32 and bf16
                assert torch.equal(mean, expect / WORLD), (dtype, mean, expect / WORLD)
        # 9 calls of 12 elements: 3 fp32 (48 B each), 3 bf16 and 3 fp16 (24 B each); each rank sends 2/3
        assert stats["calls"] == 9 and stats["elements"] == 9 * 12
        assert stats["sent_bytes"] == 3 * (2 * 48 // 3) + 6 * (2 * 24 // 3)


def _gather_worker(rank: int, world_size: int):
    topology, comm = _comm(world_size)
    size = 5
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        mine = torch.arange(size, dtype=torch.float32).to(dtype) + 100 * rank
        separate = torch.full((size * world_size,), -1.0, dtype=dtype)
        comm.all_gather(separate, mine.clone(), what="test").wait()
        in_place = torch.full((size * world_size,), -1.0, dtype=dtype)
        in_place[rank * size:(rank + 1) * size] = mine
        comm.all_gather(in_place, in_place[rank * size:(rank + 1) * size], what="test in place").wait()
        out[str(dtype)] = (separate.float(), in_place.float())
    stats = comm.ledger.stats()["all_gather"]
    topology.destroy()
    return out, stats


def test_all_gather_fills_every_chunk_in_place_and_sends_a_rings_bytes():
    ranks = run_ranks(_gather_worker, WORLD, timeout=120)
    expect = torch.cat([torch.arange(5, dtype=torch.float32) + 100 * r for r in range(WORLD)])
    for out, stats in ranks:
        for dtype, (separate, in_place) in out.items():
            assert torch.equal(separate, expect), (dtype, separate)
            assert torch.equal(in_place, expect), (dtype, in_place)
        # 4 calls of 15 elements (2 fp32 of 60 B, 2 bf16 of 30 B); each rank sends 2/3 of them
        assert stats["calls"] == 4 and stats["elements"] == 60
        assert stats["sent_bytes"] == 2 * (2 * 60 // 3) + 2 * (2 * 30 // 3)


def _in_flight_worker(rank: int, world_size: int):
    """Twelve collectives of different sizes issued before any wait, waited in reverse."""
    topology, comm = _comm(world_size)
    pending = []
    for k in range(6):
        size = 3 + k
        full = torch.arange(size * world_size, dtype=torch.float32) * (rank + 1) + 1000 * k
        shard = torch.empty(size)
        pending.append(("rs", k, shard, comm.reduce_scatter(shard, full, what=f"rs {k}")))
        gathered = torch.empty(size * world_size)
        pending.append(("ag", k, gathered,
                        comm.all_gather(gathered, torch.full((size,), float(10 * k + rank)), what=f"ag {k}")))
    results = []
    for kind, k, tensor, handle in reversed(pending):
        handle.wait()
        results.append((kind, k, tensor))
    topology.destroy()
    return results


def test_concurrent_collectives_each_get_their_own_messages():
    ranks = run_ranks(_in_flight_worker, WORLD, timeout=120)
    total = sum(r + 1 for r in range(WORLD))
    for rank, results in enumerate(ranks):
        assert len(results) == 12
        for kind, k, tensor in results:
            size = 3 + k
            if kind == "rs":
                full = torch.arange(size * WORLD, dtype=torch.float32)[rank * size:(rank + 1) * size]
                expect = full * total + 1000 * k * WORLD
            else:
                expect = torch.cat([torch.full((size,), float(10 * k + r)) for r in range(WORLD)])
            assert torch.equal(tensor, expect), (kind, k, tensor, expect)


def _mismatch_worker(rank: int, world_size: int):
    """Rank 0 gathers 4 elements per rank where the others gather 6 (diverged ranks)."""
    from zeroshard.comm import Comm, CommLedger, setup_topology
    from zeroshard.policies import CommError

    topology = setup_topology(30.0)
    comm = Comm(topology, CommLedger(world_size), 3.0)
    size = 4 if rank == 0 else 6
    try:
        comm.all_gather(torch.empty(size * world_size), torch.ones(size), what="diverged").wait()
    except CommError as exc:
        return type(exc).__name__, str(exc)
    finally:
        topology.destroy()
    return "no error", ""


def test_diverged_ranks_time_out_with_a_comm_error_instead_of_aborting():
    # gloo aborts the whole process ("Received data size doesn't match expected size") when a
    # message meets a receive of another size; tags that encode the size keep them apart.
    # The first rank to time out has gloo close its connections, so its peer's receive may end
    # with "connection closed by peer" before its own timeout: a CommError too, not an abort
    results = run_ranks(_mismatch_worker, 2, timeout=60)
    for kind, message in results:
        assert kind in ("CommTimeoutError", "CommError"), (kind, message)
        assert "all_gather" in message and "diverged" in message and "rank" in message, message
    assert any(kind == "CommTimeoutError" and "did not finish within 3s" in message
               for kind, message in results), results


# pieces of a 3 x 7 = 21-element input: [0, 5) crosses nothing, [5, 12) crosses chunks 0|1, [12, 19)
# crosses 1|2 and ends 2 before the tail (padding: uncovered, counts as zero)
PIECES = [(0, 5), (5, 12), (12, 19)]


def _pieces_worker(rank: int, world_size: int):
    topology, comm = _comm(world_size)
    size = 21 // world_size
    full = torch.zeros(21)
    pieces = []
    for lo, hi in PIECES:
        piece = torch.arange(lo, hi, dtype=torch.float32) * (rank + 1) + 0.25 * rank
        full[lo:hi] = piece
        pieces.append((lo, piece))
    want = torch.empty(size)
    comm.reduce_scatter(want, full.clone(), what="assembled", average=True).wait()
    got = torch.full((size,), float("nan"))  # overwritten everywhere, the padding included
    comm.reduce_scatter_pieces(got, pieces, what="pieces", average=True).wait()
    summed = torch.full((size,), 100.0)
    comm.reduce_scatter_pieces(summed, pieces, what="pieces, summed onto", accumulate=True).wait()
    sums = torch.empty(size)
    comm.reduce_scatter(sums, full.clone(), what="assembled sum").wait()
    wire = comm.ledger.stats()["reduce_scatter"]
    topology.destroy()
    return want, got, summed, sums + 100.0, wire


def test_reduce_scatter_of_pieces_equals_the_assembled_tensors():
    """Pieces that cross chunk boundaries and leave a tail uncovered reduce to the same values as
    the tensor assembled from them (averaged into a buffer of garbage, summed onto one holding
    values), with a reduce-scatter's wire bytes."""
    for rank, (want, got, summed, want_summed, wire) in enumerate(run_ranks(_pieces_worker, WORLD, timeout=120)):
        assert torch.equal(got, want), (rank, got, want)
        assert torch.equal(summed, want_summed), (rank, summed, want_summed)
        assert wire["calls"] == 4 and wire["elements"] == 4 * 21
