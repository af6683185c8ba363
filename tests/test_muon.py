"""DeepSpeed's `Muon` optimizer (issue 42): zeroshard's Muon (optim/muon.py) against Keller
Jordan's algorithm written out per tensor in this file (momentum, Nesterov blend, quintic
Newton-Schulz on the whole matrix, aspect-ratio scale; AdamW for the parameters DeepSpeed's
rule leaves out); sharded at stages 0-3 on 2 gloo ranks against one process of that loop
(DESIGN.md section 9's oracle, judged by the 2% rule); the ledger's extra all-gather (the
blended update of the Muon buckets, once per step at stages 1-3, none at stage 0); DeepSpeed's
error for an untagged parameter and the combinations DeepSpeed refuses.
"""

from __future__ import annotations

import pytest
import torch

import zeroshard

from distributed import one_group, run_ranks
from oracle import Case, adam_fraction_off, config_for, make_model, run_steps, train_engine, train_reference
from zeroshard.config import load_config
from zeroshard.optim.factory import build_optimizer
from zeroshard.policies import ConfigError, NotSupportedYetError, OptimizerSpec

MUON_LR, ADAM_LR, MOMENTUM, WD = 0.02, 2e-3, 0.9, 0.01
PARAMS = {"muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD, "ns_method": "standard"}
SECTION = {"type": "Muon", "params": PARAMS}


def deepspeed_rule(name: str, p: torch.Tensor) -> bool:
    """deepspeed.set_optimizer_flags: matrices whose name has neither "embed" nor "lm_head"."""
    return p.dim() >= 2 and "embed" not in name.lower() and "lm_head" not in name.lower()


class ReferenceMuon:
    """The algorithm per tensor: Muon for the tagged matrices, torch's AdamW (betas (0.9, 0.95),
    eps 1e-10: Muon's Adam defaults) for the rest."""

    def __init__(self, params, tags, nesterov=True):
        self.params, self.tags, self.nesterov = list(params), list(tags), nesterov
        self.bufs = [torch.zeros_like(p) for p in self.params]
        rest = [p for p, t in zip(self.params, self.tags) if not t]
        self.adam = torch.optim.AdamW(rest, lr=ADAM_LR, betas=(0.9, 0.95), eps=1e-10, weight_decay=WD)

    @staticmethod
    def orthogonalize(G):
        a, b, c = 3.4445, -4.7750, 2.0315
        X = G.clone()
        if G.size(0) > G.size(1):
            X = X.T
        X = X / (X.norm() + 1e-7)
        for _ in range(5):
            A = X @ X.T
            B = b * A + c * A @ A
            X = a * X + B @ X
        return X.T if G.size(0) > G.size(1) else X

    @torch.no_grad()
    def step(self):
        for p, buf, tag in zip(self.params, self.bufs, self.tags):
            if not tag:
                continue
            g = p.grad
            buf.copy_(MOMENTUM * buf + (1 - MOMENTUM) * g)
            u = (1 - MOMENTUM) * g + MOMENTUM * buf if self.nesterov else buf
            o = self.orthogonalize(u) * max(1.0, p.size(0) / p.size(1)) ** 0.5
            p.copy_(p * (1 - MUON_LR * WD) - MUON_LR * o)
        self.adam.step()

    def zero_grad(self, set_to_none=False):
        for p in self.params:
            p.grad.zero_()


def _tags(case: Case) -> list[bool]:
    return [deepspeed_rule(n, p) for n, p in make_model(case).named_parameters() if p.requires_grad]


def test_muon_equals_the_algorithm_per_tensor():
    torch.manual_seed(0)
    ours = [torch.randn(12, 5, requires_grad=True), torch.randn(4, 9, requires_grad=True),
            torch.randn(7, requires_grad=True)]
    ref_params = [t.detach().clone().requires_grad_() for t in ours]
    for t, tag in zip(ours, (True, True, False)):
        t.use_muon = tag
    opt = build_optimizer(OptimizerSpec("muon", PARAMS), ours)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[0]["lr"] == MUON_LR and opt.param_groups[1]["lr"] == ADAM_LR
    assert opt.param_groups[1]["betas"] == (0.9, 0.95) and opt.param_groups[1]["eps"] == 1e-10
    ref = ReferenceMuon(ref_params, (True, True, False))
    for _ in range(4):
        for a, b in zip(ours, ref_params):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert set(opt.state[ours[0]]) == {"momentum_buffer"} and set(opt.state[ours[2]]) >= {"exp_avg", "exp_avg_sq"}


def _muon_buckets_numel(engine) -> int:
    groups = engine.optimizer.param_groups
    return sum(b.layout.padded_numel for b in engine.buckets if groups[b.layout.group]["use_muon"])


def _config(case: Case, section: dict) -> dict:
    cfg = {**config_for(case, 2), "optimizer": section}
    if case.stage == 3:  # DeepSpeed refuses Muon with stage 3's reduce-scatter
        cfg["zero_optimization"] = {**cfg["zero_optimization"], "reduce_scatter": False}
    return cfg


def _sharded(rank, world_size, stages, with_adam):
    out = {}
    with one_group():
        for stage in stages:
            case = Case(stage=stage)
            engine, _ = train_engine(case, rank, world_size, _config(case, SECTION))
            out[f"gathered{stage}"] = engine.comm_stats()["all_gather"]["bytes"]
            out[stage] = engine.full_state_dict()
            out[f"muon_numel{stage}"] = _muon_buckets_numel(engine)
            out[f"step_mode{stage}"] = engine.optimizer.can_step_early
            engine.close()
            if with_adam:  # AdamW over the same two groups, so the same buckets: only Muon's gather differs
                model = make_model(case)
                halves = [[p for n, p in model.named_parameters() if deepspeed_rule(n, p) is tag] for tag in (True, False)]
                cfg = {k: v for k, v in _config(case, SECTION).items() if k != "optimizer"}
                engine = zeroshard.initialize(model, cfg, torch.optim.AdamW([{"params": h} for h in halves], lr=ADAM_LR))
                run_steps(engine, case, rank, world_size)
                out[f"adam_gathered{stage}"] = engine.comm_stats()["all_gather"]["bytes"]
                engine.close()
    return out


def _check_sharded(stages, with_adam):
    results = run_ranks(_sharded, 2, stages, with_adam, timeout=300)
    case = Case()
    want = train_reference(case, 2, make_optimizer=lambda params: ReferenceMuon(params, _tags(case)))
    for stage in stages:
        got = {k: v.float() for k, v in results[0][stage].items()}
        frac = adam_fraction_off(got, want)
        assert frac <= 0.02, f"stage {stage}: {frac:.2%} of Muon entries differ by > 1e-3 relative (limit 2%)"
        assert all(torch.equal(results[0][stage][k], results[1][stage][k]) for k in want)
        assert not results[0][f"step_mode{stage}"] or stage == 0  # gathers: every rank steps in order
        if with_adam:  # the blended update of every Muon bucket, fp32, once per step, at stages 1-3 only
            extra = results[0][f"gathered{stage}"] - results[0][f"adam_gathered{stage}"]
            assert extra == (case.steps * 4 * results[0][f"muon_numel{stage}"] if stage else 0), (stage, extra)
    return results


def test_sharded_muon_at_stages_0_to_3_equals_one_process_and_the_ledger_shows_the_gather():
    _check_sharded([0, 1, 3], with_adam=True)


@pytest.mark.slow
def test_sharded_muon_at_stage_2_equals_one_process():
    _check_sharded([2], with_adam=True)


def test_untagged_parameter_gives_deepspeeds_error():
    with pytest.raises(ConfigError, match="needs every parameter tagged with use_muon, and 1 are not"):
        build_optimizer(OptimizerSpec("muon", {}), [torch.zeros(2, 2, requires_grad=True)])


def test_drop_in_initialize_tags_like_deepspeed_and_refuses_foreign_parameters():
    """deepspeed.initialize tags the model (overwriting) and builds Muon from the config; a
    parameter outside the model in model_parameters has no tag: DeepSpeed's ValueError."""
    from zeroshard.deepspeed import initialize

    case = Case(stage=1, steps=3)
    model = make_model(case)
    model.h[0].ln_1.weight.use_muon = True  # overwritten by DeepSpeed's rule
    engine, opt, *_ = initialize(model=model, config={**config_for(case, 1), "optimizer": SECTION})
    run_steps(engine, case, 0, 1)
    assert not model.h[0].ln_1.weight.use_muon and model.h[0].attn.c_attn.weight.use_muon
    got = {k: v.float() for k, v in engine.module.state_dict().items()}
    want = train_reference(case, 1, make_optimizer=lambda params: ReferenceMuon(params, _tags(case)))
    assert adam_fraction_off(got, want) <= 0.02
    stray = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="model_parameters holds parameters that model does not"):
        initialize(model=make_model(case), model_parameters=[*make_model(case).parameters(), stray],
                   config={**config_for(case, 1), "optimizer": SECTION})


