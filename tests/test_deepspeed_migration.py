"""Resuming checkpoints that real DeepSpeed wrote (tests/fixtures/deepspeed_ckpt, made by
make_fixtures.py with DeepSpeed 0.18 on its CPU accelerator, 2 gloo ranks).

Each fixture: DeepSpeed trained common.K steps and saved; then DeepSpeed itself resumed and
trained K more, recording its losses and final fp32 parameters (<case>.json). Here zeroshard
resumes the same folder and trains the same K steps on the same data:

- on 2 ranks at the saved stage, through the DeepSpeed drop-in (`zeroshard.deepspeed`)
  engine's `load_checkpoint`: losses and parameters equal DeepSpeed's (fp32: 1e-5 relative;
  bf16: see BF16_LOSS / BF16_PARAM);
- on 1 and 3 ranks and at another stage, through the native Engine's `load_checkpoint`: the
  loaded masters and Adam states equal DeepSpeed's own view of them exactly, and training
  goes on like DeepSpeed's (the global batch is the same, split over the new ranks).

No DeepSpeed is needed: the files are read with torch.load(weights_only=True) and an
allow-list of inert records.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch

from distributed import run_ranks

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepspeed_ckpt")


def _common():
    if "ds_fixture_common" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ds_fixture_common", os.path.join(FIX, "common.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["ds_fixture_common"] = module
        spec.loader.exec_module(module)
    return sys.modules["ds_fixture_common"]


common = _common()
CASES = [common.case_name(s, d) for s in common.STAGES for d in common.DTYPES]

FP32_REL = 1e-5
# bf16: both systems step the same fp32 masters from bf16 forward/backward passes, but round
# in different places (DeepSpeed reduces gradients in bf16, its default grad_accum_dtype), so
# a loss may differ by about one bf16 ulp (2^-8 = 3.9e-3 relative) and a parameter by a small
# fraction of one Adam step (~lr, at most 0.0046 here). Bounds: losses 5e-3 relative (1.3
# ulp), parameters 5e-4 absolute (1/9 of a step). A mapping bug moves a parameter by a whole
# element's difference (~0.1-1) or its Adam state by a factor. Measured on the fixtures:
# losses 1.6e-3, parameters 7.3e-5.
BF16_LOSS = 5e-3
BF16_PARAM = 5e-4


def record(case: str) -> dict:
    with open(os.path.join(FIX, case + ".json")) as f:
        return json.load(f)


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        x, y = common.rank_batch(step, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _masters(engine) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in engine.full_state_dict().items()}


def _resume_dropin(rank: int, world: int, cases: list[str]) -> dict:
    """Every case through zeroshard.deepspeed.initialize + engine.load_checkpoint."""
    import zeroshard.deepspeed as deepspeed

    out = {}
    for case in cases:
        rec = record(case)
        model = common.make_model(seed=common.SEED + 7)  # other weights: the load must set them all
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=json.loads(json.dumps(rec["config"])))
        path, client = engine.load_checkpoint(os.path.join(FIX, case))
        loaded = _masters(engine)
        steps = (engine.global_steps, engine.get_lr())
        losses = _train(engine, rank, world, range(common.K, 2 * common.K))
        out[case] = {"path": path, "client": client, "loaded": loaded, "steps": steps, "losses": losses,
                     "final": _masters(engine)}
        engine.destroy()
    return out


def _check_trajectory(case: str, got: dict) -> tuple[float, float]:
    """(worst relative loss difference, worst absolute parameter difference) against
    DeepSpeed's own resumed run; asserts the bound of the case's dtype."""
    rec = record(case)
    want = torch.tensor(rec["losses_after_resume"])
    loss_rel = ((torch.tensor(got["losses"]) - want).abs() / want.abs()).max().item()
    param = max((got["final"][n].flatten() - torch.tensor(v)).abs().max().item() for n, v in rec["final"].items())
    scale = max(torch.tensor(v).abs().max().item() for v in rec["final"].values())
    if rec["dtype"] == "fp32":
        assert loss_rel <= FP32_REL, (case, got["losses"], rec["losses_after_resume"])
        assert param <= FP32_REL * scale, (case, param)
    else:
        assert loss_rel <= BF16_LOSS, (case, got["losses"], rec["losses_after_resume"])
        assert param <= BF16_PARAM, (case, param)
    return loss_rel, param


def _check_loaded(case: str, loaded: dict) -> None:
    """The masters right after the load are exactly the ones DeepSpeed saved."""
    rec = record(case)
    for name, e in rec["saved"].items():
        assert torch.equal(loaded[name].flatten(), torch.tensor(e["value"])), (case, name)


def test_resume_matches_deepspeed_on_two_ranks():
    results = run_ranks(_resume_dropin, 2, CASES, timeout=600)
    r0 = results[0]
    report = {}
    for case in CASES:
        got = r0[case]
        rec = record(case)
        _check_loaded(case, got["loaded"])
        assert got["client"] == rec["client_state"]
        assert got["path"].endswith("model_states.pt")
        assert got["steps"][0] == rec["global_steps_at_save"]
        assert got["steps"][1][0] == pytest.approx(rec["lrs_after_resume"][0], rel=1e-12)
        report[case] = _check_trajectory(case, got)
        for name in rec["final"]:  # every rank ends with the same parameters
            assert torch.equal(results[1][case]["final"][name], got["final"][name])
    print("\nresume vs DeepSpeed (worst loss rel. diff, worst param abs. diff):",
          {c: (f"{a:.2e}", f"{b:.2e}") for c, (a, b) in report.items()})
