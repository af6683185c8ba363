"""Stage-3 parameters carry DeepSpeed's attributes, true at every moment (2 gloo ranks).

TRL's fused LM head gathers `[p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]`;
OpenRLHF's EMA gathers `[p for p in params if hasattr(p, "ds_id") and p.ds_status ==
NOT_AVAILABLE]` and reads `ds_shape` / `ds_numel`; peft reads `ds_shape` / `ds_numel`. Each
attribute is checked against what the parameter really holds, at rest, in every module's
forward (before and after the engine's hooks), when each gradient is accumulated, after the
step and inside GatheredParameters.
"""

from __future__ import annotations

import torch

from distributed import one_group, run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model

WORLD = 2
# small parameters kept whole (persistent), the rest in per-block units with prefetch
CASE = Case(stage=3, optimizer="sgd", zero=(("stage3_param_persistence_threshold", 64),
                                             ("stage3_max_reuse_distance", 0)))


def _full(p) -> bool:
    """The parameter holds real values: not the at-rest placeholder (one element, stride 0)."""
    return p.ds_numel <= 1 or any(s != 0 for s in p.data.stride())  # p.numel() in a forward would gather


class Checker:
    def __init__(self, module, status):
        self.module, self.status, self.bad, self.seen = module, status, [], set()

    def __call__(self, where):
        for name, p in self.module.named_parameters():
            self.seen.add(p.ds_status)
            available = p.ds_status is self.status.AVAILABLE
            if available != _full(p) or (p.ds_persist and not available):
                self.bad.append(f"{where}: {name} is {p.ds_status.name} but full={_full(p)}")


def _worker(rank, world_size):
    import zeroshard.deepspeed as deepspeed
    from zeroshard.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    with one_group():
        cfg = config_for(CASE, world_size)
        first, *_ = deepspeed.initialize(model=make_model(CASE), config=cfg)
        engine, *_ = deepspeed.initialize(model=make_model(CASE), config=cfg)
        model = engine.module
        check = Checker(model, ZeroParamStatus)
        check("at rest")
        active_ok = []
        for name, m in model.named_modules():
            m.register_forward_pre_hook(lambda m, a, name=name: check(f"pre-forward {name}"))
            m.register_forward_hook(lambda m, a, o, name=name: check(f"post-forward {name}"))
            if type(m).__name__ == "Block":  # after the engine's pre-hook: gathered, and in use by m
                m.register_forward_pre_hook(lambda m, a: active_ok.append(
                    all(id(m) in p.ds_active_sub_modules for p in m.parameters() if not p.ds_persist)))
                m.register_forward_hook(lambda m, a, o: active_ok.append(  # ... and no longer after it
                    not any(id(m) in p.ds_active_sub_modules for p in m.parameters())))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: check("gradient accumulated"))
        ema = make_model(CASE)  # OpenRLHF's EMA: a whole copy, updated from the gathered parameters
        ema_of_full = {n: t.clone() for n, t in engine.full_state_dict().items()}
        for step in range(2):
            x, y = batch(CASE, step, WORLD)
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            engine.backward(loss_of(engine, x[lo:hi], y[lo:hi]))
            engine.step()
            check(f"after step {step}")
            released = [p for p in model.parameters()
                        if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            with deepspeed.zero.GatheredParameters(released), torch.no_grad():
                for mine, p in zip(ema.parameters(), model.parameters()):
                    mine.mul_(0.9).add_(p.data, alpha=0.1)
            for n, t in engine.full_state_dict().items():
                ema_of_full[n].mul_(0.9).add_(t, alpha=0.1)
        ema_ok = all(torch.allclose(p, ema_of_full[n], rtol=0, atol=1e-7) for n, p in ema.named_parameters())
        norms = (first.get_global_grad_norm(), engine.get_global_grad_norm(), engine.zero_optimization_stage(),
                 isinstance(engine, deepspeed.DeepSpeedEngine))
        params = list(model.parameters())
        to_gather = [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        with deepspeed.zero.GatheredParameters(to_gather):
            check("inside GatheredParameters")
            gathered_all = all(p.ds_status is ZeroParamStatus.AVAILABLE for p in params)
        check("after GatheredParameters")
        return {"ema_ok": ema_ok, "norms": norms, "bad": check.bad[:5], "seen": {s.name for s in check.seen}, "active_ok": active_ok,
                "idle_active": [len(p.ds_active_sub_modules) for p in params],
                "ids": [p.ds_id for p in params], "first_ids": [p.ds_id for p in first.module.parameters()],
                "shapes": [(tuple(p.ds_shape) == tuple(p.shape), p.ds_numel == p.numel()) for p in params],
                "local": {n: p.ds_tensor.detach().clone() for n, p in model.named_parameters()},
                "persist": {n: p.ds_persist for n, p in model.named_parameters()},
                "to_gather": len(to_gather), "gathered_all": gathered_all, "state": engine.full_state_dict()}


def test_stage3_parameters_show_deepspeeds_attributes_truthfully():
    r0, r1 = run_ranks(_worker, WORLD, timeout=120)
    for r in (r0, r1):
        assert not r["bad"], r["bad"]
        assert r["ema_ok"], "an EMA over the gathered parameters differs from the EMA of the full ones"
        none, norm, stage, is_engine = r["norms"]  # no step yet: None, as DeepSpeed's
        assert none is None and isinstance(norm, float) and norm > 0 and stage == 3 and is_engine
        # every status occurs: prefetched units are in flight while the current one computes
        assert r["seen"] == {"AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"}, r["seen"]
        assert r["active_ok"] and all(r["active_ok"]), "a block's parameters do not list it as active in its forward"
        assert not any(r["idle_active"]), "ds_active_sub_modules not emptied after the pass"
        assert all(a and b for a, b in r["shapes"])
        assert len(set(r["ids"])) == len(r["ids"]) and min(r["ids"]) > max(r["first_ids"])
        assert r["to_gather"] > 0 and r["gathered_all"]
    assert r0["ids"] == r1["ids"], "ds_id differs between ranks: collectives sorted by it would deadlock"
    assert any(r0["persist"].values()) and not all(r0["persist"].values())
    for name, full in r0["state"].items():
        if name not in r0["local"]:
            continue  # a buffer
        # this rank's part of its bucket's shard (persistent parameters too: their optimizer
        # shard): rank 0's then rank 1's make the whole parameter
        assert torch.equal(torch.cat([r0["local"][name], r1["local"][name]]), full.flatten()), name
