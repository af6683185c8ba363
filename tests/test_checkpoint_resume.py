"""Checkpoints on real gloo ranks: bit-exact resume, and resharding to other layouts.

One spawn of 2 ranks runs every 2-rank scenario (spawning costs seconds); the world
size 1 loads run in this process. Stage 3 runs a model with frozen parameters inside its
units (sharded at rest) beside trainable units and small whole ("persistent") buckets.
Engines that load start from scrambled weights, so every value must come from the file.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model

K, M = 3, 3  # steps before the save, steps after the load
ADAM = Case(model="gpt", optimizer="adamw")
FROZEN = Case(model="gpt-ckpt-nonreentrant", optimizer="adamw")  # each block's MLP c_fc frozen
SMALL_WHOLE = (("stage3_param_persistence_threshold", 100),)  # stage 3: units and persistent buckets
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}}


def config(stage: int, world_size: int, bucket: int = 3000, micro: int = MICRO, case: Case = ADAM) -> dict:
    cfg = config_for(case.with_(stage=stage, zero=SMALL_WHOLE if stage == 3 else ()), world_size)
    cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["scheduler"] = SCHEDULER
    return cfg


def train(engine, steps: range, rank: int, world_size: int, per_rank: int = MICRO) -> list[float]:
    """Steps over the global batches of the oracle; this rank's rows only."""
    losses = []
    for step in steps:
        x, y = batch(ADAM, step, 2)  # the global batch of the 2-rank run, whatever the world size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_of(engine, x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def scrambled(case: Case) -> torch.nn.Module:
    """The model with every parameter and buffer overwritten (the same on every rank)."""
    model = make_model(case)
    torch.manual_seed(99)
    with torch.no_grad():
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.normal_()
    return model


