"""Resuming a checkpoint DeepSpeed saved with its optimizer states on NVMe (stage 3,
`offload_optimizer: nvme`), without DeepSpeed.

The fixture stage3_fp32_nvme/ was made by real DeepSpeed 0.19.8 on its CPU accelerator with its
async_io op (tests/fixtures/deepspeed_ckpt/make_nvme.py): common.NvmeNet on 2 ranks, whose first
optimizer sub-group (270,336 fp32 elements per rank) DeepSpeed swapped to NVMe and whose second
(1,823) it kept in memory. So the optim_states files hold that first sub-group empty, and its
fp32 partition and Adam states are raw swap files in global_step3/offloaded_tensors/rankNN/.
DeepSpeed then resumed it and trained common.K more steps (stage3_fp32_nvme.json).

zeroshard reads the swap files: the masters equal what DeepSpeed saved, masters and Adam states
equal zeroshard's own after the same K steps, and resuming on 2 ranks at stage 3 and on 1 rank
at stage 2 trains like zeroshard's run that never stopped (fp32: 1e-5 relative). DeepSpeed's own
resume of the folder is not the reference: it restarts the lr warm-up and its masters after the
load are not the ones it saved. A missing rank folder, a truncated swap file and a swap folder of another
checkpoint: one clear error each.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from distributed import run_ranks
from test_deepspeed_migration import FIX, FP32_REL, _masters, _train, common

CASE = common.NVME_CASE


def record() -> dict:
    with open(os.path.join(FIX, CASE + ".json")) as f:
        return json.load(f)


def _config(world: int, stage: int) -> dict:
    cfg = json.loads(json.dumps(record()["config"]))
    cfg["zero_optimization"] = {"stage": stage}  # the states load into any configuration (here: no offload)
    cfg["train_micro_batch_size_per_gpu"] = common.WORLD * common.MICRO // world
    return cfg


def _resume(rank: int, world: int, stage: int, root: str) -> dict:
    import zeroshard

    engine = zeroshard.initialize(common.make_nvme_model(seed=common.SEED + 7), _config(world, stage))
    client = engine.load_checkpoint(root)
    loaded = _masters(engine)
    losses = _train(engine, rank, world, range(common.K, 2 * common.K))
    out = {"client": client, "loaded": loaded, "losses": losses, "final": _masters(engine),
           "steps": engine.global_steps}
    engine.close()
    return out


def _uninterrupted(rank: int, world: int, tmp: str) -> dict:
    """zeroshard trains the same model from the same weights on the same data for 2K steps
    without stopping; its state after K steps is saved to read Adam's states by name."""
    import zeroshard

    engine = zeroshard.initialize(common.make_nvme_model(), _config(world, 3))
    before = _train(engine, rank, world, range(common.K))
    engine.save_checkpoint(tmp)
    after = _train(engine, rank, world, range(common.K, 2 * common.K))
    out = {"before": before, "after": after, "final": _masters(engine)}
    engine.close()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("uninterrupted"))
    return {**run_ranks(_uninterrupted, 2, tmp, timeout=600)[0], "dir": tmp}


def _close(got, want, what: str) -> float:
    got, want = torch.as_tensor(got).flatten(), torch.as_tensor(want).flatten()
    diff = (got - want).abs().max().item()
    assert diff <= FP32_REL * max(want.abs().max().item(), 1e-3), (what, diff)
    return diff


def test_the_saved_state_is_the_one_training_reaches(reference):
    """DeepSpeed's K steps before the save equal zeroshard's (losses), and the masters and Adam
    states zeroshard reads from the optim_states files and the swap files equal zeroshard's own
    after the same K steps: the swap files are mapped to the right parameters and ranges."""
    from zeroshard.checkpoint import CheckpointReader
    from zeroshard.checkpoint.deepspeed_reader import DeepSpeedCheckpoint

    _close(reference["before"], record()["losses_before_save"], "losses before the save")
    with DeepSpeedCheckpoint(os.path.join(FIX, CASE)) as ds, CheckpointReader(reference["dir"]) as zs:
        assert ds._offloaded is not None and ds._offloaded.swapped == [0]  # the big sub-group only
        for name, e in record()["saved"].items():
            assert torch.equal(ds.read(name), torch.tensor(e["value"])), name  # DeepSpeed's own view
            for field in ("value", "optim.exp_avg", "optim.exp_avg_sq"):
                _close(ds.read(name, field), zs.read(name, field), f"{name} {field}")
            assert [float(s) for s in ds.scalars(name, "optim.step")] == [float(common.K)] * 2


@pytest.mark.parametrize("world, stage", [(2, 3), (1, 2)])
def test_resumes_like_the_uninterrupted_run(world, stage, reference):
    """Resumed from DeepSpeed's folder, zeroshard trains like the run that never stopped.
    (DeepSpeed 0.19.8's own resume of this folder, recorded in the JSON, does not: its first lr
    after the load is warmup_min_lr and its masters after the load differ from those it saved,
    so its losses_after_resume are not the reference.)"""
    rec = record()
    got = run_ranks(_resume, world, stage, os.path.join(FIX, CASE), timeout=600)[0]
    for name, e in rec["saved"].items():
        assert torch.equal(got["loaded"][name].flatten(), torch.tensor(e["value"])), name
    assert got["client"] == rec["client_state"] and got["steps"] == 2 * common.K
    loss = _close(got["losses"], reference["after"], "losses after the resume")
    param = max(_close(got["final"][n], reference["final"][n], n) for n in reference["final"])
    print(f"\nNVMe checkpoint, {world} rank(s) at stage {stage}: losses {loss:.2e}, params {param:.2e} from the "
          "uninterrupted run")


def test_one_clear_error_each(tmp_path):
    from zeroshard.checkpoint.deepspeed_reader import DeepSpeedCheckpoint
    from zeroshard.policies import CheckpointError

    def error(root: str) -> str:
        with pytest.raises(CheckpointError) as err:
            with DeepSpeedCheckpoint(root) as r:
                for name in r.where:
                    r.read(name), r.read(name, "optim.exp_avg")
        assert "\n" not in str(err.value)
        return str(err.value)

    root = str(tmp_path / "a")
    shutil.copytree(os.path.join(FIX, CASE), root)
    swap = os.path.join(root, "global_step3", "offloaded_tensors")
    shutil.rmtree(os.path.join(swap, "rank01"))
    assert "rank01: missing" in error(root) and "incomplete" in error(root)

    shutil.rmtree(root)
    shutil.copytree(os.path.join(FIX, CASE), root)
    victim = next(os.path.join(swap, "rank00", f) for f in sorted(os.listdir(os.path.join(swap, "rank00")))
                  if f.startswith("exp_avg-"))
    with open(victim, "r+b") as f:
        f.truncate(1000)
    text = error(root)
    assert victim in text and "truncated" in text

    shutil.rmtree(root)
    shutil.copytree(os.path.join(FIX, CASE), root)
    first = next(f for f in os.listdir(os.path.join(swap, "rank00")) if f[0].isdigit())
    shutil.copy(os.path.join(swap, "rank00", first), os.path.join(swap, "rank00", "999_1000.tensor.swp"))
    text = error(root)
    assert "2 fp32 swap file(s)" in text and "not this checkpoint's" in text
