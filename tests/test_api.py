"""The public API in a single process (world size 1): initialize, optimizers, errors."""

from __future__ import annotations

import warnings

import pytest

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.models import FrozenMLP, build_gpt

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("bad,words", [
    ({**BASE, "zero_optimization": {"stage": "two"}}, ["zero_optimization.stage", "two"]),
    ({**BASE, "train_batch_size": 3, "gradient_accumulation_steps": 2}, ["train_batch_size", "3"]),
    ({**BASE, "zero_optimization": {"stage": 4}}, ["stage", "4"]),
    ({**BASE, "zero_optimization": {"reduce_bucket_size": -5}}, ["reduce_bucket_size", "-5"]),
])
def test_bad_config_fails_before_any_process_group(bad, words):
    with pytest.raises(zeroshard.ConfigError) as err:
        zeroshard.initialize(FrozenMLP(), bad)
    assert not dist.is_initialized()
    for w in words:
        assert w in str(err.value), f"{w!r} not in {err.value}"


def test_a_misspelt_top_level_block_loads_with_a_did_you_mean_note():
    """Unknown top-level keys load as DeepSpeed loads them (issue 42), with a note naming the
    likely key; the block's settings are not applied."""
    engine = zeroshard.initialize(FrozenMLP(), {**BASE, "zero_optimisation": {"stage": 1}})
    notes = " ".join(engine.settings.notes)
    assert "zero_optimisation" in notes and "zero_optimization" in notes and int(engine.settings.zero.stage) == 0
    engine.close()


def test_config_file_path_is_accepted(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}')
    engine = zeroshard.initialize(FrozenMLP(), str(path))
    assert engine.train_batch_size() == 4 and engine.world_size == 1


def test_optimizer_required_once():
    cfg = {"train_micro_batch_size_per_gpu": 2}
    engine = zeroshard.initialize(FrozenMLP(), cfg)  # no optimizer: an inference-only engine
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    loss = engine(x, y)[1]
    with pytest.raises(zeroshard.ConfigError, match="no optimizer"):
        engine.backward(loss)
    with pytest.raises(zeroshard.ConfigError, match="both"):
        zeroshard.initialize(FrozenMLP(), BASE, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def _train(engine_or_model, opt, steps=4, use_engine=True):
    torch.manual_seed(0)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    for _ in range(steps):
        if use_engine:
            engine_or_model.backward(engine_or_model(x, y)[1])
            engine_or_model.step()
        else:
            engine_or_model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("form", ["callable", "instance"])
def test_user_optimizer_param_groups_are_kept(form):
    torch.manual_seed(1)
    ref = FrozenMLP(frozen=())
    torch.manual_seed(1)
    model = FrozenMLP(frozen=())
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.01)
    _train(ref, ref_opt, use_engine=False)
    make = lambda params: torch.optim.AdamW(_groups(model), lr=0.01)  # noqa: E731
    arg = make if form == "callable" else make(None)
    engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}},
                                  optimizer=arg)
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.5, 0.0]
    _train(engine, None)
    got = engine.full_state_dict()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6)


def test_lr_scheduler_instance_is_rebound_and_stepped():
    model = FrozenMLP()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 2}, optimizer=opt, lr_scheduler=sched)
    with warnings.catch_warnings():
        # torch warns when the optimizer a scheduler follows has not stepped before it, or
        # does not carry the mark its schedulers check: the rebound one must do both
        warnings.simplefilter("error")
        _train(engine, None, steps=3)
    assert engine.get_lr() == [0.125]


def test_config_scheduler_and_accumulation_boundary():
    cfg = {**BASE, "gradient_accumulation_steps": 3,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.1,
                                                         "warmup_num_steps": 4, "warmup_type": "linear"}}}
    engine = zeroshard.initialize(FrozenMLP(), cfg)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    boundaries = []
    for _ in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y)[1])
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and engine.micro_steps == 6
    assert engine.get_global_grad_norm() > 0


def test_unused_parameter_policy():
    cfg = {**BASE, "zero_optimization": {"stage": 2, "ignore_unused_parameters": False}}
    engine = zeroshard.initialize(FrozenMLP(with_unused=True), cfg)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    with pytest.raises(zeroshard.ZeroShardError, match="unused.weight"):
        engine.backward(engine(x, y)[1])
    ok = zeroshard.initialize(FrozenMLP(with_unused=True), {**BASE, "zero_optimization": {"stage": 2}})
    before = ok.full_state_dict()["unused.weight"]
    ok.backward(ok(x, y)[1])
    ok.step()
    assert torch.equal(ok.full_state_dict()["unused.weight"], before)  # zero gradient, plain SGD


def test_bf16_engine_casts_inputs_and_reports_fp32_state():
    engine = zeroshard.initialize(build_gpt("tiny"), {**BASE, "bf16": {"enabled": True}})
    x = torch.randint(0, 64, (2, 16))
    logits, loss = engine(x, x)
    assert logits.dtype == torch.bfloat16
    engine.backward(loss)
    engine.step()
    state = engine.full_state_dict()
    assert all(t.dtype == torch.float32 for t in state.values())
    assert state["wte.weight"].data_ptr() != state["lm_head.weight"].data_ptr()
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])  # tied, reported under both names


def test_comm_and_memory_stats_shape():
    engine = zeroshard.initialize(FrozenMLP(), BASE)
    assert set(engine.comm_stats()) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"}
    assert set(engine.comm_stats()["all_reduce"]) >= {"calls", "elements", "bytes", "sent_bytes"}
    mem = engine.memory_stats()
    for key in ("params", "grads", "optimizer_states", "comm_buffers"):
        assert key in mem and f"peak_{key}" in mem
