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
    if torch.cuda.is_available():  # float16 on CUDA: not built yet
        with pytest.raises(NotSupportedYetError, match="float16"):
            resolve_autocast(default, torch.device("cuda"))
    assert _load({"enabled": True, "dtype": "bf16"}).runtime.autocast == "bfloat16"
    assert _load({"enabled": False, "dtype": "bf16"}).runtime.autocast is None
    assert any(n.startswith("torch_autocast: the forward runs under torch.autocast") for n in
               _load({"enabled": True, "dtype": "torch.bfloat16"}).notes)
    with pytest.raises(NotSupportedYetError, match="torch_autocast in float16 is not built yet"):
        _load({"enabled": True, "dtype": "fp16"})
    with pytest.raises(ConfigError, match="torch_autocast.dtype = 'int8' is not a dtype autocast runs in"):
        _load({"enabled": True, "dtype": "int8"})
