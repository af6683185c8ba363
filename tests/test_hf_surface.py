"""The `deepspeed` package zeroshard serves: found as an installed distribution where (and
only where) it is served, and each served name behaving as DeepSpeed's (one process, fast)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import zeroshard.deepspeed as deepspeed
from zeroshard.deepspeed.shadow import SERVED_VERSION, SHADOW_DIR
from zeroshard.policies import ConfigError


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


_PROBE = ("import importlib.metadata as m, importlib.util as u\n"
          "spec = u.find_spec('deepspeed')\n"
          "try:\n    v = m.version('deepspeed')\nexcept m.PackageNotFoundError:\n    v = None\n"
          "print(spec is not None and spec.origin, v, (m.packages_distributions().get('deepspeed') or [None])[0])\n")


def _probe(env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_served_package_passes_the_availability_checks_of_transformers_and_accelerate():
    """find_spec + importlib.metadata (+ packages_distributions) see a `deepspeed` distribution."""
    from zeroshard.cli.deepspeed_shadow import shadow_env

    problem, env, line = shadow_env(argparse.Namespace(real_deepspeed=False), {"PATH": os.environ["PATH"]})
    assert problem is None and env["PYTHONPATH"].split(os.pathsep)[0] == SHADOW_DIR
    assert "zeroshard serves `import deepspeed`" in line
    origin, version, dist = _probe({**os.environ, **env})
    assert origin.startswith(SHADOW_DIR) and version == SERVED_VERSION and dist == "deepspeed"
    assert deepspeed.__version__ == SERVED_VERSION


def test_nothing_is_shadowed_outside_zeroshard_launch():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    installed = _probe(env)
    assert installed[0] == "False" or SHADOW_DIR not in installed[0]
    assert installed[1] != SERVED_VERSION


def test_real_deepspeed_flag_without_deepspeed_installed_is_one_clear_error():
    from zeroshard.cli.deepspeed_shadow import _installed_deepspeed, shadow_env

    if _installed_deepspeed() is not None:
        pytest.skip("a real DeepSpeed is installed here")
    problem, env, _ = shadow_env(argparse.Namespace(real_deepspeed=True))
    assert problem is not None and "--real-deepspeed" in problem and "pip install deepspeed" in problem


def test_served_modules_are_zeroshards_own_and_unserved_ones_say_so():
    script = ("import deepspeed, zeroshard.deepspeed as z\n"
              "from deepspeed.runtime.engine import DeepSpeedEngine\n"
              "from deepspeed.runtime.zero import partition_parameters as pp\n"
              "import deepspeed.accelerator, deepspeed.moe.utils, deepspeed.ops.adam, deepspeed.checkpoint.utils\n"
              "assert deepspeed is z and DeepSpeedEngine is z.DeepSpeedEngine\n"
              "assert pp.__name__ == 'zeroshard.deepspeed.runtime.zero.partition_parameters'\n"
              "try:\n    import deepspeed.inference.v2\nexcept ModuleNotFoundError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SHADOW_DIR})
    assert out.returncode == 0, out.stderr
    assert "ERR deepspeed.inference is not served by zeroshard" in out.stdout
    assert "--real-deepspeed" in out.stdout
    with pytest.raises(AttributeError, match="deepspeed.tp_model_init is not served by zeroshard"):
        deepspeed.tp_model_init


def test_get_accelerator_on_the_cpu(monkeypatch):
    from zeroshard.deepspeed.accelerator import ZeroshardAccelerator

    monkeypatch.setenv("LOCAL_RANK", "1")
    acc = ZeroshardAccelerator()
    assert (acc.device_name(), acc.current_device_name(), acc.communication_backend_name()) == ("cpu", "cpu", "gloo")
    assert acc.current_device() == 1 and acc.is_available() and acc.device_name(1) == "cpu"
    acc.manual_seed(3)
    a = torch.rand(4)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(4))
    acc.synchronize()
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and acc.on_accelerator(t)
    now = acc.memory_allocated()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    assert now > 0 and acc.max_memory_allocated() > now + 32 * 2**20  # the peak is read afresh, not only kept
    assert acc.memory_allocated() > now + 32 * 2**20
    del big
    assert acc.total_memory() > acc.available_memory() > 0
    assert torch.float32 in acc.supported_dtypes()
    with pytest.raises(ConfigError, match="create_op_builder"):
        acc.create_op_builder("CPUAdamBuilder")


def test_lr_schedules_names_and_classes():
    from zeroshard.deepspeed.runtime import lr_schedules
    from zeroshard.optim.schedulers import OneCycle, WarmupLR

    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                               "WarmupCosineLR"]
    assert lr_schedules.WarmupLR is WarmupLR
    assert lr_schedules.OneCycle is OneCycle
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert lr_schedules.OneCycle(opt, 0.01, 0.1).get_last_lr() == [0.01]


def test_clone_tensors_for_torch_save_owns_only_its_own_storage():
    from zeroshard.deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(1000.0)
    item = {"a": flat[10:14].view(2, 2), "b": [flat[:3], (flat[5:6], 7)], "c": "text"}
    out = clone_tensors_for_torch_save(item)
    assert out["a"].untyped_storage().nbytes() == 16 and torch.equal(out["a"], item["a"])
    assert torch.equal(out["b"][0], flat[:3]) and out["b"][1][1] == 7 and out["c"] == "text"
    out["a"].zero_()
    assert flat[10] == 10


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_deepspeed_adam_classes_are_torch_adam_with_deepspeeds_decay_modes(adamw_mode):
    from zeroshard.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    def steps(make) -> torch.Tensor:
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(5))
        opt = make([p])
        for _ in range(3):
            p.grad = torch.sin(p.detach() * 3)
            opt.step()
        return p.detach()

    ref = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    want = steps(lambda ps: ref(ps, lr=0.1, weight_decay=0.2))
    assert torch.allclose(steps(lambda ps: DeepSpeedCPUAdam(ps, lr=0.1, weight_decay=0.2, adamw_mode=adamw_mode)), want)
    assert torch.allclose(steps(lambda ps: FusedAdam(ps, lr=0.1, weight_decay=0.2, adam_w_mode=adamw_mode)), want)
    # DeepSpeed's positional order: FusedAdam's decay mode comes before weight_decay, the CPU class's after amsgrad
    assert torch.allclose(steps(lambda ps: FusedAdam(ps, 0.1, True, (0.9, 0.999), 1e-8, adamw_mode, 0.2)), want)
    assert torch.allclose(steps(lambda ps: DeepSpeedCPUAdam(ps, 0.1, True, (0.9, 0.999), 1e-8, 0.2, False, adamw_mode)),
                          want)
    with pytest.raises(ConfigError, match="AMSGrad"):
        FusedAdam([nn.Parameter(torch.zeros(1))], amsgrad=True)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_deepspeed_adam_classes_without_bias_correction_are_deepspeeds_uncorrected_update(adamw_mode):
    from zeroshard.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zeroshard.optim.uncorrected_adam import UncorrectedAdam

    def steps(make) -> tuple[torch.Tensor, torch.optim.Optimizer]:
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(5))
        opt = make([p])
        for _ in range(3):
            p.grad = torch.sin(p.detach() * 3)
            opt.step()
        return p.detach(), opt

    want, _ = steps(lambda ps: UncorrectedAdam(ps, lr=0.1, weight_decay=0.2, adam_w_mode=adamw_mode))
    corrected, _ = steps(lambda ps: UncorrectedAdam(ps, lr=0.1, weight_decay=0.2, adam_w_mode=not adamw_mode))
    assert not torch.allclose(want, corrected)  # the decay mode matters here
    for make in (lambda ps: FusedAdam(ps, lr=0.1, bias_correction=False, weight_decay=0.2, adam_w_mode=adamw_mode),
                 lambda ps: FusedAdam(ps, 0.1, False, (0.9, 0.999), 1e-8, adamw_mode, 0.2),
                 lambda ps: DeepSpeedCPUAdam(ps, lr=0.1, bias_correction=False, weight_decay=0.2, adamw_mode=adamw_mode)):
        got, opt = steps(make)
        assert isinstance(opt, UncorrectedAdam) and torch.equal(got, want)
    with pytest.raises(ConfigError, match="amsgrad"):
        DeepSpeedCPUAdam([nn.Parameter(torch.zeros(1))], bias_correction=False, amsgrad=True)


def test_deepspeed_adam_keeps_its_decay_mode_when_zeroshard_rebuilds_it():
    from zeroshard.deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ref = nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt = DeepSpeedCPUAdam(model.parameters(), lr=0.1, weight_decay=0.5, adamw_mode=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={"train_micro_batch_size_per_gpu": 2})
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1, weight_decay=0.5)
    x = torch.randn(2, 4)
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.zeroshard.full_state_dict()
    for name, w in ref.state_dict().items():
        assert torch.allclose(got[name], w, atol=1e-6), name


def test_moe_utils_leave_groups_of_a_model_without_experts_unchanged():
    from zeroshard.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = nn.Linear(3, 3)
    group = {"params": list(model.parameters()), "name": "parameters", "lr": 0.1}
    assert split_params_into_different_moe_groups_for_optimizer(group) == [group]
    assert split_params_into_different_moe_groups_for_optimizer((group,)) == [group]
    model.weight.allreduce = False  # how DeepSpeed marks an expert parameter
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        split_params_into_different_moe_groups_for_optimizer(group)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_safe_get_and_set_full_fp32_param_grad_and_optimizer_state(stage):
    from zeroshard.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    zero = {"stage": stage, "reduce_bucket_size": 16}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, leaf_module={"classes": ["Linear"]})
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": zero})
    weight = model[1].weight
    x = torch.randn(2, 4)
    full = safe_get_full_fp32_param(weight)
    assert full.shape == (2, 8) and torch.equal(full, engine.zeroshard.full_state_dict()["1.weight"])
    assert safe_get_full_fp32_param(model[0].bias) is None  # frozen: no fp32 master, as DeepSpeed
    assert safe_get_full_optimizer_state(weight, "exp_avg") is None  # before the first step

    # the reduced gradient, between the boundary's backward and step
    ref = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ref.load_state_dict(engine.zeroshard.full_state_dict())
    ref(x).pow(2).mean().backward()
    engine.backward(engine(x).pow(2).mean())
    assert torch.allclose(safe_get_full_grad(weight), ref[1].weight.grad, atol=1e-6)
    engine.step()
    state = safe_get_full_optimizer_state(weight, "exp_avg")
    assert torch.allclose(state, 0.1 * ref[1].weight.grad, atol=1e-6)  # Adam's first step: (1 - beta1) * g

    new = torch.full((2, 8), 0.25)
    safe_set_full_fp32_param(weight, new)
    assert torch.equal(safe_get_full_fp32_param(weight), new)
    assert torch.equal(engine.zeroshard.full_state_dict()["1.weight"], new)
    engine.eval()
    with torch.no_grad():
        out = engine(x)
    ref[1].weight.data.copy_(new)
    ref[0].load_state_dict({k[2:]: v for k, v in engine.zeroshard.full_state_dict().items() if k.startswith("0.")})
    ref[1].bias.data.copy_(engine.zeroshard.full_state_dict()["1.bias"])
    assert torch.allclose(out, ref(x), atol=1e-6)  # the forward uses the value set


def test_set_z3_leaf_modules_makes_gather_units():
    from zeroshard.deepspeed.utils import set_z3_leaf_modules

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    model = nn.Sequential(Block(), Block(), nn.Linear(4, 2))
    assert len(set_z3_leaf_modules(model, [Block])) == 2
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    assert engine.config["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    units = {type(u.module).__name__ for u in engine.zeroshard.units}
    assert "Block" in units and not any(type(u.module).__name__ == "Linear" and u.module in (model[0].a, model[0].b)
                                        for u in engine.zeroshard.units)
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, [nn.Conv2d])


def test_opting_in_outside_the_launcher(tmp_path):
    """`python -m zeroshard.deepspeed.shadow script.py ARGS` serves `deepspeed` to one script
    (and, through PYTHONPATH, to what it starts); `--path` prints the folder to put on PYTHONPATH."""
    script = tmp_path / "probe.py"
    script.write_text("import sys, importlib.metadata as m, deepspeed, zeroshard.deepspeed as z\n"
                      "print('OK', m.version('deepspeed'), deepspeed is z, sys.argv[1:], __name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "zeroshard.deepspeed.shadow", str(script), "--flag", "x"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"OK {SERVED_VERSION} True ['--flag', 'x'] __main__" in out.stdout
    path = subprocess.run([sys.executable, "-m", "zeroshard.deepspeed.shadow", "--path"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert path.stdout.strip() == SHADOW_DIR


def test_zero_init_parameters_show_deepspeeds_shard_attributes():
    """transformers and DeepSpeed tools read `ds_tensor` / `ds_numel` / `ds_shape`; they follow
    writes made inside the context and under GatheredParameters; at initialize() the engine's own
    take their place (stage 3: ds_id, ds_status, ds_tensor over the engine's shard)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
            nn.init.constant_(self.a.weight, 0.5)  # a write to a sharded parameter, inside the context

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Model()
    w = model.a.weight
    assert (w.ds_numel, tuple(w.ds_shape)) == (16, (4, 4)) and torch.equal(w.ds_tensor, torch.full((16,), 0.5))
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        with torch.no_grad():
            w.fill_(2.0)
    assert torch.equal(w.ds_tensor, torch.full((16,), 2.0))
    init_shard = w.ds_tensor
    deepspeed.initialize(model=model, config=config)
    from zeroshard.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert w.ds_tensor is not init_shard and torch.equal(w.ds_tensor, torch.full((16,), 2.0))
    assert w.ds_status is ZeroParamStatus.AVAILABLE and w.ds_persist and isinstance(w.ds_id, int)  # 16 elements: kept whole


def test_runtime_utils_helpers(caplog):
    from zeroshard.deepspeed.runtime.utils import move_to_device, see_memory_usage

    item = {"a": torch.ones(2), "b": [torch.zeros(1, dtype=torch.int64), ("x", torch.ones(1))]}
    moved = move_to_device(item, "meta", lambda t: t.is_floating_point())
    assert moved["a"].is_meta and not moved["b"][0].is_meta and moved["b"][1][1].is_meta and moved["b"][1][0] == "x"
    with caplog.at_level("INFO", logger="zeroshard.deepspeed"):
        see_memory_usage("before", force=False)
        assert caplog.text == ""
        see_memory_usage("after build", force=True)
    assert "after build" in caplog.text and "Max_MA" in caplog.text and "CPU Virtual Memory" in caplog.text