@pytest.mark.parametrize("zero, error, words", [
    ({"stage": 3}, ConfigError, "zero_optimization.reduce_scatter = true: DeepSpeed refuses"),
    ({"stage": 3, "reduce_scatter": False, "zero_quantized_gradients": True}, ConfigError,
     "zero_optimization.zero_quantized_gradients = true"),
    ({"stage": 3, "reduce_scatter": False, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
     NotSupportedYetError, "nvme"),
])
def test_refused_combinations(zero, error, words):
    with pytest.raises(error, match=words):
        load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": SECTION, "zero_optimization": zero}, 2)
    for stage in (0, 1, 2):  # accepted, as in DeepSpeed
        load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": SECTION, "zero_optimization": {"stage": stage}}, 2)


def test_bad_parameters_are_one_line_errors():
    p = torch.zeros(2, 2, requires_grad=True)
    p.use_muon = True
    with pytest.raises(ConfigError, match="unknown parameter"):
        build_optimizer(OptimizerSpec("muon", {"nesterov": False}), [p])
    with pytest.raises(ConfigError, match="ns_method"):
        build_optimizer(OptimizerSpec("muon", {"ns_method": "svd"}), [p])
    with pytest.raises(NotSupportedYetError, match="per_head_muon"):
        build_optimizer(OptimizerSpec("muon", {"per_head_muon": True}), [p])


def test_checkpoint_resume_keeps_each_halfs_states(tmp_path):
    """Muon's halves keep different states (momentum_buffer; step, exp_avg, exp_avg_sq): a
    checkpoint records them per bucket, and 3 steps + save + load + 2 steps train as 5 do."""
    from oracle import MICRO, batch, loss_of

    case = Case(stage=2, steps=3)
    engine, _ = train_engine(case, 0, 1, _config(case, SECTION))
    engine.save_checkpoint(str(tmp_path), tag="three")
    engine.close()
    engine = zeroshard.initialize(make_model(case), _config(case, SECTION))
    engine.load_checkpoint(str(tmp_path), tag="three")
    names = {frozenset(s) for s in engine.optimizer.state.values()}
    assert names == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}
    for step in (3, 4):
        x, y = batch(case, step, 1)
        engine.backward(loss_of(engine, x[:MICRO], y[:MICRO]))
        engine.step()
    got = {k: v.float() for k, v in engine.module.state_dict().items()}
    full = case.with_(steps=5)
    want = train_reference(full, 1, make_optimizer=lambda params: ReferenceMuon(params, _tags(full)))
    assert adam_fraction_off(got, want) <= 0.02
    engine.close()


