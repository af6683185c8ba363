"""DeepSpeed's `Lion` optimizer (issue 42): zeroshard's Lion (optim/lion.py) against the
algorithm as the paper writes it, per tensor, in this file; and sharded at stages 0-3 on 2
gloo ranks against one process of that paper loop (DESIGN.md section 9's oracle, judged by
the 2% rule as AdamW is: a sign flips where beta1*m + (1-beta1)*g is within rounding of 0,
and the sharded gradient sums in another order than one process's).
"""

from __future__ import annotations

import pytest
import torch

from distributed import one_group, run_ranks
from oracle import Case, adam_fraction_off, config_for, make_model, run_steps, train_engine, train_reference
from zeroshard.optim.factory import build_optimizer, optimizer_kernel, optimizer_state_bytes_per_param
from zeroshard.policies import ConfigError, OptimizerSpec

LR, BETAS, WD = 2e-3, (0.9, 0.99), 0.1
SECTION = {"type": "Lion", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WD}}


class PaperLion:
    """Chen et al. 2023, Program 1, one tensor at a time; sign(0) = 0."""

    def __init__(self, params, lr=LR, betas=BETAS, weight_decay=WD):
        self.params, self.lr, self.betas, self.wd = list(params), lr, betas, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for p, m in zip(self.params, self.m):
            g = p.grad
            update = torch.sign(b1 * m + (1 - b1) * g)
            p.copy_(p - self.lr * (update + self.wd * p))
            m.copy_(b2 * m + (1 - b2) * g)

    def zero_grad(self, set_to_none=False):
        for p in self.params:
            p.grad.zero_()


@pytest.mark.parametrize("foreach", [True, False])
def test_lion_equals_the_paper_per_tensor(foreach):
    torch.manual_seed(0)
    ours = [torch.randn(6, 5, requires_grad=True), torch.randn(9, requires_grad=True)]
    paper = [t.detach().clone().requires_grad_() for t in ours]
    opt = build_optimizer(OptimizerSpec("lion", {**SECTION["params"], "betas": BETAS}), ours)
    opt.defaults["foreach"] = opt.param_groups[0]["foreach"] = foreach
    ref = PaperLion(paper)
    for step in range(4):
        for a, b in zip(ours, paper):
            g = torch.randn_like(a)
            g[0] = 0.0  # momentum and gradient 0 in the first row at step 0: sign(0) leaves it alone
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, paper):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opt.state[ours[0]]["exp_avg"].shape == ours[0].shape


def test_lion_from_a_deepspeed_config():
    params = [torch.zeros(3, requires_grad=True)]
    opt = build_optimizer(OptimizerSpec("Lion", {"lr": 1e-4}), params)
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["weight_decay"] == 0.0  # DeepSpeed's defaults
    assert optimizer_kernel(opt) == "foreach"
    assert optimizer_state_bytes_per_param(OptimizerSpec("lion")) == 4
    with pytest.raises(ConfigError, match="eps"):
        build_optimizer(OptimizerSpec("Lion", {"lr": 1e-4, "eps": 1e-8}), params)
    with pytest.raises(ConfigError, match="betas"):
        build_optimizer(OptimizerSpec("Lion", {"betas": 0.9}), params)


def _sharded(rank, world_size, stages):
    out = {}
    with one_group():
        for stage in stages:
            case = Case(stage=stage)
            cfg = {**config_for(case, world_size), "optimizer": SECTION}
            engine, _ = train_engine(case, rank, world_size, cfg)
            out[stage] = engine.full_state_dict()
            states = engine.optimizer.optimizer.state.values()
            out[f"ledger{stage}"] = (engine.memory_stats()["optimizer_states"],  # one fp32 momentum per element
                                     sum(t.numel() * 4 for s in states for t in s.values()),
                                     sum(b.layout.shard_numel if stage else b.layout.padded_numel for b in engine.buckets))
            engine.close()
    return out


def test_sharded_lion_at_stages_0_to_3_equals_one_process():
    stages = [0, 1, 2, 3]
    results = run_ranks(_sharded, 2, stages, timeout=240)
    want = train_reference(Case(), 2, make_optimizer=PaperLion)
    for stage in stages:
        got = {k: v.float() for k, v in results[0][stage].items()}
        frac = adam_fraction_off(got, want)
        assert frac <= 0.02, f"stage {stage}: {frac:.2%} of Lion entries differ by > 1e-3 relative (limit 2%)"
        assert all(torch.equal(results[0][stage][k], results[1][stage][k]) for k in want)
        for r in results:
            ledger, real, elements = r[f"ledger{stage}"]
            assert ledger == real == 4 * elements, (stage, r[f"ledger{stage}"])


def test_deepspeed_ops_lion_instance_is_rebuilt_over_the_shards():
    """`deepspeed.initialize(optimizer=FusedLion(...))` (DeepSpeed's class, as scripts pass it):
    one process at stage 2 trains as the paper's Lion does."""
    from zeroshard.deepspeed import initialize
    from zeroshard.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    case = Case(stage=2, steps=3)
    cfg = config_for(case, 1)
    del cfg["optimizer"]
    model = make_model(case)
    engine, opt, *_ = initialize(model=model, optimizer=FusedLion(model.parameters(), lr=LR, betas=BETAS,
                                                                  weight_decay=WD), config=cfg)
    run_steps(engine, case, 0, 1)
    got = {k: v.float() for k, v in engine.module.state_dict().items()}
    want = train_reference(case, 1, make_optimizer=PaperLion)
    assert adam_fraction_off(got, want) <= 0.02
    assert type(engine.optimizer.optimizer) is FusedLion  # the user's class, over the fp32 shards
    with pytest.raises(ConfigError, match="fp32_optimizer_states"):
        DeepSpeedCPULion([torch.zeros(1, requires_grad=True)], fp32_optimizer_states=False)
