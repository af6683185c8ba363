"""Engines built without an optimizer (TRL's reference and reward models, OpenRLHF's eval
engines): at stage 3 they hold only the shards, allocate no gradient or optimizer memory,
gather unit by unit under no_grad, and cost nothing during the trainer's backward; at
stage 0 (TRL's rewrite of stages 1-2) they hold the whole model and cost no collective.
2 gloo ranks, DPO's interleaving: policy forward, reference forward, policy backward, step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from distributed import one_group, run_ranks
from oracle import MICRO, Case, assert_matches, batch, config_for, loss_of, make_model, train_reference

WORLD = 2
CASE = Case(stage=3, optimizer="sgd", steps=2,
            zero=(("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0)))


def _inference_config(stage: int, world_size: int) -> dict:
    cfg = config_for(CASE.with_(stage=stage), world_size)
    del cfg["optimizer"]  # TRL's prepare_deepspeed keeps the rest of the trainer's config
    return cfg


def _calls(engine, op: str) -> int:
    return engine.comm_stats().get(op, {}).get("calls", 0)


def _worker(rank, world_size):
    import zeroshard
    import zeroshard.deepspeed as deepspeed

    with one_group():
        policy = zeroshard.initialize(make_model(CASE), config_for(CASE, world_size))
        ref3, *_ = deepspeed.initialize(model=make_model(CASE), config=_inference_config(3, world_size))
        ref0 = zeroshard.initialize(make_model(CASE), _inference_config(0, world_size))
        ref3.eval()
        after_build = {name: e.memory_stats() for name, e in (("ref3", ref3), ("ref0", ref0))}
        ref3.reset_comm_stats()
        ref0.reset_comm_stats()
        quiet, logits, gathers, held = [], [], [], []
        for step in range(CASE.steps):
            x, y = batch(CASE, step, WORLD)
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = loss_of(policy, x[lo:hi], y[lo:hi])
            before = _calls(ref3, "all_gather")
            ref3.reset_memory_stats()
            with torch.no_grad() if step == 0 else contextlib.nullcontext():  # TRL: no_grad; others forget
                out3 = ref3(x[lo:hi])[0]
            gathers.append(_calls(ref3, "all_gather") - before)
            held.append((ref3.memory_stats()["params"], ref3.memory_stats()["peak_params"]))
            out0 = ref0(x[lo:hi])[0]  # grad enabled: the frozen model builds no graph
            logits.append((out3, out0))
            ref_comm = (ref3.comm_stats(), ref0.comm_stats())
            policy.backward(loss)
            policy.step()
            quiet.append(ref_comm == (ref3.comm_stats(), ref0.comm_stats()))
        errors = []
        for call in (lambda: ref3.backward(out3.sum()), lambda: ref0.step()):
            try:
                call()
            except zeroshard.ConfigError as exc:
                errors.append(str(exc))
        largest = max(u.numel for u in ref3.units) * 4
        ds = (isinstance(ref3, deepspeed.DeepSpeedEngine), isinstance(ref3, deepspeed.runtime.engine.DeepSpeedEngine),
              ref3.zero_optimization_stage(), ref3.get_global_grad_norm())
        return {"ds": ds, "held": held, "largest": largest, "state": policy.full_state_dict(), "quiet": quiet, "gathers": gathers, "units": len(ref3.units),
                "logits": logits, "mem": {"ref3": ref3.memory_stats(), "ref0": ref0.memory_stats()},
                "after_build": after_build, "shard_bytes": sum(b.shard().nbytes for b in ref3.frozen_buckets),
                "full_bytes": sum(p.ds_numel * 4 for p in ref3.module.parameters()),
                "grads": [p.grad is not None or p.requires_grad for e in (ref3, ref0) for p in e.module.parameters()],
                "errors": errors, "ref0_calls": sum(t["calls"] for t in ref0.comm_stats().values())}


def test_engines_without_optimizer_hold_shards_only_and_stay_quiet():
    results = run_ranks(_worker, WORLD, timeout=150)
    assert_matches(CASE, results[0]["state"], train_reference(CASE, WORLD))  # the policy trains as alone
    model = make_model(CASE).eval()
    for rank, r in enumerate(results):
        assert r["ds"] == (True, True, 3, None), r["ds"]  # as DeepSpeed's engine without optimizer
        assert all(r["quiet"]), "a reference engine issued a collective during the policy's backward"
        assert r["gathers"] == [r["units"]] * CASE.steps, "not one all-gather per unit per forward"
        # released after each forward; during it, the shards plus at most the unit in use and the next
        assert all(at == r["shard_bytes"] and peak <= at + 2 * r["largest"] for at, peak in r["held"]), r["held"]
        assert r["ref0_calls"] == 0, "a stage-0 inference engine issued collectives"
        for step, (out3, out0) in enumerate(r["logits"]):
            x, _ = batch(CASE, step, WORLD)
            with torch.no_grad():
                want = model(x[rank * MICRO:(rank + 1) * MICRO])[0]
            torch.testing.assert_close(out3, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(out0, want, rtol=1e-6, atol=1e-6)
        for name in ("ref3", "ref0"):
            for when in (r["after_build"][name], r["mem"][name]):
                assert when["grads"] == when["optimizer_states"] == 0, (name, when)
                assert when["peak_grads"] == when["peak_optimizer_states"] == 0, (name, when)
        assert r["mem"]["ref3"]["params"] == r["shard_bytes"] <= r["full_bytes"] // WORLD + 64, r
        assert r["mem"]["ref0"]["params"] == r["full_bytes"]  # stage 0: the whole model
        assert not any(r["grads"]), "an inference engine's parameter requires or holds a gradient"
        assert len(r["errors"]) == 2 and all("no optimizer" in e for e in r["errors"]), r["errors"]


def test_stage3_inference_engine_refuses_an_input_that_needs_a_gradient():
    import zeroshard

    engine = zeroshard.initialize(make_model(CASE), _inference_config(3, 1))
    x = torch.randn(2, 16, 32, requires_grad=True)
    with pytest.raises(zeroshard.ConfigError, match="torch.no_grad"):
        engine(x)
    engine.close()


# DeepSpeed's reuse defaults: once the order is recorded, units stay gathered from forward to backward
REUSE = Case(stage=3, optimizer="sgd", steps=2, zero=(("stage3_param_persistence_threshold", 0),))


def _empty_cache_worker(rank, world_size):
    import zeroshard.deepspeed as deepspeed

    with one_group():
        a, *_ = deepspeed.initialize(model=make_model(REUSE), config=config_for(REUSE, world_size))
        b, *_ = deepspeed.initialize(model=make_model(REUSE), config=config_for(REUSE, world_size))
        lo, hi = rank * MICRO, (rank + 1) * MICRO

        def train(step):
            x, y = batch(REUSE, step, WORLD)
            for engine in (a, b):
                engine.backward(loss_of(engine, x[lo:hi], y[lo:hi]))
                engine.step()

        train(0)  # records the gather order: from now on units are kept from forward to backward
        at_rest = a.memory_stats()["params"]
        x, y = batch(REUSE, 5, WORLD)
        loss_of(a, x[lo:hi], y[lo:hi])  # a forward with grad whose backward never comes
        held = a.memory_stats()["params"]
        a.empty_partition_cache()
        emptied = a.memory_stats()
        for step in range(1, REUSE.steps + 1):  # training goes on exactly as without the stray forward
            train(step)
        sa, sb = a.full_state_dict(), b.full_state_dict()
    return {"at_rest": at_rest, "held": held, "emptied": emptied, "same": all(torch.equal(sa[k], sb[k]) for k in sa)}


def test_empty_partition_cache_releases_units_kept_for_a_backward():
    for r in run_ranks(_empty_cache_worker, WORLD, timeout=120):
        assert r["held"] > r["at_rest"], "the forward kept nothing gathered: the test shows nothing"
        assert r["emptied"]["params"] == r["at_rest"] and r["emptied"]["comm_buffers"] == 0, r
        assert r["same"]