def test_deepspeed_muon_instance_is_rebuilt_over_the_shards():
    """A script's own `MuonWithAuxAdam(param_groups)` (DeepSpeed's class, groups with use_muon)
    given to deepspeed.initialize: rebuilt over the fp32 shards, trains as the algorithm."""
    from zeroshard.deepspeed import initialize
    from zeroshard.deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    case = Case(stage=2, steps=3)
    cfg = config_for(case, 1)
    del cfg["optimizer"]
    model = make_model(case)
    halves = [[p for n, p in model.named_parameters() if deepspeed_rule(n, p) is tag] for tag in (True, False)]
    groups = [dict(params=halves[0], use_muon=True, lr=MUON_LR, momentum=MOMENTUM, weight_decay=WD),
              dict(params=halves[1], use_muon=False, lr=ADAM_LR, weight_decay=WD)]
    engine, *_ = initialize(model=model, optimizer=MuonWithAuxAdam(groups), config=cfg)
    run_steps(engine, case, 0, 1)
    assert type(engine.optimizer.optimizer) is MuonWithAuxAdam
    got = {k: v.float() for k, v in engine.module.state_dict().items()}
    want = train_reference(case, 1, make_optimizer=lambda params: ReferenceMuon(params, _tags(case)))
    assert adam_fraction_off(got, want) <= 0.02


def test_no_tagged_matrix_is_all_adam_with_muons_adam_defaults():
    """Nothing tagged use_muon = True: DeepSpeed builds only the Adam half, AdamW with Muon's
    Adam defaults (betas (0.9, 0.95), eps 1e-10) and the config's lr and weight decay."""
    torch.manual_seed(0)
    ours = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    for t in ours:
        t.use_muon = False
    ref = [t.detach().clone().requires_grad_() for t in ours]
    opt = build_optimizer(OptimizerSpec("muon", {"lr": 1e-2, "weight_decay": 0.1}), ours)
    assert [g["use_muon"] for g in opt.param_groups] == [False]
    adamw = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    for _ in range(3):
        for a, b in zip(ours, ref):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        adamw.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
