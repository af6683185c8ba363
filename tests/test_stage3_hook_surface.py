"""The stage-3 hook surface TRL's `unwrap_model_for_generation` drives (2 gloo ranks).

With `ds3_gather_for_generation=True` TRL gathers the whole model with GatheredParameters,
clears `ds_active_sub_modules` over `named_parameters()` + `ds_external_parameters()`, removes
every handle in `engine.optimizer.parameter_offload.forward_hooks` / `backward_hooks`, generates,
invalidates the coordinator's trace and calls `_register_deepspeed_module(module)`. With
False it generates through the hooks, one gather per unit per forward. Either way training
must continue exactly as if nothing happened: engine A (with both generations after step 2)
and engine B (none) take the same losses and end in the same state, bit for bit.
"""

from __future__ import annotations

import itertools

import torch

from distributed import one_group, run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model

WORLD = 2
CASE = Case(model="hf-llama", stage=3, optimizer="sgd", steps=4,
            zero=(("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0)))
PROMPT = torch.tensor([[1, 5, 9, 3, 7]])
NEW = 6


def _gathers(engine) -> int:
    return engine.comm_stats().get("all_gather", {}).get("calls", 0)


def _zeroshard_hooks(engine) -> int:
    return sum(len(u.module._forward_pre_hooks) + len(u.module._forward_hooks) for u in engine.stage3.units)


def _generate_like_trl(engine, deepspeed) -> dict:
    out = {}
    with deepspeed.zero.GatheredParameters(engine.parameters()):
        offload = engine.optimizer.parameter_offload
        module = offload.module
        for _, p in itertools.chain(module.named_parameters(), module.ds_external_parameters()):
            p.ds_active_sub_modules.clear()
        hooks_before = _zeroshard_hooks(engine)
        for handle in offload.forward_hooks + offload.backward_hooks:
            handle.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        out["hooks"] = (hooks_before, _zeroshard_hooks(engine))
        before = _gathers(engine)
        out["gathered"] = module.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        out["gathered_calls"] = _gathers(engine) - before
        if not offload.param_coordinator.is_invalid_trace():
            offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
        out["hooks_after"] = _zeroshard_hooks(engine)
        out["handles_after"] = len(offload.forward_hooks)
    before = _gathers(engine)  # ds3_gather_for_generation=False: through the hooks
    out["per_forward"] = engine.module.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    out["per_forward_calls"] = _gathers(engine) - before
    return out


def _worker(rank, world_size):
    import zeroshard.deepspeed as deepspeed

    with one_group():
        cfg = config_for(CASE, world_size)
        a, *_ = deepspeed.initialize(model=make_model(CASE), config=cfg)
        b, *_ = deepspeed.initialize(model=make_model(CASE), config=cfg)
        losses = {"a": [], "b": []}
        gen = full = None
        for step in range(CASE.steps):
            x, y = batch(CASE, step, WORLD)
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            for name, engine in (("a", a), ("b", b)):
                loss = loss_of(engine, x[lo:hi], y[lo:hi])
                engine.backward(loss)
                engine.step()
                losses[name].append(loss.item())
            if step == 1:
                full = a.full_state_dict()
                gen = _generate_like_trl(a, deepspeed)
        return {"losses": losses, "a": a.full_state_dict(), "b": b.full_state_dict(), "gen": gen, "full": full,
                "units": len(a.stage3.units)}


def test_remove_generate_add_leaves_training_unchanged():
    results = run_ranks(_worker, WORLD, timeout=180)
    reference = make_model(CASE).eval()
    reference.load_state_dict(results[0]["full"])
    with torch.no_grad():
        want = reference.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for r in results:
        assert r["losses"]["a"] == r["losses"]["b"], r["losses"]
        assert all(torch.equal(r["a"][k], r["b"][k]) for k in r["b"]), "training after the cycle differs"
        g = r["gen"]
        hooks_before, hooks_removed = g["hooks"]
        assert hooks_before > 0 and hooks_removed == 0, "remove() left zeroshard's unit hooks attached"
        assert g["hooks_after"] == hooks_before and g["handles_after"] == r["units"]
        assert torch.equal(g["gathered"], want) and torch.equal(g["per_forward"], want), (g, want)
        assert g["gathered_calls"] == 0, "generation on the gathered model issued all-gathers"
        assert g["per_forward_calls"] >= r["units"] * NEW  # one gather per unit per forward
