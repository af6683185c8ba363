"""The DeepSpeed engine as Hugging Face Trainer and Accelerate drive it (one process, fast).

Accelerate announces the accumulation boundary (`set_gradient_accumulation_boundary`) and
calls `engine.step()` only there; Trainer passes `backward(scale_wrt_gas=False)` after
dividing the loss itself. Both must train exactly like one process stepping SGD on the
mean gradient of the window (DESIGN.md section 9). Before issue 23 zeroshard counted
micro-steps inside `step()` and so stepped every 4 micro-batches with accumulation 2,
silently (the `test_caller_driven_boundary_*` tests fail on that code).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import zeroshard.deepspeed as deepspeed
from zeroshard.policies import ConfigError

LR, GAS, MICRO = 0.1, 2, 4


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)) for _ in range(n)]


def _config(stage: int, **extra) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, leaf_module={"classes": ["Linear"]})
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": zero, **extra}


def _oracle(batches, gas: int = GAS) -> dict[str, torch.Tensor]:
    """One process, SGD on the mean gradient of each window of `gas` micro-batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i, (x, y) in enumerate(batches):
        (nn.functional.mse_loss(model(x), y) / gas).backward()
        if (i + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _weights(engine) -> dict[str, torch.Tensor]:
    return engine.zeroshard.full_state_dict()


def _close(got: dict, want: dict) -> None:
    for name, w in want.items():
        assert torch.allclose(got[name], w, atol=1e-5 * max(1.0, float(w.abs().max()))), name


@pytest.mark.parametrize("stage", [2, 3])
def test_caller_driven_boundary_steps_once_per_window_like_accelerate(stage):
    batches = _batches(6)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage))
    steps = []
    for i, (x, y) in enumerate(batches):
        boundary = (i + 1) % GAS == 0  # Accelerate's sync_gradients
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        if boundary:
            engine.step()
            steps.append(engine.global_steps)
    assert steps == [1, 2, 3]
    _close(_weights(engine), _oracle(batches))


def test_caller_driven_boundary_with_scale_wrt_gas_false_like_trainer():
    """Trainer divides the loss by the accumulation steps itself and says scale_wrt_gas=False."""
    batches = _batches(4)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(2))
    for i, (x, y) in enumerate(batches):
        boundary = (i + 1) % GAS == 0
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(nn.functional.mse_loss(engine(x), y) / GAS, scale_wrt_gas=False)
        if boundary:
            engine.step()
    _close(_weights(engine), _oracle(batches))


def test_caller_boundary_decides_even_against_the_configured_steps(caplog):
    """The caller announces a window of 3 backwards where the config says 2: the optimizer
    steps at the caller's boundary (once), and a warning says the two disagree."""
    batches = _batches(3)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(2))
    with caplog.at_level("WARNING", logger="zeroshard"):
        for i, (x, y) in enumerate(batches):
            engine.set_gradient_accumulation_boundary(i == 2)
            engine.backward(nn.functional.mse_loss(engine(x), y) / 3, scale_wrt_gas=False)
        engine.step()
    assert engine.global_steps == 1
    assert "announced the accumulation boundary after 3 backward(s)" in caplog.text
    _close(_weights(engine), _oracle(batches, gas=3))


def test_counter_still_decides_without_the_caller():
    """A DeepSpeed script that calls step() after every backward: unchanged behaviour."""
    batches = _batches(4)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(2))
    for x, y in batches:
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 2
    _close(_weights(engine), _oracle(batches))


def test_zero_grad_drops_the_window_so_far():
    batches = _batches(5)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(2))
    x, y = batches[0]
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.zero_grad()  # the first micro-batch's gradient is gone
    for i, (x, y) in enumerate(batches[1:]):
        boundary = (i + 1) % GAS == 0
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        if boundary:
            engine.step()
    _close(_weights(engine), _oracle(batches[1:]))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_between_counted_micro_steps_drops_what_came_before(stage):
    """The micro-step counter decides (no caller boundary): zero_grad() after the window's first
    backward leaves its second backward's gradient alone in the step, as DeepSpeed's zero_grad.
    Stages 2-3 empty their accumulators lazily (stages/gradients.py): a reduction that is not a
    window's first must still overwrite what zero_grad emptied, not add to it."""
    batches = _batches(4)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage))
    for i, (x, y) in enumerate(batches):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        if i == 0:
            engine.zero_grad()
        engine.step()
    assert engine.global_steps == 2
    oracle = _model()
    opt = torch.optim.SGD(oracle.parameters(), lr=LR)
    for window in ([batches[1]], batches[2:]):
        for x, y in window:
            (nn.functional.mse_loss(oracle(x), y) / GAS).backward()
        opt.step()
        opt.zero_grad()
    _close(_weights(engine), oracle.state_dict())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_with_no_backward_since_zero_grad_applies_no_gradient(stage):
    batches = _batches(2)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage))
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(nn.functional.mse_loss(engine(batches[0][0]), batches[0][1]))
    engine.step()
    after_one = {k: v.clone() for k, v in _weights(engine).items()}
    engine.zero_grad()
    engine.step()  # the previous window's gradient must not be applied a second time
    for name, w in _weights(engine).items():
        assert torch.equal(w, after_one[name]), name


def test_engine_is_a_module_with_deepspeeds_attributes():
    model = _model()
    config = _config(3, steps_per_print=math.inf, stage3_gather_16bit_weights_on_model_save=True)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    del config["stage3_gather_16bit_weights_on_model_save"]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    assert isinstance(engine, nn.Module) and engine.module is model
    assert [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()]
    assert engine.config["zero_optimization"]["stage"] == 3 and engine.config["steps_per_print"] == math.inf
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert optimizer.overflow is False
    x, y = _batches(1)[0]
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert optimizer.overflow is False and engine.was_step_applied()
    full = engine._zero3_consolidated_16bit_state_dict()
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(v.shape) for k, v in _model().state_dict().items()}
    _close(full, _weights(engine))
    with pytest.raises(AttributeError, match="DeepSpeedEngine.tp_size_of_everything is not served"):
        engine.tp_size_of_everything
    with pytest.raises(ConfigError, match="compiled_autograd_enabled"):  # DeepSpeed's signature (docs/compile.md)
        engine.compile(compiled_autograd_enabled=True)
    assert engine.is_compiled is False


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_client_optimizer_groups_follow_zeroshards_rebuild():
    """Accelerate steps a LambdaLR over the optimizer the script made; DeepSpeed steps that
    very object, so its lr must reach the shards zeroshard steps."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    config = {k: v for k, v in _config(2).items() if k != "optimizer"}
    config["gradient_accumulation_steps"] = 1
    engine, zs_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    sched.step()
    assert zs_opt.param_groups[0]["lr"] == pytest.approx(LR / 2)
    assert opt.param_groups is zs_opt.param_groups
