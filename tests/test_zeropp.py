"""ZeRO++ (issue 12) on 4 real gloo ranks laid out as 2 nodes x 2 (LOCAL_RANK,
LOCAL_WORLD_SIZE and GROUP_RANK set per rank as torchrun sets them):

* hpZ alone is lossless (the SGD oracle, 1e-5) and halves the inter-node all-gather
  bytes (the backward gather stays inside the node); its secondary partition is in
  memory_stats().
* qwZ, qgZ and all three: the loss over 30 steps of a learnable task stays within 3%
  of plain stage 3's, step by step after the first few; inter-node bytes per step with all
  three are <= 0.35x plain stage 3's (fp32 and bf16).
* the ledger by scope: every byte of the quantized collectives is payload + scales.
* qwZ and qgZ with SGD (linear in the gradient), 2 steps each: the update's scale against one
  process within 0.1 of 1, so a wrong 1/N on the quantized path shows (issue 28).

Only the loss tracking needs 30 steps: the default run trains plain stage 3 and all three
together for 30, qwZ and qgZ alone for 2 (their bytes per step are the last step's); the 30-step
loss tracking of qwZ alone and qgZ alone is marked `slow` (`python -m pytest -m slow`).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from oracle import Case, assert_matches, train_engine, train_reference

WORLD, PER_NODE = 4, 2
NO_REUSE = (("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0))
HPZ = (("zero_hpz_partition_size", 2),)
QWZ = (("zero_quantized_weights", True),)
QGZ = (("zero_quantized_gradients", True),)
STEPS = 30
LOSS_BOUND = 0.03  # |loss - plain stage 3's| / plain's, each step from step 3 on, and the last-5 mean
RUNS = {
    "plain": Case(stage=3, optimizer="adamw", steps=STEPS, zero=NO_REUSE),
    "hpz": Case(stage=3, optimizer="adamw", steps=2, zero=NO_REUSE + HPZ),  # lossless: the oracle shows it
    "qwz": Case(stage=3, optimizer="adamw", steps=2, zero=NO_REUSE + QWZ),  # 30 steps: LONG_RUNS
    "qgz": Case(stage=3, optimizer="adamw", steps=2, zero=NO_REUSE + QGZ),  # 30 steps: LONG_RUNS
    "all": Case(stage=3, optimizer="adamw", steps=STEPS, zero=NO_REUSE + HPZ + QWZ + QGZ),
    "plain-bf16": Case(stage=3, optimizer="adamw", steps=2, precision="bf16", zero=NO_REUSE),
    "all-bf16": Case(stage=3, optimizer="adamw", steps=2, precision="bf16", zero=NO_REUSE + HPZ + QWZ + QGZ),
}
LONG_RUNS = {key: RUNS[key].with_(steps=STEPS) for key in ("qwz", "qgz")}  # the slow loss tracking
ORACLE = Case(stage=3, optimizer="sgd", steps=4, zero=NO_REUSE + HPZ)
# SGD is linear in the gradient: beside each AdamW-only check of qwZ and qgZ, 2 SGD steps whose
# distance from one process is held to a fraction of the distance training moved (issue 28: a
# qgZ that sums instead of averaging moves 4x as far, which AdamW's update all but hides)
BOUND_SCALE, BOUND_DRIFT = 0.1, {"qwz-sgd": 0.15, "qgz-sgd": 0.5}  # measured: see the test
SGD_RUNS = {"qwz-sgd": Case(stage=3, optimizer="sgd", steps=2, zero=NO_REUSE + QWZ),
            "qgz-sgd": Case(stage=3, optimizer="sgd", steps=2, zero=NO_REUSE + QGZ)}
LINEAR_UNITS = (("zeroshard.stage3_unit_classes", ("Linear",)),)
FROZEN = {  # FrozenMLP, layers 0 and 2 frozen: qwZ for the frozen units only, and for all units
    "mlp": Case(model="mlp", stage=3, optimizer="adamw", steps=3, zero=NO_REUSE + LINEAR_UNITS),
    "mlp-frozen-q": Case(model="mlp", stage=3, optimizer="adamw", steps=3,
                         zero=NO_REUSE + LINEAR_UNITS + (("zero_quantized_nontrainable_weights", True),)),
    "mlp-all-q": Case(model="mlp", stage=3, optimizer="adamw", steps=3, zero=NO_REUSE + LINEAR_UNITS + QWZ),
}


def as_torchrun_node(rank: int) -> None:
    """torchrun's variables for rank `rank` of 2 nodes x 2 ranks."""
    os.environ.update(LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
                      GROUP_RANK=str(rank // PER_NODE))


def _collectives(rank):
    """qgZ (int4 and int8) against a plain reduce-scatter, qwZ against a plain all-gather (bf16
    and fp32), on the same inputs; sizes that do not divide the quantization block."""
    from zeroshard.comm import (Comm, CommLedger, QuantizedAllGather, QuantizedHierarchicalReduceScatter,
                                setup_topology)

    topo = setup_topology(120.0)
    comm = Comm(topo, CommLedger(WORLD), 120.0)
    h = topo.hierarchy(2, 120.0)
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    for bits in (4, 8):
        x = torch.randn(WORLD * 3001, generator=g)
        got, want = torch.empty(3001), torch.empty(3001)
        QuantizedHierarchicalReduceScatter(comm, h, bits=bits).reduce_scatter(got, x, "test").wait()
        comm.reduce_scatter(want, x.clone(), "reference").wait()
        amax = torch.tensor(x.abs().max().item())
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        out[f"rs{bits}"] = ((got - want).abs().max().item(), amax.item())
    for dtype in (torch.float32, torch.bfloat16):
        shard = (torch.randn(2500, generator=g) * 1e3).to(dtype)
        got, want = torch.empty(WORLD * 2500, dtype=dtype), torch.empty(WORLD * 2500, dtype=dtype)
        QuantizedAllGather(comm).all_gather(got, shard, "test").wait()
        comm.all_gather(want, shard, "reference").wait()
        amax = torch.tensor(shard.float().abs().max().item())
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        out[f"ag-{dtype}"] = ((got.float() - want.float()).abs().max().item(), amax.item(), got.dtype == dtype)
    out["pooled"] = _pooled(topo, h, g)
    topo.release_group()
    return out


def _pooled(topo, h, g):
    """With a BufferPool on the comm, the payload buffers of qwZ and qgZ (both hops) come back
    to it once dequantized and are handed out again: the results equal those with fresh ones."""
    from zeroshard.comm import Comm, CommLedger, QuantizedAllGather, QuantizedHierarchicalReduceScatter
    from zeroshard.partition.buffer_pool import BufferPool
    from zeroshard.partition.memory import MemoryLedger

    pool = BufferPool(MemoryLedger(), min_bytes=1)
    fresh, pooled = Comm(topo, CommLedger(WORLD), 120.0), Comm(topo, CommLedger(WORLD), 120.0, pool=pool)
    x, shard = torch.randn(WORLD * 3001, generator=g), torch.randn(2500, generator=g).to(torch.bfloat16)
    equal, reused = True, []
    for _ in range(3):
        for bits in (4, 8):
            got, want = torch.empty(3001), torch.empty(3001)
            QuantizedHierarchicalReduceScatter(pooled, h, bits=bits).reduce_scatter(got, x.clone(), "pooled").wait()
            QuantizedHierarchicalReduceScatter(fresh, h, bits=bits).reduce_scatter(want, x.clone(), "fresh").wait()
            equal &= torch.equal(got, want)
        got, want = torch.empty(WORLD * 2500, dtype=torch.bfloat16), torch.empty(WORLD * 2500, dtype=torch.bfloat16)
        QuantizedAllGather(pooled).all_gather(got, shard, "pooled").wait()
        QuantizedAllGather(fresh).all_gather(want, shard, "fresh").wait()
        equal &= torch.equal(got, want)
        reused.append(pool.reused)
    return {"equal": equal, "reused": reused}


def _worker(rank, world_size, runs, oracle, sgd_runs):
    as_torchrun_node(rank)
    dist.init_process_group("gloo")
    out = {"collectives": _collectives(rank)}
    for key, case in runs.items():
        engine, losses = train_engine(case.with_(steps=case.steps - 1), rank, world_size)
        engine.reset_comm_stats()
        engine.reset_memory_stats()
        from oracle import MICRO, batch, loss_of
        x, y = batch(case, case.steps - 1, world_size)
        loss = loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        # the loss is per rank's micro-batch: average over ranks for the global curve
        t = torch.tensor(losses)
        dist.all_reduce(t)
        out[key] = {"losses": (t / world_size).tolist(), "scoped": engine.comm_stats(by_scope=True),
                    "frozen_units": len(engine.frozen_buckets),
                    "flat": engine.comm_stats(), "mem": engine.memory_stats(),
                    "units": [[b.layout.padded_numel for b in u.buckets] for u in engine.units],
                    "itemsize": engine.buckets[0].dtype.itemsize}
        engine.close()
    engine, _ = train_engine(oracle, rank, world_size)
    out["oracle"] = engine.full_state_dict()
    engine.close()
    for key, case in sgd_runs.items():
        engine, _ = train_engine(case, rank, world_size)
        out[key] = engine.full_state_dict()
        engine.close()
    return out


def _loss_worker(rank, world_size, runs):
    """The global loss curve of each run (averaged over ranks, as _worker's)."""
    as_torchrun_node(rank)
    dist.init_process_group("gloo")
    out = {}
    for key, case in runs.items():
        engine, losses = train_engine(case, rank, world_size)
        engine.close()
        t = torch.tensor(losses)
        dist.all_reduce(t)
        out[key] = {"losses": (t / world_size).tolist()}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, {**RUNS, **FROZEN}, ORACLE, SGD_RUNS, timeout=400)


@pytest.fixture(scope="module")
def long_results():
    return run_ranks(_loss_worker, WORLD, LONG_RUNS, timeout=400)


def test_quantized_payloads_come_from_the_pool_and_go_back(results):
    """Issue 24: a 32 MiB payload allocated each call faults every page in again (bench
    bf16 int8 at 64 MiB: 0.30 of a copy). 3 rounds of qgZ int4 + int8 (2 hops, 2 payloads each)
    and qwZ: from the second round on every payload is a reused one (10 a round)."""
    for r in results:
        assert r["collectives"]["pooled"]["equal"]
        first, second, third = r["collectives"]["pooled"]["reused"]
        assert second - first == third - second == 10, r["collectives"]["pooled"]["reused"]


@pytest.mark.parametrize("bits", [4, 8])
def test_qgz_equals_a_reduce_scatter_up_to_quantization_error(results, bits):
    """Each of the k=2 local contributions loses at most half a step (absmax / 2 qmax) in hop 1,
    each of the M=2 node sums (|.| <= 2 absmax) as much again in hop 2. A wrong order of the
    chunks is off by O(the values themselves)."""
    qmax = {4: 7, 8: 127}[bits]
    for rank in range(WORLD):
        err, amax = results[rank]["collectives"][f"rs{bits}"]
        bound = (2 * amax + 2 * (2 * amax * (1 + 1 / qmax))) / (2 * qmax)
        assert err <= bound, (rank, err, bound)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_qwz_gather_within_half_a_step(results, dtype):
    for rank in range(WORLD):
        err, amax, same_dtype = results[rank]["collectives"][f"ag-{dtype}"]
        # half an int8 step, plus bf16's own rounding of the result (2^-8 relative)
        bound = amax / 254 + (amax / 256 if dtype.endswith("bfloat16") else 0)
        assert same_dtype and err <= bound * 1.0001, (rank, err, bound)


def _inter(r, op=None):
    ops = r["scoped"]["inter_node"]
    return sum(v["sent_bytes"] for k, v in ops.items() if op in (None, k))


def _intra(r, op=None):
    ops = r["scoped"]["intra_node"]
    return sum(v["sent_bytes"] for k, v in ops.items() if op in (None, k))


def test_hpz_is_lossless(results):
    ref = train_reference(ORACLE, WORLD)
    for rank in range(WORLD):
        assert_matches(ORACLE, results[rank]["oracle"], ref)


@pytest.mark.parametrize("key", list(SGD_RUNS))
def test_sgd_under_quantized_collectives_moves_as_far_as_one_process(results, key):
    """SGD's update is linear in the gradient, so the scale of the engine's update against one
    process's (the least-squares factor s in got - start = s (ref - start) + noise) shows a wrong
    1/N directly: 4 on 4 ranks for a sum. Rounding (qwZ: int8 weights, qgZ: int4 gradients in hop 1)
    is noise around s = 1, not a scale. Measured after 2 steps: qwZ s 0.994, drift 7.6% of the
    distance moved; qgZ s 0.957, drift 29%; qgZ summing instead of averaging: s 3.27, drift 260%."""
    from oracle import make_model

    case = SGD_RUNS[key]
    ref = train_reference(case, WORLD)
    start = {k: v.detach().float() for k, v in make_model(case).state_dict().items()}
    want = torch.cat([(ref[k] - start[k]).flatten() for k in ref])
    for rank in range(WORLD):
        got = torch.cat([(results[rank][key][k] - start[k]).flatten() for k in ref])
        scale = (got @ want / (want @ want)).item()
        drift = ((got - want).norm() / want.norm()).item()
        print(f"\n{key} rank {rank}: update scale {scale:.4f}, drift {drift:.2%} of the distance moved")
        assert abs(scale - 1) <= BOUND_SCALE and drift <= BOUND_DRIFT[key], (key, rank, scale, drift)


def test_hpz_halves_inter_node_gather_bytes_and_keeps_backward_in_the_node(results):
    for rank in range(WORLD):
        plain, hpz = results[rank]["plain"], results[rank]["hpz"]  # the last step of each
        assert _inter(hpz, "all_gather") * 2 == _inter(plain, "all_gather")
        phi = sum(sum(u) for u in hpz["units"])
        # backward: each unit gathered once inside the node, from 2 secondaries: phi elements
        assert hpz["scoped"]["intra_node"]["all_gather"]["elements"] == phi
        assert hpz["scoped"]["intra_node"]["all_gather"]["sent_bytes"] == phi * 4 // 2
        assert hpz["flat"]["all_gather"]["elements"] == plain["flat"]["all_gather"]["elements"]  # unchanged view
        assert plain["scoped"]["intra_node"]["all_gather"]["calls"] == 0


def test_hpz_secondary_partition_in_memory_stats(results):
    for rank in range(WORLD):
        plain, hpz = results[rank]["plain"], results[rank]["hpz"]
        phi = sum(sum(u) for u in hpz["units"])
        secondary = phi * hpz["itemsize"] // 2  # every unit's 1/hpz slice, all live at the end of forward
        assert hpz["mem"]["peak_params"] - plain["mem"]["peak_params"] == secondary
        assert hpz["mem"]["params"] == plain["mem"]["params"]  # dropped when the pass ends


@pytest.mark.parametrize("key", [pytest.param("qwz", marks=pytest.mark.slow), pytest.param("qgz", marks=pytest.mark.slow),
                                 "all"])
def test_loss_tracks_plain_stage3(results, key, request):
    runs = request.getfixturevalue("long_results") if key in LONG_RUNS else results
    plain, got = results[0]["plain"]["losses"], runs[0][key]["losses"]
    assert len(got) == STEPS and plain[-1] < 0.8 * plain[0]  # the task is learned
    worst = max(abs(a - b) / b for a, b in zip(got[3:], plain[3:]))
    tail = abs(sum(got[-5:]) - sum(plain[-5:])) / sum(plain[-5:])
    print(f"\n{key}: worst step |loss - plain| / plain {worst:.4f}, last-5 mean {tail:.4f}, "
          f"plain {plain[0]:.3f} -> {plain[-1]:.3f}, {key} -> {got[-1]:.3f}")
    assert worst <= LOSS_BOUND and tail <= LOSS_BOUND, (key, worst, tail)


@pytest.mark.parametrize("suffix", ["", "-bf16"])
def test_all_three_cut_inter_node_bytes_below_035(results, suffix):
    for rank in range(WORLD):
        plain, zpp = results[rank]["plain" + suffix], results[rank]["all" + suffix]
        ratio = _inter(zpp) / _inter(plain)
        if rank == 0:
            print(f"\ninter-node sent bytes per step{suffix}: stage 3 {_inter(plain):,}, all three {_inter(zpp):,} "
                  f"({ratio:.3f}x)")
        assert ratio <= 0.35, ratio
        assert _inter(zpp, "reduce_scatter") == 0 and zpp["flat"]["all_to_all"]["calls"] > 0


def test_quantized_bytes_are_payload_and_scales(results):
    from zeroshard.comm import plan_blocks

    r = results[0]["qwz"]
    # forward and backward gathers: int8 payload + one fp32 scale per block of each rank's shard
    expected = 0
    for unit in r["units"]:
        for padded in unit:
            b = plan_blocks(padded // WORLD, 8)
            expected += 2 * WORLD * b.wire_bytes
    assert r["scoped"]["inter_node"]["all_gather"]["bytes"] == expected
    q = results[0]["qgz"]
    hop1, hop2 = q["scoped"]["intra_node"]["all_to_all"], q["scoped"]["inter_node"]["all_to_all"]
    exp1 = exp2 = 0
    for unit in q["units"]:
        for padded in unit:
            exp1 += PER_NODE * plain_blocks(padded // PER_NODE).wire_bytes
            exp2 += (WORLD // PER_NODE) * plain_blocks(padded // WORLD).wire_bytes
    assert (hop1["bytes"], hop2["bytes"]) == (exp1, exp2)
    assert hop1["sent_bytes"] == exp1 // 2 and hop2["sent_bytes"] == exp2 // 2


def plain_blocks(n):
    from zeroshard.comm import QGZ_BITS, plan_blocks

    return plan_blocks(n, QGZ_BITS)


ZPP_OF = {"plain": {}, "hpz": {"hpz_partition_size": 2}, "qwz": {"quantized_weights": True},
          "qgz": {"quantized_gradients": True},
          "all": {"hpz_partition_size": 2, "quantized_weights": True, "quantized_gradients": True}}


def test_quantized_nontrainable_weights_quantize_only_frozen_units(results):
    for rank in range(WORLD):
        plain, frozen_q, all_q = (results[rank][k]["flat"]["all_gather"] for k in FROZEN)
        assert results[rank]["mlp"]["frozen_units"] > 0
        assert plain["elements"] == frozen_q["elements"] == all_q["elements"]  # the same gathers
        assert all_q["bytes"] < frozen_q["bytes"] < plain["bytes"]  # frozen ones int8, then all of them
    base = results[0]["mlp"]["losses"]
    assert max(abs(a - b) / b for a, b in zip(results[0]["mlp-frozen-q"]["losses"], base)) <= LOSS_BOUND


@pytest.mark.parametrize("key", list(RUNS))
def test_estimator_bytes_by_scope_equal_the_ledger(results, key):
    """`estimate_comm(..., layout=the engine's units)` on 2 nodes x 2: the sent bytes per scope and
    collective equal the ledger's last step exactly, and the hpZ secondary its memory."""
    from zeroshard.estimate import Strategy, estimate_comm, estimate_memory, shape_from_params
    from zeroshard.estimate.padding import plan_stage3_layout
    from zeroshard.policies import Precision

    precision = Precision.BF16 if key.endswith("bf16") else Precision.FP32
    strategy = Strategy(stage=3, precision=precision, optimizer="adamw", **ZPP_OF[key.replace("-bf16", "")])
    for rank in range(WORLD):
        r = results[rank][key]
        padded = [p for unit in r["units"] for p in unit]
        layout = plan_stage3_layout(padded, precision, WORLD)
        est = estimate_comm(sum(padded), strategy, WORLD // PER_NODE, PER_NODE, layout=layout)
        want = est.sent_by_scope()
        got = {scope: {op: v["sent_bytes"] for op, v in ops.items() if v["sent_bytes"]}
               for scope, ops in r["scoped"].items()}
        assert got == want, (key, rank)
        if strategy.hpz_partition_size > 1 and key == "hpz":
            mem = estimate_memory(shape_from_params(sum(padded)), strategy, WORLD, PER_NODE)
            plain = results[rank]["plain"]["mem"]["peak_params"]
            assert mem.hpz_secondary == r["mem"]["peak_params"] - plain


def test_hpz_size_that_does_not_divide_the_node_is_one_error():
    from zeroshard.comm import Topology
    from zeroshard.policies import ConfigError

    topo = Topology(0, 4, 0, 2, torch.device("cpu"), "none", False)
    with pytest.raises(ConfigError, match="zero_hpz_partition_size = 3 does not divide the 2 ranks per node"):
        topo.hierarchy(3, 10.0)
    # at start-up, on one process (LOCAL_WORLD_SIZE 1): the same error, before any training
    import zeroshard
    from oracle import config_for, make_model

    case = Case(stage=3, zero=NO_REUSE + HPZ)
    with pytest.raises(ConfigError, match="divisor of 1"):
        zeroshard.initialize(make_model(case), config_for(case, 1))


def test_estimate_cli_json_by_scope_against_the_ledger(results, capsys):
    """`zeroshard estimate --params 28032 --nodes 2 --gpus-per-node 2 --precision fp32 --json` (no unit
    layout: the model as one bucket): its stage-3 inter-node bytes per step equal the ledger's; its
    ZeRO++ row (qwZ + hpZ 2 + qgZ) is within 0.5% (quantization scales are per unit in the engine)."""
    import argparse
    import json

    from zeroshard.cli import estimate_cmd

    parser = argparse.ArgumentParser(prog="zeroshard")
    estimate_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate", "--params", "28032", "--nodes", "2", "--gpus-per-node", "2",
                              "--precision", "fp32", "--optimizer", "adamw", "--json"])
    assert args.func(args) == 0
    rows = {c["label"]: c["comm"]["sent_by_scope"] for c in json.loads(capsys.readouterr().out)["candidates"]}
    total = lambda scoped: {s: sum(v.values()) for s, v in scoped.items()}  # noqa: E731
    ledger = lambda key: total({s: {op: v["sent_bytes"] for op, v in ops.items()}  # noqa: E731
                                for s, ops in results[0][key]["scoped"].items()})
    assert total(rows["stage 3"]) == ledger("plain")
    est, got = total(rows["stage 3 qwZ+hpZ+qgZ"]), ledger("all")
    for scope in ("intra_node", "inter_node"):
        assert abs(est[scope] - got[scope]) <= 0.005 * got[scope], (scope, est, got)
