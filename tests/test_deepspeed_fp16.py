"""Resuming fp16 checkpoints that real DeepSpeed wrote (issue 27): stages 0-3, Adam, 2 gloo
ranks, dynamic loss scaling. The fixtures are tests/fixtures/deepspeed_ckpt/stage{0,1,2,3}_fp16,
made by make_fixtures.py with DeepSpeed 0.18.9 on its CPU accelerator. DeepSpeed's CPU
accelerator trains fp16 where torch's oneDNN has fp16 kernels
(`torch.ops.mkldnn._is_mkldnn_fp16_supported()`, i.e. AVX512-FP16 or AMX-FP16). Its run:
3 steps, a save (the dynamic scale has gone 1024 -> 2048), a resume, then 3 more steps (the
scale reaches 4096).

zeroshard resumes the same folders, through the drop-in engine on 2 ranks and through the
native Engine on 1 and 3 ranks at other stages. The loaded fp32 masters and Adam states are
checked for bit equality with DeepSpeed's. The loss scale must carry over: it is 2048 after the
load and 4096 after the 3 steps, as DeepSpeed's is. The trajectory must stay within these bounds:

- Stages 1-3 (DeepSpeed's ZeRO optimizers). fp16 keeps 11 significant bits, so one ulp is
  9.8e-4 relative. Losses get 2e-3 relative (2 ulp). Parameters get 5e-3 absolute, about one
  Adam step at these learning rates (2.8e-3 to 4.6e-3): an element whose gradient is near zero
  can flip the sign of its update when the fp16 gradients round differently. A mapping bug moves a
  parameter by a whole element's difference, about 0.1-1. Measured: losses 5.9e-4, parameters
  1.7e-3.
- Stage 0 (FP16_UnfusedOptimizer). The masters and states load bit-equal, and the first loss
  after the load agrees to 7.5e-5. DeepSpeed's Adam moments at stage 0 are far smaller than at
  stage 1 on the same data: mean |exp_avg| of fc1.weight is 7.45e-6 against 6.60e-3 (1/885), and
  exp_avg_sq is 9.9e-11 against 7.55e-5 (1/885 squared). After DeepSpeed's first step from a
  fresh model, exp_avg at stage 1 over exp_avg at stage 0 is 949.2 for every element. That is
  1024 / 1.0788: stage 1 clips a gradient of norm 1.0788 to 1, while stage 0 steps Adam on the
  gradient divided by the loss scale 1024 once too often, which is then too small to clip. Its first update from a
  fresh model is also 0.742 of stage 1's, which is Adam at step 2: `initialize_optimizer_states`
  takes one step with zero gradients. zeroshard steps on the true gradients, which swamp those
  tiny moments, so its first update after the load is 0.54 x lr on every element (Adam at
  step 5 with fresh moments). DeepSpeed's is not. The losses then part by 4.8e-3 and the
  parameters by 1.25e-2. The bounds here are 1e-2 for the loss and 3e-2 for parameters, still
  well below what a mapping bug gives.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import test_deepspeed_migration as migration
from distributed import one_group, run_ranks

pytestmark = pytest.mark.recorded  # compares with what DeepSpeed computed on another machine

common, record, FIX = migration.common, migration.record, migration.FIX
CASES = ["stage0_fp16", "stage1_fp16", "stage2_fp16", "stage3_fp16"]
ZERO_LOSS, ZERO_PARAM = 2e-3, 5e-3
STAGE0_LOSS, STAGE0_PARAM = 1e-2, 3e-2


def _bounds(case: str) -> tuple[float, float]:
    return (STAGE0_LOSS, STAGE0_PARAM) if record(case)["stage"] == 0 else (ZERO_LOSS, ZERO_PARAM)


def _resume(rank: int, world: int, cases: list[str]) -> dict:
    """Each case through zeroshard.deepspeed.initialize + load_checkpoint: the masters just
    loaded, the loss scale then and after K steps, the losses and the final parameters."""
    import zeroshard.deepspeed as deepspeed

    with one_group():
        out = {}
        for case in cases:
            rec = record(case)
            model = common.make_model(seed=common.SEED + 7)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=common.trainable(model),
                                                   config=json.loads(json.dumps(rec["config"])))
            engine.load_checkpoint(os.path.join(FIX, case))
            loaded, scale_loaded = migration._masters(engine), engine.loss_scale
            losses = migration._train(engine, rank, world, range(common.K, 2 * common.K))
            out[case] = {"loaded": loaded, "scale_loaded": scale_loaded, "scale_final": engine.loss_scale,
                         "losses": losses, "final": migration._masters(engine), "skipped": engine.skipped_steps}
            engine.destroy()
    return out


def _distance(case: str, got: dict) -> tuple[float, float]:
    rec = record(case)
    want = torch.tensor(rec["losses_after_resume"])
    loss_rel = ((torch.tensor(got["losses"]) - want).abs() / want.abs()).max().item()
    param = max((got["final"][n].flatten() - torch.tensor(v)).abs().max().item() for n, v in rec["final"].items())
    return loss_rel, param


@pytest.fixture(scope="module")
def resumed():
    return run_ranks(_resume, 2, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_fp16_resume_matches_deepspeed_on_two_ranks(resumed, case):
    got, rec = resumed[0][case], record(case)
    assert rec["dtype"] == "fp16" and rec["deepspeed_version"].startswith("0.18")
    migration._check_loaded(case, got["loaded"])  # the fp32 masters, bit for bit
    assert got["scale_loaded"] == rec["loss_scale_at_save"] == 2048.0
    assert got["scale_final"] == rec["loss_scale_final"] == 4096.0 and got["skipped"] == 0
    loss_bound, param_bound = _bounds(case)
    loss_rel, param = _distance(case, got)
    assert loss_rel <= loss_bound, (case, got["losses"], rec["losses_after_resume"])
    assert param <= param_bound, (case, param)
    for name in rec["final"]:  # both ranks end with the same parameters
        assert torch.equal(resumed[1][case]["final"][name], got["final"][name])


@pytest.mark.parametrize("world, plan", [(1, [("stage1_fp16", 3), ("stage3_fp16", 0)]),
                                         (3, [("stage2_fp16", 1), ("stage0_fp16", 2)])])
def test_fp16_loads_on_other_world_sizes_and_stages(tmp_path, world, plan):
    """The native Engine on 1 and 3 ranks at another stage: masters and Adam states exactly
    DeepSpeed's (through a zeroshard save of the loaded state), then the trajectory bounds."""
    results = run_ranks(migration._resume_native, world, plan, str(tmp_path), timeout=600)
    for case, stage in plan:
        got = results[0][f"{case}>{stage}"]
        migration._check_loaded(case, got["loaded"])
        from zeroshard.checkpoint import CheckpointReader

        with CheckpointReader(got["again"]) as saved:
            for name, e in record(case)["saved"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(saved.read(name, f"optim.{key}"), torch.tensor(e[key])), (case, name, key)
        loss_bound, param_bound = _bounds(case)
        loss_rel, param = _distance(case, got)
        assert loss_rel <= loss_bound and param <= param_bound, (case, stage, loss_rel, param)
