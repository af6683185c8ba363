"""build_optimizer: DeepSpeed optimizer sections to torch optimizers."""

import copy

import pytest
import torch

from zeroshard.optim.factory import build_optimizer, optimizer_kernel, optimizer_state_bytes_per_param
from zeroshard.policies import ConfigError, NotSupportedYetError, OptimizerSpec


def _params(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 4, generator=g)) for _ in range(n)]


def _grads(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _run(opt, params, steps=5):
    for k in range(steps):
        _grads(params, seed=k)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    "kind, cls",
    [("adam", torch.optim.AdamW), ("Adam", torch.optim.AdamW), ("adamw", torch.optim.AdamW),
     ("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad)],
)
def test_each_type_builds_and_steps(kind, cls):
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = build_optimizer(OptimizerSpec(kind, {"lr": 0.1}), params)
    assert type(opt) is cls
    _grads(params)
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, params))


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd", "adagrad"])
def test_fused_kernel_chosen_on_cpu(kind):
    opt = build_optimizer(OptimizerSpec(kind, {}), _params())
    # torch 2.4+ ships fused CPU kernels for all four.
    assert optimizer_kernel(opt) == "fused"


def test_kernel_names():
    p = _params()
    assert optimizer_kernel(torch.optim.SGD(p, lr=0.1, foreach=True)) == "foreach"
    assert optimizer_kernel(torch.optim.SGD(p, lr=0.1, foreach=False)) == "for-loop"


def test_deepspeed_param_mapping():
    spec = OptimizerSpec(
        "adam",
        {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
         "bias_correction": True, "torch_adam": True, "amsgrad": True},
    )
    opt = build_optimizer(spec, _params())
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"], d["amsgrad"]) == (
        3e-4, (0.8, 0.95), 1e-6, 0.1, True,
    )
    sgd = build_optimizer(
        OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.0}),
        _params(),
    )
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (0.9, True)


def test_adam_weight_decay_defaults_to_zero_like_deepspeed():
    assert build_optimizer(OptimizerSpec("adam", {}), _params()).defaults["weight_decay"] == 0.0
    assert build_optimizer(OptimizerSpec("adamw", {}), _params()).defaults["weight_decay"] == 0.0


def test_param_groups_accepted():
    a, b = _params(n=2)
    opt = build_optimizer(
        OptimizerSpec("adamw", {"lr": 0.01, "weight_decay": 0.1}),
        [{"params": [a]}, {"params": [b], "weight_decay": 0.0}],
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize(
    "kind, adam_w_mode, reference",
    [("adam", True, torch.optim.AdamW), ("adam", False, torch.optim.Adam),
     ("adamw", False, torch.optim.AdamW), ("adamw", True, torch.optim.AdamW)],
)
def test_adam_w_mode_semantics_numerically(kind, adam_w_mode, reference):
    hp = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.5}
    ours = _params()
    ref = copy.deepcopy(ours)
    got = _run(build_optimizer(OptimizerSpec(kind, {**hp, "adam_w_mode": adam_w_mode}), ours), ours)
    want = _run(reference(ref, foreach=False, **hp), ref)
    other = torch.optim.Adam if reference is torch.optim.AdamW else torch.optim.AdamW
    ref2 = copy.deepcopy(_params())
    not_want = _run(other(ref2, foreach=False, **hp), ref2)
    for g, w, n in zip(got, want, not_want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert (g - n).abs().max() > 1e-3  # decoupled and L2 decay really differ here


def test_unknown_key_error_names_optimizer_key_and_valid_keys():
    with pytest.raises(ConfigError, match=r"'sgd'.*\['foo'\].*valid keys.*momentum"):
        build_optimizer(OptimizerSpec("sgd", {"lr": 0.1, "foo": 1}), _params())
    with pytest.raises(ConfigError, match="adam_w_mode"):
        build_optimizer(OptimizerSpec("sgd", {"adam_w_mode": True}), _params())


def test_other_errors():
    with pytest.raises(ConfigError, match="amsgrad with bias_correction=false"):
        build_optimizer(OptimizerSpec("adam", {"bias_correction": False, "amsgrad": True}), _params())
    with pytest.raises(ConfigError, match="gradient_clipping"):
        build_optimizer(OptimizerSpec("adamw", {"max_grad_norm": 1.0}), _params())
    with pytest.raises(NotSupportedYetError, match="musgd"):
        build_optimizer(OptimizerSpec("musgd", {}), _params())
    with pytest.raises(ConfigError, match="unknown optimizer type"):
        build_optimizer(OptimizerSpec("rmsprop2", {}), _params())
    with pytest.raises(ConfigError, match="betas"):
        build_optimizer(OptimizerSpec("adam", {"betas": [0.9]}), _params())
    with pytest.raises(ConfigError, match="'sgd'"):
        build_optimizer(OptimizerSpec("sgd", {"lr": -1.0}), _params())


def test_state_bytes_per_param():
    assert optimizer_state_bytes_per_param(OptimizerSpec("adam")) == 8
    assert optimizer_state_bytes_per_param(OptimizerSpec("adamw", {"amsgrad": True})) == 12
    assert optimizer_state_bytes_per_param(OptimizerSpec("sgd", {"momentum": 0.9})) == 4
    assert optimizer_state_bytes_per_param(OptimizerSpec("sgd")) == 0
    assert optimizer_state_bytes_per_param(OptimizerSpec("adagrad")) == 4
    # Matches what torch actually allocates (ignoring scalar step counters).
    for spec in [OptimizerSpec("adam"), OptimizerSpec("sgd", {"momentum": 0.9}), OptimizerSpec("adagrad")]:
        params = _params(n=1)
        opt = build_optimizer(spec, params)
        _grads(params)
        opt.step()
        state = opt.state[params[0]]
        nbytes = sum(v.numel() * v.element_size() for v in state.values() if v.ndim > 0)
        assert nbytes == optimizer_state_bytes_per_param(spec) * params[0].numel()


def test_kernel_fallback_order(monkeypatch):
    import zeroshard.optim.factory as factory

    real = factory._probe
    monkeypatch.setattr(factory, "_probe", lambda cls, kw, dev: not kw.get("fused") and real(cls, kw, dev))
    assert optimizer_kernel(build_optimizer(OptimizerSpec("adam"), _params())) == "foreach"
    monkeypatch.setattr(factory, "_probe", lambda cls, kw, dev: False)
    opt = build_optimizer(OptimizerSpec("adam"), _params())
    assert optimizer_kernel(opt) == "for-loop"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a CPU-only build")
def test_unavailable_device_type():
    with pytest.raises(ConfigError, match="cuda"):
        build_optimizer(OptimizerSpec("adam"), _params(), device_type="cuda")
