"""OneCycle and LRRangeTest: DeepSpeed's parameters and formulas (deepspeed/runtime/lr_schedules.py).

Three checks: (1) the lr and betas of every group at each of 41 optimizer steps equal what real
DeepSpeed 0.19.8 set (tests/fixtures/lr_schedules, recorded by make_reference.py there) for
eight parameter sets: cycles of unequal halves, decay of lr and momentum, stairs, per-group
values, SGD (no betas), momentum off, the range test continuous and in stairs, defaults;
(2) they equal a re-implementation written here from DeepSpeed's documented formulas (a
triangle from cycle_min_lr up to cycle_max_lr over cycle_first_step_size and back over
cycle_second_step_size, then min_lr / (1 + decay_lr_rate * t / decay_step_size); momentum the
other way; the range test min_lr * (1 + rate * t / step_size)); (3) through a real engine,
config in, the optimizer steps with those values and trains like torch's AdamW given them.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from zeroshard.optim.schedulers import build_scheduler
from zeroshard.policies import ConfigError, SchedulerSpec

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "lr_schedules")
with open(os.path.join(FIX, "reference.json")) as f:
    REFERENCE = json.load(f)["cases"]


def _optimizer(kind: str) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(3))]}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(groups, lr=0.5, betas=(0.9, 0.999))


def _run(case: dict) -> list[dict]:
    opt = _optimizer(case["optimizer"])
    sched = build_scheduler(SchedulerSpec(case["type"], case["params"]), opt)
    out = []
    for _ in range(len(case["steps"])):
        out.append({"lr": [g["lr"] for g in opt.param_groups],
                    "betas": [list(g["betas"]) for g in opt.param_groups] if "betas" in opt.defaults else None})
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_equals_deepspeed(name):
    case = REFERENCE[name]
    got = _run(case)
    for k, (mine, ds) in enumerate(zip(got, case["steps"])):
        assert mine["lr"] == pytest.approx(ds["lr"], rel=1e-12, abs=1e-15), (name, k)
        if ds["betas"] is None:
            assert mine["betas"] is None
        else:
            assert [b for pair in mine["betas"] for b in pair] == pytest.approx(
                [b for pair in ds["betas"] for b in pair], rel=1e-12), (name, k)


def _triangle(k: float, first: float, second: float, stairs: tuple[int, int]) -> float:
    """0 at the bottom, 1 at the top of the cycle, k steps in (written from the docs)."""
    k = k % (first + second)
    if k <= first:
        up = k / first
        return math.floor(up * stairs[0]) / stairs[0] if stairs[0] else up
    down = (first + second - k) / second
    return math.floor(down * stairs[1]) / stairs[1] if stairs[1] else down


def _documented(case: dict, k: int) -> tuple[list[float], list[float] | None]:
    """The lr (and beta1) of each group that optimizer step k uses (k = 0 before any scheduler step)."""
    p = case["params"]
    n = 2
    per = (lambda v: list(v) if isinstance(v, list) else [v] * n)
    if case["type"] == "LRRangeTest":
        size, rate = p.get("lr_range_test_step_size", 2000), p.get("lr_range_test_step_rate", 1.0)
        t = math.floor(k / size) if p.get("lr_range_test_staircase") else k / size
        return [lo * (1 + rate * t) for lo in per(p.get("lr_range_test_min_lr", 1e-3))], None
    first = p.get("cycle_first_step_size", 2000)
    second = p.get("cycle_second_step_size", first)
    stairs = (p.get("cycle_first_stair_count", 0), p.get("cycle_second_stair_count", p.get("cycle_first_stair_count", 0)))
    lo_lr, hi_lr = per(p["cycle_min_lr"]), per(p["cycle_max_lr"])
    lo_m, hi_m = per(p.get("cycle_min_mom", 0.8)), per(p.get("cycle_max_mom", 0.9))
    decay, total = p.get("decay_step_size", 0), first + second
    if k <= total:
        h = _triangle(k, first, second, stairs)
        lrs = [a + (b - a) * h for a, b in zip(lo_lr, hi_lr)]
        moms = lo_m if k == 0 else [b - (b - a) * h for a, b in zip(lo_m, hi_m)]
    else:
        t = (k - total) / decay if decay else 0.0
        lrs = [a / (1 + p.get("decay_lr_rate", 0.0) * t) for a in lo_lr]
        moms = [b * (1 + p.get("decay_mom_rate", 0.0) * t) for b in hi_m]
    cycles = case["optimizer"] != "sgd" and p.get("cycle_momentum", True)
    return lrs, (moms if cycles else None)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_equals_the_documented_formula(name):
    case = REFERENCE[name]
    for k, got in enumerate(_run(case)):
        lrs, moms = _documented(case, k)
        assert got["lr"] == pytest.approx(lrs, rel=1e-9), (name, k)
        if moms is not None:
            assert [b[0] for b in got["betas"]] == pytest.approx(moms, rel=1e-9), (name, k)
            assert all(b[1] == 0.99 for b in got["betas"])  # DeepSpeed pins beta2 to 0.99
        elif got["betas"] is not None:
            assert got["betas"] == [[0.9, 0.999]] * 2  # momentum off: the optimizer's own


def test_bad_parameters_are_one_clear_error():
    opt = _optimizer("adamw")
    for params, words in [({"cycle_min_lr": 0.1}, "'cycle_max_lr' is required"),
                          ({"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}, "must be positive"),
                          ({"cycle_min_lr": [0.1], "cycle_max_lr": 1}, "expected 2 values")]:
        with pytest.raises(ConfigError, match=words):
            build_scheduler(SchedulerSpec("OneCycle", params), opt)
    with pytest.raises(ConfigError, match="lr_range_test_step_size"):
        build_scheduler(SchedulerSpec("LRRangeTest", {"lr_range_test_step_size": 0}), opt)


def test_resume_from_last_batch_iteration_as_deepspeed():
    """last_batch_iteration k >= 0 continues the schedule; the optimizer's lr stays until step()."""
    case = REFERENCE["onecycle-adamw"]
    opt = _optimizer("adamw")
    sched = build_scheduler(SchedulerSpec("OneCycle", {**case["params"], "last_batch_iteration": 9}), opt)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(case["steps"][11]["lr"], rel=1e-12)


def test_through_an_engine_the_optimizer_steps_with_the_schedule():
    """Config in (world size 1, fp32): each step's lr and betas are the schedule's, and the model
    trains exactly as torch AdamW given the same values before each step."""
    import zeroshard

    params = {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3, "cycle_second_step_size": 2,
              "decay_step_size": 1, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}
    case = {"type": "OneCycle", "optimizer": "adamw", "params": params}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "betas": [0.9, 0.999], "weight_decay": 0.01}},
           "scheduler": {"type": "OneCycle", "params": params}}
    engine = zeroshard.initialize(model, cfg)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=0.5, betas=(0.9, 0.999), weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for k in range(9):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        lrs, moms = _documented(case, k)
        assert engine.get_lr() == pytest.approx([lrs[0]], rel=1e-9)
        betas = engine.optimizer.param_groups[0]["betas"]
        assert betas == pytest.approx((moms[0], 0.99), rel=1e-9)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        for group in torch_opt.param_groups:
            group["lr"], group["betas"] = lrs[0], (moms[0], 0.99)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    got = engine.full_state_dict()
    for name, want in ref.state_dict().items():
        assert torch.allclose(got[name].float(), want, rtol=1e-5, atol=1e-7), name
    engine.close()
