"""`zeroshard bench`'s compute floor and its step breakdown (issue 46): the floor's optimizer over
a balanced 1/N of the parameters with its gradients kept in place, the ledger's `waited` (the
seconds a rank's host was blocked in a collective's wait, not the collective's whole time), and
where a step goes on the rank that set its time (`merge_ranks`, `phase_breakdown`), here also from
the worker's own `run_job` on 2 ranks."""

from __future__ import annotations

import time

import pytest
import torch

from distributed import one_group, run_ranks
from zeroshard.bench.peers import FloorRunner, build_peer, floor_share
from zeroshard.bench.results import PHASES, merge_ranks, phase_breakdown
from zeroshard.bench.systems import SYSTEMS
from zeroshard.cli.train.model import build_model


@pytest.mark.parametrize("world", [2, 3])
def test_floor_share_splits_every_parameter_once_and_balances_the_elements(world):
    module = build_model("tiny").module
    params = list(module.parameters())
    shares = [floor_share(module, r, world) for r in range(world)]
    ids = [id(p) for share in shares for p in share]
    assert sorted(ids) == sorted(id(p) for p in params) and len(set(ids)) == len(params)
    loads = [sum(p.numel() for p in share) for share in shares]
    assert max(loads) - min(loads) <= max(p.numel() for p in params)


def test_the_floor_keeps_its_gradients_in_place_and_steps_only_its_share():
    torch.manual_seed(0)
    tm = build_model("tiny")
    runner = build_peer(SYSTEMS["floor"], tm.module, tm.unit_classes, 2, False, torch.device("cpu"))
    assert isinstance(runner, FloorRunner)
    x = torch.randint(0, tm.vocab_size, (2, 16))
    before = [p.detach().clone() for p in tm.module.parameters()]
    runner.step(x, x)
    where = [p.grad.data_ptr() for p in tm.module.parameters()]
    runner.step(x, x)
    assert [p.grad.data_ptr() for p in tm.module.parameters()] == where  # zeroed, never freed
    assert all(not p.grad.any() for p in tm.module.parameters())
    moved = [not torch.equal(a, p) for a, p in zip(before, tm.module.parameters())]
    assert all(moved)  # one rank: its share is every parameter
    assert all(v == 0.0 for v in runner.waits.values())


def _waited_worker(rank: int, world: int):
    from zeroshard.comm import Comm, CommLedger, setup_topology

    topology = setup_topology(30.0)
    comm = Comm(topology, CommLedger(world), 30.0)
    comm.all_gather(torch.empty(2000), torch.full((1000,), float(rank)), what="first").wait()  # the channel's probe
    first = comm.ledger.lifetime()["all_gather"]["waited"]
    if rank == 1:  # the peer is late: rank 0 blocks in its wait for about this long
        time.sleep(0.6)
    comm.all_gather(torch.empty(2000), torch.full((1000,), float(rank)), what="late peer").wait()
    late = comm.ledger.lifetime()["all_gather"]["waited"] - first
    comm.all_reduce(torch.ones(1), what="line up").wait()
    handle = comm.all_reduce(torch.ones(10), what="overlapped")
    time.sleep(0.4)  # other work while it runs: nothing is left to block on at the wait
    handle.wait()
    after = comm.ledger.lifetime()["all_reduce"]
    topology.destroy()
    return late, after["waited"], after["seconds"]


def test_the_ledger_counts_the_seconds_a_wait_blocked_not_the_collectives_whole_time():
    (late0, waited0, seconds0), (late1, waited1, seconds1) = run_ranks(_waited_worker, 2, timeout=120)
    assert late0 >= 0.45 and late1 < late0 - 0.3, (late0, late1)
    for waited, seconds in ((waited0, seconds0), (waited1, seconds1)):
        assert seconds >= 0.4 and waited < 0.25, (waited, seconds)


