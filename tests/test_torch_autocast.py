"""DeepSpeed's `torch_autocast` section (issue 42): the forward runs under `torch.autocast` in
its dtype, parameters, gradients and their reduction stay fp32.

The oracle: one process running each rank's micro-batch in turn under the same autocast,
its gradients accumulated as the ranks' are averaged (each rank's rows rounded to bf16 in the
same kernels on the same shapes, so only fp32 sums differ: DESIGN.md section 9's SGD bound,
1e-5 of each tensor's largest entry). The same run in plain fp32 differs from that
reference by far more than the bound, so a forward that is not autocast fails.
"""

from __future__ import annotations

import pytest
import torch

from distributed import one_group, run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model, sgd_close, torch_optimizer, train_engine
from zeroshard.api.surface import resolve_autocast
from zeroshard.config import load_config
from zeroshard.policies import ConfigError, NotSupportedYetError

WORLD = 2
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}


def _reference(case: Case, autocast: bool) -> dict[str, torch.Tensor]:
    model = make_model(case)
    opt = torch_optimizer(case, list(model.parameters()))
    for step in range(case.steps):
        x, y = batch(case, step, WORLD)
        for rank in range(WORLD):
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_of(model, x[lo:hi], y[lo:hi])
            (loss / WORLD).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ranks(rank, world_size, stages):
    out = {}
    with one_group():
        for stage in stages:
            case = Case(stage=stage)
            engine, _ = train_engine(case, rank, world_size, {**config_for(case, world_size), "torch_autocast": AUTOCAST})
            seen = []
            hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
                     for m in engine.module.modules() if isinstance(m, torch.nn.Linear)]
            x, y = batch(case, 0, world_size)
            engine.eval()
            with torch.no_grad():
                loss_of(engine, x[:MICRO], y[:MICRO])
            for h in hooks:
                h.remove()
            out[stage] = {"state": engine.full_state_dict(), "linear_out": sorted({str(d) for d in seen}),
                          "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters() if p.numel()})}
            engine.close()
    return out


@pytest.mark.parametrize("stages", [[0, 2], pytest.param([1, 3], marks=pytest.mark.slow)], ids=["z0z2", "z1z3"])
def test_autocast_training_equals_one_process_under_the_same_autocast(stages):
    results = run_ranks(_ranks, WORLD, stages, timeout=240)
    want, fp32 = _reference(Case(), True), _reference(Case(), False)
    assert sgd_close(fp32, want), "the fp32 run is within the bound of the autocast one: the test could not fail"
    for stage in stages:
        for r in results:
            got = r[stage]
            assert got["linear_out"] == ["torch.bfloat16"], got["linear_out"]
            assert got["param_dtypes"] == ["torch.float32"], got["param_dtypes"]
            bad = sgd_close({k: v.float() for k, v in got["state"].items()}, want)
            assert not bad, f"stage {stage}: {bad[:3]}"


def _load(section, **extra):
    return load_config({"train_micro_batch_size_per_gpu": 2, "torch_autocast": section, **extra}, world_size=1)


def test_autocast_config():
    default = _load({"enabled": True})  # no dtype: torch.autocast's default for the device
    assert default.runtime.autocast == "default"
    assert resolve_autocast(default, torch.device("cpu")).runtime.autocast == "bfloat16"
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)  # as on CUDA: the default is float16, with its scaler
    try:
        fp16 = resolve_autocast(default, torch.device("cpu"))
        assert fp16.runtime.autocast == "float16" and fp16.precision.loss_scale.rule == "torch"
        bf16_model = _load({"enabled": True}, bf16={"enabled": True})
        with pytest.raises(NotSupportedYetError, match="runs in float16 on cpu, which with a bf16 model"):
            resolve_autocast(bf16_model, torch.device("cpu"))
    finally:
        torch.set_autocast_dtype("cpu", before)
    assert _load({"enabled": True, "dtype": "bf16"}).runtime.autocast == "bfloat16"
    assert _load({"enabled": False, "dtype": "bf16"}).runtime.autocast is None
    assert any(n.startswith("torch_autocast: the forward runs under torch.autocast") for n in
               _load({"enabled": True, "dtype": "torch.bfloat16"}).notes)
    half = _load({"enabled": True, "dtype": "fp16"})
    assert half.runtime.autocast == "float16" and half.precision.loss_scale.rule == "torch"
    assert half.precision.compute.value == "fp32"
    assert any(n.startswith("torch_autocast in float16: the loss is scaled") for n in half.notes)
    assert _load({"enabled": True, "dtype": "bf16"}).precision.loss_scale is None
    for model in ("fp16", "bf16"):
        with pytest.raises(NotSupportedYetError, match=f"torch_autocast in float16 with {model}.enabled is not built"):
            _load({"enabled": True, "dtype": "fp16"}, **{model: {"enabled": True}})
    with pytest.raises(ConfigError, match="DeepSpeed refuses this pair"):
        _load({"enabled": True, "dtype": "bf16"}, zero_optimization={"stage": 3, "zero_quantized_weights": True})
    with pytest.raises(ConfigError, match="torch_autocast.dtype = 'int8' is not a dtype autocast runs in"):
        _load({"enabled": True, "dtype": "int8"})


