"""DeepSpeed's Adam / AdamW with `"bias_correction": false` (issue 42; DeepSpeedExamples' BERT
SQuAD config sets it): zeroshard's UncorrectedAdam (optim/uncorrected_adam.py) against the
update written out here from DeepSpeed 0.19.8's kernels (csrc/adam/cpu_adam_impl.cpp,
multi_tensor_adam.cu: both corrections 1), per tensor; and sharded at stages 0-3 on 2 gloo ranks
against one process of it (DESIGN.md section 9's oracle, the 2% rule as for AdamW)."""

from __future__ import annotations

import pytest
import torch

from distributed import one_group, run_ranks
from oracle import Case, adam_fraction_off, config_for, train_engine, train_reference
from zeroshard.optim.factory import build_optimizer, optimizer_kernel, optimizer_state_bytes_per_param
from zeroshard.optim.uncorrected_adam import UncorrectedAdam
from zeroshard.policies import OptimizerSpec

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.98), 1e-6, 0.1
SECTION = {"type": "Adam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                                      "bias_correction": False}}


class KernelAdam:
    """DeepSpeed's Adam step with bias_correction false, one tensor at a time."""

    def __init__(self, params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=True):
        self.params, self.lr, self.betas, self.eps, self.wd, self.adamw = list(params), lr, betas, eps, weight_decay, adam_w_mode
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad if self.adamw else p.grad + self.wd * p
            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            update = m / (v.sqrt() + self.eps) + (self.wd * p if self.adamw else 0)
            p.copy_(p - self.lr * update)

    def zero_grad(self, set_to_none=False):
        for p in self.params:
            p.grad.zero_()


@pytest.mark.parametrize("kind, adam_w_mode", [("adam", True), ("adam", False), ("adamw", True)])
def test_equals_deepspeeds_kernel_per_tensor(kind, adam_w_mode):
    torch.manual_seed(0)
    ours = [torch.randn(6, 5, requires_grad=True), torch.randn(9, requires_grad=True)]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    params = {**SECTION["params"], "betas": BETAS, "adam_w_mode": adam_w_mode}
    opt = build_optimizer(OptimizerSpec(kind, params), ours)
    assert type(opt) is UncorrectedAdam and opt.defaults["adam_w_mode"] == (adam_w_mode or kind == "adamw")
    ref = KernelAdam(theirs, adam_w_mode=opt.defaults["adam_w_mode"])
    for _ in range(5):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert float(opt.state[ours[0]]["step"]) == 5


def test_built_from_a_deepspeed_config():
    opt = build_optimizer(OptimizerSpec("Adam", {"lr": 1e-4, "bias_correction": False}), [torch.zeros(3, requires_grad=True)])
    assert optimizer_kernel(opt) == "for-loop"  # no fused or foreach kernel claimed
    assert opt.defaults["weight_decay"] == 0.0 and opt.defaults["adam_w_mode"]  # DeepSpeed's defaults
    assert optimizer_state_bytes_per_param(OptimizerSpec("adam", {"bias_correction": False})) == 8


def _dropin_engine(case, rank, world_size):
    """A DeepSpeed script's own optimizer: FusedAdam(bias_correction=False) given to initialize."""
    import zeroshard.deepspeed as deepspeed
    from oracle import make_model, run_steps
    from zeroshard.deepspeed.ops.adam import FusedAdam

    model = make_model(case)
    opt = FusedAdam(model.parameters(), lr=LR, bias_correction=False, betas=BETAS, eps=EPS, weight_decay=WD)
    config = {k: v for k, v in config_for(case, world_size).items() if k != "optimizer"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    run_steps(engine, case, rank, world_size)
    return engine.zeroshard


def _sharded(rank, world_size, stages):
    out = {}
    with one_group():
        for stage in stages:
            if stage == "dropin3":
                engine = _dropin_engine(Case(stage=3), rank, world_size)
            else:
                case = Case(stage=stage)
                engine, _ = train_engine(case, rank, world_size, {**config_for(case, world_size), "optimizer": SECTION})
            assert type(engine.optimizer.optimizer) is UncorrectedAdam
            out[stage] = engine.full_state_dict()
            states = engine.optimizer.optimizer.state.values()
            out[f"ledger{stage}"] = (engine.memory_stats()["optimizer_states"],
                                     sum(t.numel() * 4 for s in states for k, t in s.items() if k != "step"))
            engine.close()
    return out


def test_sharded_at_stages_0_to_3_equals_one_process():
    stages = [0, 1, 2, 3, "dropin3"]  # dropin3: the script's own deepspeed.ops.adam.FusedAdam at stage 3
    results = run_ranks(_sharded, 2, stages, timeout=300)
    want = train_reference(Case(), 2, make_optimizer=KernelAdam)
    for stage in stages:
        got = {k: v.float() for k, v in results[0][stage].items()}
        frac = adam_fraction_off(got, want)
        assert frac <= 0.02, f"stage {stage}: {frac:.2%} of entries differ by > 1e-3 relative (limit 2%)"
        assert all(torch.equal(results[0][stage][k], results[1][stage][k]) for k in want)
        for r in results:
            ledger, real = r[f"ledger{stage}"]
            assert ledger == real, (stage, ledger, real)
