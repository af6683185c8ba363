"""Loss scalers: DeepSpeed's dynamic update rule, skip counting, state round-trip."""

import json
import random

import pytest

from zeroshard.optim.loss_scaler import DynamicLossScaler, LossScaler, make_loss_scaler
from zeroshard.policies import ConfigError, LossScalePolicy, ZeroShardError


def _run(scaler, outcomes):
    """Scale after each update; outcomes is a string, 'x' overflow, '.' good step."""
    scales = []
    for c in outcomes:
        scaler.update(c == "x")
        scales.append(scaler.scale)
    return scales


def test_static_scaler_counts_skips():
    s = LossScaler(128.0)
    assert _run(s, "x.xx.") == [128.0] * 5
    assert (s.skipped_steps, s.consecutive_skips) == (3, 0)
    s.update(True)
    assert (s.skipped_steps, s.consecutive_skips) == (4, 1)
    assert not s.dynamic


def test_overflow_with_hysteresis_two():
    s = DynamicLossScaler(initial_scale=2.0**16, hysteresis=2)
    # First overflow only spends hysteresis; from then on each overflow halves.
    assert _run(s, "xxx") == [2.0**16, 2.0**15, 2.0**14]
    assert (s.skipped_steps, s.consecutive_skips, s.hysteresis_left) == (3, 3, 1)


def test_good_steps_do_not_refill_hysteresis_without_growth():
    s = DynamicLossScaler(initial_scale=1024.0, loss_scale_window=100, hysteresis=2)
    assert _run(s, "x.x") == [1024.0, 1024.0, 512.0]


def test_consecutive_hysteresis_refills_on_every_good_step():
    s = DynamicLossScaler(initial_scale=1024.0, loss_scale_window=100, hysteresis=2,
                          consecutive_hysteresis=True)
    assert _run(s, "x.x.x.") == [1024.0] * 6
    assert _run(s, "xx") == [1024.0, 512.0]


def test_growth_after_window():
    s = DynamicLossScaler(initial_scale=8.0, loss_scale_window=3, hysteresis=1)
    # DeepSpeed grows when (iteration - last_overflow - 1) is a positive multiple of the window:
    # from the start that is iterations 3, 6, ... (the 4th, 7th good step).
    assert _run(s, ".......") == [8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0]
    # After an overflow at iteration 7: growth at iterations 11, 14.
    assert _run(s, "x......") == [16.0, 16.0, 16.0, 16.0, 32.0, 32.0, 32.0]
    assert s.consecutive_skips == 0 and s.skipped_steps == 1


def test_growth_refills_hysteresis():
    s = DynamicLossScaler(initial_scale=8.0, loss_scale_window=2, hysteresis=2)
    assert _run(s, "x...") == [8.0, 8.0, 8.0, 16.0]
    assert s.hysteresis_left == 2
    assert _run(s, "xx") == [16.0, 8.0]


def test_floor_at_min_scale():
    s = DynamicLossScaler(initial_scale=16.0, hysteresis=1, min_loss_scale=4.0)
    assert _run(s, "xxxx") == [8.0, 4.0, 4.0, 4.0]
    assert s.consecutive_skips == 4
    strict = DynamicLossScaler(initial_scale=8.0, hysteresis=1, min_loss_scale=4.0, raise_at_min_scale=True)
    strict.update(True)
    with pytest.raises(ZeroShardError, match="minimum loss scale"):
        strict.update(True)


def test_make_loss_scaler():
    none = make_loss_scaler(None)
    assert type(none) is LossScaler and none.scale == 1.0
    static = make_loss_scaler(LossScalePolicy(static_scale=256.0))
    assert type(static) is LossScaler and static.scale == 256.0
    dyn = make_loss_scaler(LossScalePolicy(initial_scale_power=12, loss_scale_window=50, hysteresis=3,
                                           consecutive_hysteresis=True, min_loss_scale=2.0))
    assert isinstance(dyn, DynamicLossScaler) and dyn.dynamic
    assert (dyn.scale, dyn.loss_scale_window, dyn.hysteresis, dyn.consecutive_hysteresis,
            dyn.min_loss_scale) == (4096.0, 50, 3, True, 2.0)
    assert make_loss_scaler(LossScalePolicy()).scale == 2.0**16


def test_invalid_settings():
    with pytest.raises(ConfigError):
        LossScaler(0.0)
    with pytest.raises(ConfigError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ConfigError, match="min_loss_scale"):
        DynamicLossScaler(min_loss_scale=0.0)


@pytest.mark.parametrize("make", [lambda: LossScaler(8.0),
                                  lambda: DynamicLossScaler(2.0**10, loss_scale_window=3, hysteresis=2)])
def test_state_dict_round_trip(make):
    rng = random.Random(0)
    outcomes = "".join(rng.choice("x...") for _ in range(40))
    a = make()
    _run(a, outcomes[:20])
    b = make()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert _run(a, outcomes[20:]) == _run(b, outcomes[20:])
    assert b.state_dict() == a.state_dict()
