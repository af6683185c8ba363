"""DeepSpeed warmup schedules: values at given iterations, computed by hand."""

import json
import math
import warnings

import pytest
import torch

from zeroshard.optim.schedulers import WarmupCosineLR, WarmupLR, build_scheduler
from zeroshard.policies import ConfigError, SchedulerSpec


def _opt(lr=0.1, groups=1):
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr
    )


def _lrs_by_iteration(sched, last_it):
    """{DeepSpeed iteration: lr of group 0} for iterations -1..last_it."""
    out = {sched.last_batch_iteration: sched.optimizer.param_groups[0]["lr"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        while sched.last_batch_iteration < last_it:
            sched.step()
            out[sched.last_batch_iteration] = sched.optimizer.param_groups[0]["lr"]
    return out


def test_warmup_lr_log():
    s = build_scheduler(SchedulerSpec("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                   "warmup_num_steps": 10}), _opt())
    lr = _lrs_by_iteration(s, 15)
    assert lr[-1] == 0.0 and lr[0] == 0.0  # log(1) = 0: the first two steps use the min lr
    assert lr[1] == pytest.approx(0.01 * 0.30102999566)  # log(2)/log(10)
    assert lr[4] == pytest.approx(0.01 * 0.69897000433)  # log(5)/log(10)
    assert lr[9] == pytest.approx(0.01)
    assert lr[10] == lr[15] == 0.01


def test_warmup_lr_linear_and_min_lr():
    s = build_scheduler(SchedulerSpec("WarmupLR", {"warmup_min_lr": 0.002, "warmup_max_lr": 0.012,
                                                   "warmup_num_steps": 10, "warmup_type": "linear"}), _opt())
    lr = _lrs_by_iteration(s, 12)
    assert lr[-1] == 0.002 and lr[0] == 0.002
    assert lr[3] == pytest.approx(0.005)
    assert lr[9] == pytest.approx(0.011)
    assert lr[10] == lr[12] == pytest.approx(0.012)


def test_warmup_lr_max_defaults_to_optimizer_lr():
    s = build_scheduler(SchedulerSpec("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}),
                        _opt(lr=0.3))
    assert _lrs_by_iteration(s, 5)[5] == pytest.approx(0.3)


def test_warmup_num_steps_clamped_to_two():
    s = build_scheduler(SchedulerSpec("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 1}), _opt())
    lr = _lrs_by_iteration(s, 2)
    assert (lr[0], lr[1], lr[2]) == (0.0, pytest.approx(1.0), 1.0)


def test_warmup_decay_lr():
    s = build_scheduler(SchedulerSpec("WarmupDecayLR", {
        "total_num_steps": 20, "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear"}), _opt())
    lr = _lrs_by_iteration(s, 25)
    assert lr[5] == pytest.approx(0.005)
    assert lr[10] == pytest.approx(0.01)  # (20 - 10) / (20 - 10)
    assert lr[15] == pytest.approx(0.005)
    assert lr[19] == pytest.approx(0.001)
    assert lr[20] == 0.0 and lr[25] == 0.0


def test_warmup_decay_lr_default_max_is_0_001():
    s = build_scheduler(SchedulerSpec("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 2}),
                        _opt(lr=0.5))
    assert _lrs_by_iteration(s, 2)[2] == pytest.approx(0.001 * 8 / 8)


def test_warmup_cosine_lr():
    s = build_scheduler(SchedulerSpec("WarmupCosineLR", {
        "total_num_steps": 20, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.0,
        "warmup_type": "linear"}), _opt(lr=0.1))
    lr = _lrs_by_iteration(s, 30)
    assert lr[-1] == 0.0  # DeepSpeed: ratio 0 before the first step, not warmup_min_ratio
    assert lr[0] == pytest.approx(0.01)
    assert lr[5] == pytest.approx(0.055)  # 0.1 + 0.5 * 0.9
    assert lr[9] == pytest.approx(0.091)
    assert lr[10] == pytest.approx(0.1 * (1 + math.cos(math.pi * 0.1)) / 2)  # 0.0975528
    assert lr[14] == pytest.approx(0.05)
    assert lr[19] == pytest.approx(0.0, abs=1e-12)
    assert lr[30] == pytest.approx(0.0, abs=1e-12)  # clamped, does not rise again


def test_warmup_cosine_log_and_floor():
    s = build_scheduler(SchedulerSpec("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 10}),
                        _opt(lr=0.1))
    lr = _lrs_by_iteration(s, 40)
    assert lr[1] == pytest.approx(0.1 * math.log(2) / math.log(10))
    assert lr[40] == pytest.approx(0.1 * 0.0001)  # cos_min_ratio default


def test_per_group_values_and_ratios_of_each_group():
    opt = _opt(groups=2)
    opt.param_groups[1]["lr"] = 0.2
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.3], warmup_num_steps=4,
                 warmup_type="linear")
    _lrs_by_iteration(s, 2)
    assert s.get_last_lr() == pytest.approx([0.5, 0.2])
    opt = _opt(groups=2)
    opt.param_groups[1]["lr"] = 0.2
    c = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=4, warmup_type="linear")
    _lrs_by_iteration(c, 2)
    assert c.get_last_lr() == pytest.approx([0.05, 0.1])  # ratio 0.5 of each group's own lr
    with pytest.raises(ConfigError, match="one per param group"):
        WarmupLR(_opt(groups=2), warmup_max_lr=[0.1, 0.2, 0.3])


@pytest.mark.parametrize("spec", [
    SchedulerSpec("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 5}),
    SchedulerSpec("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 5}),
    SchedulerSpec("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 5}),
])
def test_state_dict_round_trip_is_json(spec):
    a = build_scheduler(spec, _opt())
    _lrs_by_iteration(a, 6)
    state = json.loads(json.dumps(a.state_dict()))
    b = build_scheduler(spec, _opt())
    b.load_state_dict(state)
    assert b.last_batch_iteration == a.last_batch_iteration == 6
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a.step()
            b.step()
        assert a.get_last_lr() == b.get_last_lr()
        assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]


def test_errors():
    with pytest.raises(ConfigError, match=r"'WarmupLR'.*\['total_num_steps'\].*valid keys"):
        build_scheduler(SchedulerSpec("WarmupLR", {"total_num_steps": 5}), _opt())
    with pytest.raises(ConfigError, match="total_num_steps.*required"):
        build_scheduler(SchedulerSpec("WarmupCosineLR", {}), _opt())
    with pytest.raises(ConfigError, match="warmup_type"):
        build_scheduler(SchedulerSpec("WarmupLR", {"warmup_type": "cubic"}), _opt())
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        build_scheduler(SchedulerSpec("WarmupLR", {"warmup_num_steps": 0}), _opt())
    with pytest.raises(ConfigError, match="'OneCycle'.*'cycle_min_lr' is required"):
        build_scheduler(SchedulerSpec("OneCycle", {}), _opt())
    with pytest.raises(ConfigError, match="unknown scheduler type"):
        build_scheduler(SchedulerSpec("warmuplr", {}), _opt())
