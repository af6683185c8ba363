"""The optimizer steps during backward (stages 0-3, no clipping, no fp16): each sub-group as
soon as the reductions of all its buckets have landed, overlapping the rest of backward.

It must change when the update happens and nothing else: the parameters after training equal,
bit for bit, those of the same run stepping after backward, and the oracle holds. Several
buckets per sub-group (3,000-element buckets, 9,000-element sub-groups) so a sub-group that
stepped before all its buckets were reduced would be seen."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from oracle import MICRO, Case, assert_matches, batch, config_for, loss_of, make_model, train_engine, train_reference

WORLD = 2
SUB_GROUP = (("sub_group_size", 9000),)
# stage 3: units released after forward and gathered again in backward (the early steps run
# between those gathers); the tiny GPT's tied embedding is one unit used at both ends
NO_REUSE = (("stage3_max_reuse_distance", 0), ("stage3_prefetch_bucket_size", 4000))
CASES = [Case(stage=s, optimizer="adamw", gas=2, zero=SUB_GROUP) for s in (0, 1, 2)]
CASES.append(Case(stage=2, optimizer="sgd", gas=1, zero=SUB_GROUP))
CASES.append(Case(stage=3, optimizer="adamw", gas=2, steps=3, zero=SUB_GROUP + NO_REUSE))
CASES.append(Case(stage=3, optimizer="sgd", gas=1, steps=3, zero=SUB_GROUP))
# bf16: the two modes must still be bit-equal; the oracle's fp32 bounds do not apply
CASES.append(Case(stage=3, optimizer="adamw", gas=1, steps=3, precision="bf16", zero=SUB_GROUP + NO_REUSE))


def _with(case: Case, early: bool) -> Case:
    return case.with_(zero=case.zero + (("zeroshard.step_during_backward", early),))


def _moves_during_backward(case: Case, rank: int, world_size: int) -> list[bool]:
    """Per micro-step of the first step: did the parameters change inside engine.backward()?"""
    import zeroshard

    engine = zeroshard.initialize(make_model(case), config_for(case, world_size))
    moved = []
    for m in range(case.gas):
        x, y = batch(case, m, world_size)
        loss = loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(loss)
        moved.append(any(not torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters())))
        engine.step()
    mode = (engine.step_early, engine.step_mode)
    engine.close()
    return moved, mode


def _worker(rank: int, world_size: int, cases: list[Case]):
    dist.init_process_group("gloo")
    out = []
    for case in cases:
        states = {}
        for early in (True, False):
            engine, _ = train_engine(_with(case, early), rank, world_size)
            states[early] = engine.full_state_dict()
            engine.close()
        out.append((states, _moves_during_backward(_with(case, True), rank, world_size),
                    _moves_during_backward(_with(case, False), rank, world_size)))
    return out


@pytest.fixture(scope="module")
def results():
    ranks = run_ranks(_worker, WORLD, CASES, timeout=300)
    return {case: ranks[0][i] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"z{c.stage}-{c.optimizer}-gas{c.gas}-{c.precision}")
def test_same_parameters_as_stepping_after_backward(case: Case, results):
    states, (moved_early, mode_early), (moved_after, mode_after) = results[case]
    assert mode_early[0] and "during backward" in mode_early[1]
    assert not mode_after[0] and "step_during_backward = false" in mode_after[1]
    # only the boundary micro-step's backward updates parameters, and only when stepping early
    assert moved_early == [False] * (case.gas - 1) + [True]
    assert moved_after == [False] * case.gas
    for name, value in states[False].items():
        assert torch.equal(states[True][name], value), f"{name} differs between the two step modes"
    if case.precision == "fp32":
        assert_matches(case, states[True], train_reference(case, WORLD))


def _mode(config_extra: dict, stage: int = 2):
    import zeroshard

    cfg = config_for(Case(stage=stage, optimizer="adamw"), 1)
    cfg["zero_optimization"].update(config_extra.pop("zero_optimization", {}))
    cfg.update(config_extra)
    engine = zeroshard.initialize(make_model(Case(stage=stage)), cfg)
    try:
        return engine.step_early, engine.step_mode
    finally:
        engine.close()


@pytest.mark.parametrize("extra, why", [
    ({"gradient_clipping": 1.0}, "needs the global norm first"),
    ({"fp16": {"enabled": True}}, "fp16 loss scaling"),
])
def test_falls_back_after_backward_and_says_why(extra, why):
    early, mode = _mode(extra, stage=2)
    assert not early and mode.startswith("after backward") and why in mode


@pytest.mark.parametrize("stage", [2, 3])
def test_default_steps_during_backward_where_nothing_forbids_it(stage):
    early, mode = _mode({}, stage=stage)
    assert early and mode.startswith("during backward")


def test_both_nvme_tiers_step_during_backward(tmp_path):
    """Issue 24: parameters and optimizer states in files step during backward too (the
    parameter read-ahead and the updates are ordered in offload/read_ahead.py)."""
    where = {"device": "nvme", "nvme_path": str(tmp_path)}
    early, mode = _mode({"zero_optimization": {"offload_param": dict(where), "offload_optimizer": dict(where)}},
                        stage=3)
    assert early and mode.startswith("during backward")


def test_asking_for_it_where_it_cannot_run_is_one_clear_error():
    from zeroshard.policies import ConfigError

    with pytest.raises(ConfigError, match="step_during_backward = true cannot be honoured: gradient_clipping"):
        _mode({"gradient_clipping": 1.0, "zeroshard": {"step_during_backward": True}})