def test_phase_breakdown_takes_the_blocked_seconds_out_of_each_phase():
    row = {"phases_s": {"fwd": [1.0, 1.2, 1.1], "bwd": [2.0, 2.0, 2.2], "opt": [0.3, 0.3, 0.3],
                        "step": [3.5, 3.6, 3.7], "fwd_wait": [0.1, 0.2, 0.1], "bwd_wait": [0.4, 0.4, 0.5],
                        "opt_wait": [0.1, 0.1, 0.1], "reduce_wait": [0.45, 0.45, 0.55],
                        "gather_wait": [0.15, 0.25, 0.15]}}
    got = phase_breakdown(row)
    assert list(got) == list(PHASES)
    want = {"step": 3.6, "forward": 1.0, "backward": 1.6, "exposed_reduce": 0.45, "exposed_gather": 0.15,
            "optimizer": 0.2, "other": 0.1}
    assert got == pytest.approx(want)
    peer = {"phases_s": {k: row["phases_s"][k] for k in ("fwd", "bwd", "opt", "step")}}
    got = phase_breakdown(peer)  # a peer's collectives are inside its phases
    assert got["exposed_reduce"] is None and got["exposed_gather"] is None
    assert got["forward"] == pytest.approx(1.1) and got["backward"] == pytest.approx(2.0)


def _rank_file(rank: int, steps: list[float], fwd: list[float], waited: list[float]) -> dict:
    return {"system": "zs2", "rank": rank, "world_size": 2, "phi": 10, "threads": 1, "init_s": 0.0, "warmup": 1,
            "step_times_s": steps, "phases_s": [(f, 0.1, 0.1) for f in fwd], "losses": [1.0] * len(steps),
            "waits_s": [{"fwd_wait": w, "bwd_wait": 0.0, "opt_wait": 0.0, "reduce_wait": 0.0, "gather_wait": w}
                        for w in waited],
            "peak_rss_kib": 1024, "peak_rss_reset": True, "model_states": {}}


def test_each_steps_phases_are_the_slowest_ranks():
    # rank 1 sets step 1's time and rank 0 step 2's; the faster rank's wait is time it idled for the other
    r0 = _rank_file(0, [9.0, 1.0, 1.6], [9.0, 0.9, 1.4], [0.0, 0.4, 0.1])
    r1 = _rank_file(1, [9.0, 1.2, 1.5], [9.0, 1.0, 1.3], [0.0, 0.1, 0.3])
    ph = merge_ranks([r1, r0], micro_batch=1, seq_len=1)["phases_s"]
    assert ph["rank"] == [1, 0] and ph["step"] == [1.2, 1.6] and ph["fwd"] == [1.0, 1.4]
    assert ph["fwd_wait"] == [0.1, 0.1] and ph["gather_wait"] == [0.1, 0.1]


def _job_worker(rank: int, world: int):
    from zeroshard.bench.worker import run_job

    job = {"model": "tiny", "steps": 2, "warmup": 1, "micro_batch": 2, "seq_len": 16, "bf16": False, "seed": 0,
           "threads": 1, "scratch": ""}
    with one_group():
        return {name: run_job({**job, "system": name}) for name in ("floor", "zs2", "zs3")}


def test_the_worker_measures_the_floor_and_zeroshards_exposed_communication():
    ranks = run_ranks(_job_worker, 2, timeout=300)
    for name in ("floor", "zs2", "zs3"):
        row = merge_ranks([r[name] for r in ranks], micro_batch=2, seq_len=16)
        ph, got = row["phases_s"], phase_breakdown(row)
        assert len(ph["step"]) == 2 and all(w is not None for w in ranks[0][name]["waits_s"])
        assert ph["step"] == row["step_time_s"]["steps"]  # the rank that set each step's time
        for i, step in enumerate(ph["step"]):
            assert ph["fwd"][i] + ph["bwd"][i] + ph["opt"][i] <= step
            for phase in ("fwd", "bwd", "opt"):
                assert 0 <= ph[f"{phase}_wait"][i] <= ph[phase][i]
            in_phases = ph["fwd_wait"][i] + ph["bwd_wait"][i] + ph["opt_wait"][i]
            assert ph["reduce_wait"][i] + ph["gather_wait"][i] == pytest.approx(in_phases)
            if name == "floor":
                assert in_phases == 0.0
            else:  # every step reduces gradients and gathers parameters: its waits take some time
                assert ph["reduce_wait"][i] > 0 and ph["gather_wait"][i] > 0
        assert all(got[k] >= 0 for k in PHASES if k != "other")
