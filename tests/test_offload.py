"""ZeRO-Offload (issue 10): optimizer states (stages 1-3) and parameter shards (stage 3) on the
host tier. On this CPU-only machine host and device are the same memory, so an offloaded
run must equal the same run without offload bit for bit, train like one process (the
oracle), and the ledger must put every byte on the tier where it belongs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from oracle import MICRO, Case, assert_matches, batch, config_for, loss_of, make_model, train_reference

WORLD = 2
NO_REUSE = (("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0))
OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
BOTH = {**OPT, "offload_param": {"device": "cpu", "pin_memory": True}}

# (case, offload keys): every case also runs without offload, and the two must be equal
CASES = [
    (Case(stage=1, optimizer="sgd"), OPT),
    (Case(stage=2, optimizer="adamw"), OPT),
    (Case(stage=2, optimizer="sgd", gas=2, clip=0.5), OPT),
    (Case(stage=3, optimizer="sgd", zero=NO_REUSE), OPT),
    (Case(stage=3, optimizer="sgd", zero=NO_REUSE), BOTH),
    (Case(stage=3, optimizer="adamw", gas=2, clip=0.5, zero=NO_REUSE), BOTH),
    (Case(model="mlp", stage=2, optimizer="adamw"), OPT),
    (Case(model="lora", stage=3, optimizer="sgd", zero=NO_REUSE), BOTH),
    (Case(stage=3, optimizer="adamw", precision="bf16", zero=NO_REUSE), BOTH),
    (Case(stage=3, optimizer="adamw", zero=NO_REUSE), {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
]


def _config(case: Case, offload: dict | None):
    cfg = config_for(case, WORLD)
    cfg["zero_optimization"].update(offload or {})
    return cfg


def _train(case: Case, rank: int, world: int, cfg: dict):
    import zeroshard

    engine = zeroshard.initialize(make_model(case), cfg)
    for step in range(case.steps):
        for m in range(case.gas):
            x, y = batch(case, step * case.gas + m, world)
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            engine.backward(loss_of(engine, x[lo:hi], y[lo:hi]))
            engine.step()
    return engine


def _worker(rank, world, cases):
    dist.init_process_group("gloo")
    out = []
    for case, offload in cases:
        engine = _train(case, rank, world, _config(case, offload))
        stats = engine.memory_stats()
        host_share = sum(m.numel() for m, t in zip(engine.optimizer.masters, engine.optimizer.tiers)
                         if t.name == "host") / sum(m.numel() for m in engine.optimizer.masters)
        offloaded = engine.full_state_dict()
        engine.close()
        plain = _train(case, rank, world, _config(case, None))
        out.append({"offloaded": offloaded, "plain": plain.full_state_dict(), "stats": stats,
                    "plain_stats": plain.memory_stats(), "host_share": host_share})
        plain.close()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, CASES, timeout=600)


def _id(item):
    case, offload = item
    what = "+".join(k.split("_")[1] for k in offload) + ("-ratio" if "ratio" in offload.get("offload_optimizer", {}) else "")
    return f"{case.model}-z{case.stage}-{case.optimizer}-gas{case.gas}-{case.precision}-{what}"


@pytest.mark.parametrize("i", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_offload_trains_like_one_process_and_equals_no_offload(i, results):
    case, _ = CASES[i]
    if case.precision == "fp32":
        ref = train_reference(case, WORLD)
    for r in (rank[i] for rank in results):
        if case.precision == "fp32":
            assert_matches(case, r["offloaded"], ref)
        for name, value in r["plain"].items():  # same memory, same arithmetic: bit for bit
            assert torch.equal(r["offloaded"][name], value), name


@pytest.mark.parametrize("i", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_every_byte_is_counted_on_its_tier(i, results):
    case, offload = CASES[i]
    for r in (rank[i] for rank in results):
        s, p = r["stats"], r["plain_stats"]
        # the same bytes as without offload, only on other tiers
        assert s["model_states"] == p["model_states"] and p["tier_host"] == 0
        host = s["tier_host"]
        expected = s["optimizer_states"] * r["host_share"] + (s["params"] if "offload_param" in offload else 0)
        if r["host_share"] == 1.0:
            assert host == expected, (host, expected)
        else:  # ratio: the first half of the elements; the rest stays on the device
            assert 0.3 <= r["host_share"] <= 0.7 and 0 < host < s["optimizer_states"]
        assert s["tier_device"] + host == s["model_states"] + s["comm_buffers"]


# -- checkpoints move between offload settings, stages and world sizes -----------------------
def _steps(engine, case, rank, world, steps):
    for step in steps:
        x, y = batch(case, step, world)
        engine.backward(loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()


def _save_resume(rank, world, root):
    """A: 3 steps with offload, save, 2 more. B: no offload at stage 1, loads A's step 3, 2 more.
    C: the reverse direction. All fp32: the end states must be equal exactly."""
    import zeroshard

    dist.init_process_group("gloo")
    case = Case(stage=3, optimizer="adamw", steps=5, zero=NO_REUSE)
    a = zeroshard.initialize(make_model(case), _config(case, BOTH))
    b_case = Case(stage=1, optimizer="adamw", steps=5)
    out = {}
    _steps(a, case, rank, world, range(3))
    a.save_checkpoint(f"{root}/offloaded")
    _steps(a, case, rank, world, range(3, 5))
    out["a"] = a.full_state_dict()
    a.close()
    b = zeroshard.initialize(make_model(b_case), _config(b_case, None))
    b.load_checkpoint(f"{root}/offloaded")
    b.save_checkpoint(f"{root}/plain")
    _steps(b, case, rank, world, range(3, 5))
    out["b"] = b.full_state_dict()
    b.close()
    c = zeroshard.initialize(make_model(case), _config(case, BOTH))
    c.load_checkpoint(f"{root}/plain")
    _steps(c, case, rank, world, range(3, 5))
    out["c"] = c.full_state_dict()
    c.close()
    return out


def test_checkpoints_reshard_between_offload_settings_and_stages(tmp_path):
    for r in run_ranks(_save_resume, WORLD, str(tmp_path), timeout=300):
        for name in r["a"]:
            assert torch.equal(r["a"][name], r["b"][name]), f"offloaded stage 3 -> stage 1: {name}"
            assert torch.equal(r["a"][name], r["c"][name]), f"stage 1 -> offloaded stage 3: {name}"


# -- world size 1: "one GPU with offload" ----------------------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_a_single_process_with_offload_trains_like_plain_torch(stage, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    case = Case(stage=stage, optimizer="adamw", zero=NO_REUSE if stage == 3 else ())
    engine = _train(case, 0, 1, {**_config(case, BOTH if stage == 3 else OPT),
                                 "train_batch_size": MICRO})
    assert engine.world_size == 1 and engine.memory_stats()["tier_host"] >= engine.memory_stats()["optimizer_states"]
    assert_matches(case, engine.full_state_dict(), train_reference(case, 1))
    engine.close()