# ---------------------------------------------------------------- float16: DeepSpeed's GradScaler
BLOW_UP = 1, 1e6  # at this step the loss is multiplied by this: its fp16 backward overflows


def _fp16_reference(case: Case) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process as DeepSpeed at stage 0: fp32 model, forward under fp16 autocast,
    torch.amp.GradScaler with its defaults around a torch optimizer."""
    model = make_model(case)
    opt = torch_optimizer(case, list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    for step in range(case.steps):
        x, y = batch(case, step, WORLD)
        for rank in range(WORLD):
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, x[lo:hi], y[lo:hi]) * (BLOW_UP[1] if step == BLOW_UP[0] else 1.0)
            scaler.scale(loss / WORLD).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
        scales.append(scaler.get_scale())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, scales


def _fp16_ranks(rank, world_size, stages):
    import zeroshard

    out = {}
    with one_group():
        for stage in stages:
            case = Case(stage=stage)
            cfg = {**config_for(case, world_size), "torch_autocast": {"enabled": True, "dtype": "fp16"}}
            engine = zeroshard.initialize(make_model(case), cfg)
            scales = []
            for step in range(case.steps):
                x, y = batch(case, step, world_size)
                lo, hi = rank * MICRO, (rank + 1) * MICRO
                loss = loss_of(engine, x[lo:hi], y[lo:hi]) * (BLOW_UP[1] if step == BLOW_UP[0] else 1.0)
                engine.backward(loss)
                engine.step()
                scales.append(engine.loss_scale)
            out[stage] = {"state": engine.full_state_dict(), "scales": scales, "skipped": engine.skipped_steps}
            engine.close()
    return out


@pytest.mark.parametrize("stages", [[0, 3], pytest.param([1, 2], marks=pytest.mark.slow)], ids=["z0z3", "z1z2"])
def test_float16_autocast_scales_and_skips_as_torchs_grad_scaler(stages):
    results = run_ranks(_fp16_ranks, WORLD, stages, timeout=240)
    want, scales = _fp16_reference(Case())
    assert scales[BLOW_UP[0]] == scales[0] / 2 == 2.0**15  # the reference overflowed there and skipped
    for stage in stages:
        for r in results:
            got = r[stage]
            assert got["scales"] == scales and got["skipped"] == 1, (stage, got["scales"], scales)
            bad = sgd_close({k: v.float() for k, v in got["state"].items()}, want)
            assert not bad, f"stage {stage}: {bad[:3]}"


def test_grad_scaler_rule_is_torchs_update():
    """GradScalerRule against torch's own kernel (`_amp_update_scale_`, what GradScaler.update
    runs), with a growth interval of 3 over a fixed mix of good and overflowing steps."""
    from zeroshard.optim.loss_scaler import GradScalerRule

    ours = GradScalerRule(growth_interval=3)
    scale, tracker = torch.full((1,), 2.0**16), torch.zeros(1, dtype=torch.int32)
    for overflow in [0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]:
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(overflow)), 2.0, 0.5, 3)
        ours.update(bool(overflow))
        assert (ours.scale, ours.growth_tracker) == (scale.item(), tracker.item())
    assert ours.skipped_steps == 3
