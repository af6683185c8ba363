"""`engine.offload_states()` / `reload_states()` (issue 48; DeepSpeed 0.19.8's API, which OpenRLHF
calls between rollouts): the states' storage is freed, their bytes parked on the host, and after
the reload training goes on exactly as if nothing had happened.

On 2 real ranks: train 2 steps, offload everything, check the memory ledger (the model states'
device bytes all moved to the host tier, the parked bytes equal to what the ledger held) and
that a forward is refused in one line; reload, train 2 more steps: losses and parameters equal,
bit for bit, those of the same run without the offload. The drop-in's names
(`engine.optimizer.offload_states(include=[OffloadStateTypeEnum...], device=OffloadDeviceEnum.cpu)`)
and DeepSpeed's refusals (nvme, offload_param, no optimizer; optimizer offload leaves out the
states already on the host) run in one process."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model
from zeroshard.policies import ConfigError


def _train(rank: int, world: int, case: Case, offload: bool):
    import zeroshard

    engine = zeroshard.initialize(make_model(case), config_for(case, world))
    losses, ledger = [], {}

    def step(i: int) -> None:
        x, y = batch(case, i, world)
        loss = loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    for i in range(2):
        step(i)
    if offload:
        before = engine.memory.stats()
        engine.offload_states()
        after = engine.memory.stats()
        ledger = {"before": before, "after": after, "parked": engine.states.parked.parked_bytes}
        try:
            step(2)
        except ConfigError as exc:
            ledger["refused"] = str(exc)
        engine.reload_states()
        ledger["restored"] = engine.memory.stats()
    for i in range(2, 4):
        step(i)
    params = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "params": params, "ledger": ledger}


@pytest.mark.parametrize("case", [Case(stage=3, optimizer="adamw", precision="bf16", steps=4),
                                  Case(stage=2, optimizer="adamw", steps=4),
                                  Case(stage=1, optimizer="adamw", precision="bf16", gas=2, steps=4)],
                         ids=["stage3-bf16", "stage2-fp32", "stage1-bf16-gas2"])
@pytest.mark.timeout(600)
def test_offload_then_reload_trains_exactly_as_without(case):
    plain = run_ranks(_train, 2, case, False, timeout=600)
    cycled = run_ranks(_train, 2, case, True, timeout=600)
    for p, c in zip(plain, cycled):
        assert c["losses"] == p["losses"]
        for name, value in p["params"].items():
            assert torch.equal(c["params"][name].view(torch.uint8), value.view(torch.uint8)), name
        ledger = c["ledger"]
        before, after = ledger["before"], ledger["after"]
        states = before["params"] + before["grads"] + before["optimizer_states"]
        assert ledger["parked"] == states == before["model_states"]  # every model state's bytes
        assert after["tier_device"] == before["tier_device"] - states and after["tier_device"] == 0
        assert after["tier_host"] == before["tier_host"] + states
        assert "forward while the engine's states are offloaded" in ledger["refused"]
        assert "call engine.reload_states() first" in ledger["refused"]
        assert ledger["restored"]["tier_device"] == before["tier_device"]


def _drop_in(zero: dict, optimizer: bool = True):
    import zeroshard.deepspeed as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    x = torch.randn(2, 8)
    if optimizer:
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine, x


def test_the_drop_in_names_and_deepspeeds_refusals():
    from zeroshard.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    engine, x = _drop_in({"stage": 2})
    want = engine(x).detach()
    engine.optimizer.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.lp_grads],
                                    device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False)
    assert engine.zeroshard.states.kinds == {"optim_states", "lp_grads"}
    assert engine(x).detach().equal(want)  # the parameters stayed: forward still runs
    with pytest.raises(ConfigError, match="step while the engine's states are offloaded"):
        engine.step()
    engine.reload_states()
    engine.backward(engine(x).square().mean())
    engine.step()
    with pytest.raises(ConfigError, match="only the cpu device"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ConfigError, match="unknown state 'masters'"):
        engine.offload_states(include=["masters"])
    engine.offload_states(device=OffloadDeviceEnum.none)  # DeepSpeed: nothing to do
    assert not engine.zeroshard.states.kinds

    host, _ = _drop_in({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    host.offload_states()  # DeepSpeed's _refine_include_states: states and masters are on the host already
    assert "optim_states" not in host.zeroshard.states.kinds and "hp_params" not in host.zeroshard.states.kinds
    host.reload_states()
    params, _ = _drop_in({"stage": 3, "offload_param": {"device": "cpu"}})
    with pytest.raises(ConfigError, match="offload_param"):
        params.offload_states()
    ref, _ = _drop_in({"stage": 3}, optimizer=False)
    with pytest.raises(ConfigError, match="no optimizer"):
        ref.offload_states()
