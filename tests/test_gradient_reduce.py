"""DeepSpeed's gradient-reduction knobs act as in DeepSpeed 0.19.8.

`gradient_allreduce_op: "sum"`, `prescale_gradients` and `gradient_predivide_factor` are
applied where DeepSpeed applies them (engine.allreduce_bucket, zero/stage_1_and_2.py's
all-reduce path): "sum" gives N x the mean gradient; prescale divides by N before the sum;
a predivide factor f divides by f before the sum and multiplies by f/N after. The same script
(tests/fixtures/grad_reduce/common.py) was run under real DeepSpeed 0.19.8 on 2 ranks
(make_reference.py -> reference.json); here it runs under zeroshard and must give the same
losses, the same skipped (fp16 overflow) steps and the same parameters.

In fp32 every "mean" form is the same mean: those cases equal the plain mean case (a test
that fails if a factor is applied once but not undone). In fp16 the factor decides whether
the sum overflows: with a static loss scale of 2^15 DeepSpeed's plain sum and a predivide
factor of 0.5 overflow (every step skipped), prescale and a factor of 2 do not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from distributed import one_group, run_ranks
from zeroshard.config import load_config
from zeroshard.policies import ConfigError, GradientReducePolicy

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "grad_reduce")


def _common():
    if "grad_reduce_common" not in sys.modules:
        spec = importlib.util.spec_from_file_location("grad_reduce_common", os.path.join(FIX, "common.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["grad_reduce_common"] = module
        spec.loader.exec_module(module)
    return sys.modules["grad_reduce_common"]


common = _common()
pytestmark = pytest.mark.recorded  # compares with what DeepSpeed computed (tests/fixtures/grad_reduce)

with open(os.path.join(FIX, "reference.json")) as f:
    REFERENCE = json.load(f)
NAMES = [c[0] for c in common.CASES]
# zeroshard's default divides by N before the sum (DeepSpeed's all-reduce path divides after it):
# in fp32 the same mean; in fp16 zeroshard's sum cannot overflow where DeepSpeed's does. This
# case is compared with DeepSpeed's prescale case, which is what zeroshard does.
SAME_AS = {"z1-fp16-mean-allreduce": "z1-fp16-prescale-allreduce"}


def _worker(rank: int, world_size: int):
    import zeroshard

    out = {}
    with one_group():
        for name, stage, dtype, top, zero in common.CASES:
            engine = zeroshard.initialize(common.make_model(), common.config(stage, dtype, top, zero))
            losses, skipped = [], []
            for step in range(common.STEPS):
                x, y = common.rank_batch(step, rank)
                before = engine.skipped_steps
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                mean = loss.detach().float().clone()
                torch.distributed.all_reduce(mean)
                losses.append(mean.item() / world_size)
                skipped.append(engine.skipped_steps > before)
            params = {n: p.detach().float().flatten().clone() for n, p in engine.module.named_parameters()}
            out[name] = (losses, skipped, params)
            engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, common.WORLD, timeout=300)


@pytest.mark.parametrize("name", NAMES)
def test_matches_deepspeed(name, results):
    ref = REFERENCE["cases"][SAME_AS.get(name, name)]
    fp16 = "fp16" in name
    for rank_result in results:
        losses, skipped, params = rank_result[name]
        assert skipped == ref["skipped"], (name, skipped, ref["skipped"])
        assert losses == pytest.approx(ref["losses"], rel=2e-3 if fp16 else 1e-5)
        for pname, values in ref["params"].items():
            want = torch.tensor(values)
            tol = (2e-3 if fp16 else 1e-5) * want.abs().max().item()
            assert (params[pname] - want).abs().max().item() <= tol, (name, pname)


def test_reference_shows_what_the_knobs_do():
    """The record is not vacuous: sum differs from the mean, every fp32 mean form equals the
    mean, and in fp16 the overflow depends on the knob."""
    cases = REFERENCE["cases"]
    mean = cases["z0-fp32-mean"]["params"]["fc1.weight"]
    assert cases["z0-fp32-sum"]["params"]["fc1.weight"] != pytest.approx(mean, rel=1e-3)
    for name in ("z0-fp32-prescale", "z0-fp32-predivide4", "z1-fp32-predivide4-allreduce"):
        assert cases[name]["params"]["fc1.weight"] == pytest.approx(mean, rel=1e-6)
    assert all(cases["z1-fp16-sum-allreduce"]["skipped"]) and all(cases["z2-fp16-predivide0.5-allreduce"]["skipped"])
    assert not any(cases["z1-fp16-predivide2-allreduce"]["skipped"])


@pytest.mark.parametrize("policy,n,can,want", [
    (GradientReducePolicy(), 4, True, (1.0, 1.0, True)),
    (GradientReducePolicy(), 4, False, (0.25, 1.0, False)),
    (GradientReducePolicy(average=False), 4, True, (1.0, 1.0, False)),
    (GradientReducePolicy(prescale=True), 4, True, (0.25, 1.0, False)),
    (GradientReducePolicy(predivide_factor=2.0), 4, True, (0.5, 0.5, False)),
    (GradientReducePolicy(predivide_factor=4.0), 4, True, (0.25, 1.0, False)),
    (GradientReducePolicy(prescale=True, predivide_factor=2.0), 4, True, (0.25, 1.0, False)),
    (GradientReducePolicy(predivide_factor=2.0), 1, True, (1.0, 1.0, False)),
])
def test_factors(policy, n, can, want):
    assert policy.factors(n, can) == want


@pytest.mark.parametrize("cfg,words", [
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "not supported with ZeRO stage 3"),
    ({"gradient_predivide_factor": 2, "zero_optimization": {"stage": 2}}, "set zero_optimization.reduce_scatter"),
    ({"prescale_gradients": True, "zero_optimization": {"stage": 3}}, "prescale_gradients = true: not supported"),
])
def test_what_deepspeed_refuses_is_refused(cfg, words):
    """DeepSpeed: runtime/config.py (sum at stage 3), the asserts of stage_1_and_2.py / stage3.py."""
    with pytest.raises(ConfigError) as info:
        load_config(cfg, 2)
    assert words in str(info.value) and "DeepSpeed" in str(info.value)


@pytest.mark.parametrize("cfg,policy,note", [
    ({"gradient_predivide_factor": 4, "zero_optimization": {"stage": 1}}, GradientReducePolicy(prescale=True),
     "gradient_predivide_factor = 4 at stage 1 with reduce_scatter"),
    ({"gradient_allreduce_op": "sum", "prescale_gradients": True}, GradientReducePolicy(average=False),
     'prescale_gradients = true with gradient_allreduce_op "sum"'),
    ({"prescale_gradients": True, "gradient_predivide_factor": 2}, GradientReducePolicy(True, True, 2.0),
     "gradient_predivide_factor = 2 with prescale_gradients = true"),
    ({"gradient_predivide_factor": 2, "zero_optimization": {"stage": 2, "reduce_scatter": False}},
     GradientReducePolicy(predivide_factor=2.0), None),
])
def test_policy_and_notes(cfg, policy, note):
    settings = load_config(cfg, 2)
    assert settings.gradient_reduce == policy
    if note:
        assert any(note in n for n in settings.notes), settings.notes