def full_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {"value"}} for every state-dict entry (frozen parameters and buffers too) and
    {"exp_avg", "exp_avg_sq"} of trainable ones, whole, from every rank's shards, plus
    {"": {"step": [...]}} the per-shard Adam step counters of this rank."""
    opt = engine.optimizer
    out: dict[str, dict[str, torch.Tensor]] = {name: {"value": t} for name, t in engine.full_state_dict().items()}
    steps = []
    for bucket, master in zip(engine.buckets, opt.masters):
        state = opt.state.get(master, {})
        fields = {k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state}
        if "step" in state:
            steps.append(float(state["step"]))
        for key, shard in fields.items():
            full = shard
            if bucket.layout.shard_count > 1:
                full = torch.empty(bucket.layout.padded_numel)
                dist.all_gather_into_tensor(full, shard.contiguous())
            for slot in bucket.slots:
                out.setdefault(slot.name, {})[key] = full[slot.offset : slot.end].clone()
    out[""] = {"step": torch.tensor(steps)}
    return out


def _worker(rank, world_size, root):
    import zeroshard

    dist.init_process_group("gloo")
    out = {}
    for stage in (1, 2):
        whole = zeroshard.initialize(make_model(ADAM), config(stage, world_size))
        out[f"uninterrupted{stage}"] = train(whole, range(K + M), rank, world_size)
        whole.close()

        first = zeroshard.initialize(make_model(ADAM), config(stage, world_size))
        train(first, range(K), rank, world_size)
        if stage == 2:
            out["states_at_save"] = full_states(first)
            out["saved_layout"] = [b.layout.padded_numel for b in first.buckets]
        first.save_checkpoint(f"{root}/s{stage}", client_state={"epoch": 7, "stage": stage})
        first.close()

        resumed = zeroshard.initialize(make_model(ADAM), config(stage, world_size))
        out[f"client{stage}"] = resumed.load_checkpoint(f"{root}/s{stage}")
        out[f"counters{stage}"] = [resumed.global_steps, resumed.micro_steps, resumed.get_lr()]
        out[f"resumed{stage}"] = train(resumed, range(K, K + M), rank, world_size)
        resumed.close()

    # reshard: the stage 2 checkpoint into stage 1 with other bucket sizes (other padding too)
    other = zeroshard.initialize(make_model(ADAM), config(1, world_size, bucket=1000))
    out["layout"] = [b.layout.padded_numel for b in other.buckets]
    other.load_checkpoint(f"{root}/s2")
    out["states_stage1"] = full_states(other)
    out["reshard_stage1"] = train(other, range(K, K + M), rank, world_size)
    other.close()

    # reshard: the stage 2 checkpoint into stage 3 (unit and persistent buckets)
    other = zeroshard.initialize(scrambled(ADAM), config(3, world_size))
    out["stage3_layout"] = [(len(other.units), len(other.params.persistent))]
    other.load_checkpoint(f"{root}/s2")
    out["states_stage3"] = full_states(other)
    out["reshard_stage3"] = train(other, range(K, K + M), rank, world_size)
    # resume in place at stage 3: save, train, load, train the same steps again
    other.save_checkpoint(f"{root}/s3-gpt")
    out["s3_gpt_first"] = train(other, range(K + M, K + 2 * M), rank, world_size)
    other.load_checkpoint(f"{root}/s3-gpt")
    out["s3_gpt_again"] = train(other, range(K + M, K + 2 * M), rank, world_size)
    other.close()

    # stage 3 with frozen parameters sharded at rest: resume into a fresh (scrambled) engine
    whole = zeroshard.initialize(make_model(FROZEN), config(3, world_size, case=FROZEN))
    out["uninterrupted3"] = train(whole, range(K + M), rank, world_size)
    whole.close()
    first = zeroshard.initialize(make_model(FROZEN), config(3, world_size, case=FROZEN))
    out["frozen_buckets"] = len(first.frozen_buckets)
    train(first, range(K), rank, world_size)
    out["states_at_save3"] = full_states(first)
    first.save_checkpoint(f"{root}/s3", client_state={"epoch": 7, "stage": 3})
    first.close()
    resumed = zeroshard.initialize(scrambled(FROZEN), config(3, world_size, case=FROZEN))
    out["client3"] = resumed.load_checkpoint(f"{root}/s3")
    out["counters3"] = [resumed.global_steps, resumed.micro_steps, resumed.get_lr()]
    out["states_loaded3"] = full_states(resumed)
    out["resumed3"] = train(resumed, range(K, K + M), rank, world_size)
    resumed.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return run_ranks(_worker, 2, str(root), timeout=240), root


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_bit_exact(runs, stage):
    results, _ = runs
    for rank, r in enumerate(results):
        assert r[f"resumed{stage}"] == r[f"uninterrupted{stage}"][K:], (
            f"rank {rank}: resumed {r[f'resumed{stage}']} vs uninterrupted {r[f'uninterrupted{stage}'][K:]}")
        assert r[f"client{stage}"] == {"epoch": 7, "stage": stage}
        steps, micro, _ = r[f"counters{stage}"]
        assert (steps, micro) == (K, K)


def _assert_states_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, fields in want.items():
        if name == "":
            continue
        assert set(got[name]) == set(fields), name
        for key, tensor in fields.items():
            assert torch.equal(got[name][key], tensor), f"{name}.{key} differs after resharding"


def test_reshard_stage2_to_stage1_other_buckets(runs):
    results, _ = runs
    for r in results:
        _assert_states_equal(r["states_stage1"], r["states_at_save"])
        assert set(r["states_stage1"][""]["step"].tolist()) == {float(K)}
        for got, want in zip(r["reshard_stage1"], r["uninterrupted2"][K:]):
            assert abs(got - want) <= 1e-6, (r["reshard_stage1"], r["uninterrupted2"][K:])
    assert results[0]["layout"] != results[0]["saved_layout"]  # the layouts really differ


def test_reshard_stage2_on_two_ranks_to_stage0_on_one(runs):
    import zeroshard

    results, root = runs
    engine = zeroshard.initialize(make_model(ADAM), config(0, 1, bucket=5000, micro=2 * MICRO))
    assert engine.load_checkpoint(root / "s2") == {"epoch": 7, "stage": 2}
    _assert_states_equal(full_states(engine), results[0]["states_at_save"])
    losses = train(engine, range(K, K + M), 0, 1, per_rank=2 * MICRO)
    reference = [(a + b) / 2 for a, b in zip(results[0]["uninterrupted2"][K:], results[1]["uninterrupted2"][K:])]
    for got, want in zip(losses, reference):
        assert abs(got - want) <= 1e-6, (losses, reference)
    assert engine.global_steps == K + M


def test_stage3_resume_restores_frozen_sharded_parameters(runs):
    results, _ = runs
    for r in results:
        assert r["frozen_buckets"] == 2  # c_fc of each block, sharded at rest
        _assert_states_equal(r["states_loaded3"], r["states_at_save3"])
        assert torch.equal(r["states_loaded3"]["h.0.mlp.c_fc.weight"]["value"],
                           make_model(FROZEN).state_dict()["h.0.mlp.c_fc.weight"])  # frozen: as built


def test_stage3_resume_in_place_is_bit_exact(runs):
    results, _ = runs
    for r in results:
        assert r["s3_gpt_again"] == r["s3_gpt_first"]


def test_reshard_stage2_to_stage3(runs):
    results, _ = runs
    for r in results:
        units, persistent = r["stage3_layout"][0]
        assert units > 1 and persistent > 0  # units sharded at rest and whole buckets both loaded
        _assert_states_equal(r["states_stage3"], r["states_at_save"])
        assert set(r["states_stage3"][""]["step"].tolist()) == {float(K)}
        for got, want in zip(r["reshard_stage3"], r["uninterrupted2"][K:]):
            assert abs(got - want) <= 1e-6, (r["reshard_stage3"], r["uninterrupted2"][K:])


def test_reshard_stage3_on_two_ranks_to_stage0_on_one(runs):
    import zeroshard

    results, root = runs
    engine = zeroshard.initialize(scrambled(FROZEN), config(0, 1, bucket=5000, micro=2 * MICRO, case=FROZEN))
    assert engine.load_checkpoint(root / "s3") == {"epoch": 7, "stage": 3}
    _assert_states_equal(full_states(engine), results[0]["states_at_save3"])
    losses = train(engine, range(K, K + M), 0, 1, per_rank=2 * MICRO)
    reference = [(a + b) / 2 for a, b in zip(results[0]["uninterrupted3"][K:], results[1]["uninterrupted3"][K:])]
    for got, want in zip(losses, reference):
        assert abs(got - want) <= 1e-6, (losses, reference)
    assert engine.global_steps == K + M
