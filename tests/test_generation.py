"""Generation at stage 3 by a memory budget (issue 48): `engine.generation(max_bytes=...)`.

On 2 real ranks, greedy decoding of 8 tokens from the tiny GPT at stage 3 (3 units: the root
with the embeddings, two blocks). Inside `generation()` each unit that fits the budget is
gathered once for all the tokens, the others once per forward:
- the tokens equal the unsharded model's (built from the same seed in the same process), at
  every budget;
- all-gathers (from the ledger): 3 with no limit (one per unit), 3 x 8 with a budget of 0 (the
  per-forward cost, as outside the context), and in between with half the model;
- between tokens, the gathered buffers the ledger holds (real storage) are the kept units' and
  never more than the budget;
- training after the context equals training without it, bit for bit.
DeepSpeed-Chat's `engine.generate()` (hybrid_engine enabled) runs a transformers model's
`generate` the same way, tokens equal to the unsharded model's."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model

TOKENS = 8


def _greedy(model, check=None) -> torch.Tensor:
    x = torch.tensor([[1, 2, 3]])
    for _ in range(TOKENS):
        logits, _ = model(x)
        x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], 1)
        if check is not None:
            check()
    return x


def _run(rank: int, world: int, generate_at: int | None, budgets: list):
    import zeroshard

    case = Case(stage=3, optimizer="adamw", steps=4)
    cfg = config_for(case, world)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter in a unit
    engine = zeroshard.initialize(make_model(case), cfg)
    model_bytes = sum(u.numel for u in engine.stage3.units) * 4
    out = {"generated": {}, "gathers": {}, "held": {}, "losses": []}

    def held() -> int:  # the gathered (full) buffers the ledger holds right now
        return sum(n for (cat, key), (n, _) in engine.memory._held.items() if cat == "params" and key.endswith(".full"))

    for step in range(case.steps):
        if step == generate_at:
            for budget in budgets:
                limit = None if budget is None else int(budget * model_bytes)
                engine.reset_comm_stats()
                seen = []
                with engine.generation(limit) as keep:
                    tokens = _greedy(engine.module, lambda: seen.append((held(), keep.bytes)))
                out["generated"][budget] = tokens
                out["gathers"][budget] = engine.comm_stats()["all_gather"]["calls"]
                out["held"][budget] = (seen, limit)
                assert held() == 0  # everything released on exit
        x, y = batch(case, step, world)
        loss = loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    out["params"] = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    out["units"] = len(engine.stage3.units)
    engine.close()
    return out


@pytest.mark.timeout(600)
def test_generation_gathers_by_budget_and_training_goes_on_exactly():
    want = _greedy(make_model(Case(stage=3)))  # the unsharded model, same seed
    budgets = [None, 0.5, 0.0]
    results = run_ranks(_run, 2, 0, budgets, timeout=600)  # generate before the first step
    plain = run_ranks(_run, 2, None, [], timeout=600)
    for r, p in zip(results, plain):
        units = r["units"]
        for budget in budgets:
            assert torch.equal(r["generated"][budget], want), budget
            seen, limit = r["held"][budget]
            assert all(h == kept for h, kept in seen), seen  # between tokens: only the kept units
            assert limit is None or max(h for h, _ in seen) <= limit, (seen, limit)
        assert r["gathers"][None] == units
        assert r["gathers"][0.0] == units * TOKENS
        assert units < r["gathers"][0.5] < units * TOKENS, (units, r["gathers"])
        assert r["losses"] == p["losses"]
        for name, value in p["params"].items():
            assert torch.equal(r["params"][name], value), name


def _hybrid(rank: int, world: int):
    import zeroshard.deepspeed as deepspeed
    model = make_model(Case(model="hf-llama"))
    cfg = config_for(Case(model="hf-llama", stage=3, optimizer="adamw"), world)
    cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": 64}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.eval()
    engine.zeroshard.reset_comm_stats()
    prompt = torch.tensor([[1, 5, 9, 2]])
    tokens = engine.generate(prompt, max_new_tokens=6, do_sample=False)
    gathers = engine.zeroshard.comm_stats()["all_gather"]["calls"]
    return {"tokens": tokens, "gathers": gathers, "units": len(engine.zeroshard.stage3.units)}


@pytest.mark.timeout(600)
def test_hybrid_engine_generate_gathers_once_and_equals_the_unsharded_model():
    want = make_model(Case(model="hf-llama")).eval().generate(torch.tensor([[1, 5, 9, 2]]), max_new_tokens=6, do_sample=False)
    for r in run_ranks(_hybrid, 2, timeout=600):
        assert torch.equal(r["tokens"], want)
        assert r["gathers"] == r["units"]  # each unit once for the 6 tokens


def _tied_gpt2():
    """GPT-2 with a vocabulary large enough that the tied head is a unit of its own, read by the
    embedding module too (the shape of bench/bench_generation.py's models)."""
    import transformers as hf

    torch.manual_seed(1234)
    return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=2000, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                            bos_token_id=0, eos_token_id=0)).eval()


def _per_forward_tied(rank: int, world: int, zero: dict):
    import zeroshard
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.0}},
           "zero_optimization": {"stage": 3, **zero}}
    engine = zeroshard.initialize(_tied_gpt2(), cfg)
    runtime = engine.stage3
    tied = [u for u in runtime.units if len(runtime._users[u.index]) > 1]  # the head, its embedding a user
    engine.reset_comm_stats()
    with torch.no_grad():
        tokens = engine.module.generate(torch.tensor([[1, 5, 9, 2]]), max_new_tokens=6, min_new_tokens=6,
                                        do_sample=False)
    gathers = engine.comm_stats()["all_gather"]["calls"]
    live = [u.label for u in runtime.units if u.state.value != "released"]
    engine.close()
    return {"tokens": tokens, "gathers": gathers, "units": len(runtime.units), "tied": len(tied), "live": live}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [{"stage3_param_persistence_threshold": 0}, {}], ids=["every-tensor-in-units", "defaults"])
def test_per_forward_generate_gathers_a_tied_unit_once_per_token(zero):
    # GPT-2's head is tied to its embedding: one unit read by two modules in each forward. Outside
    # the engine's passes it stays gathered to the end of the model's forward, not gathered twice.
    # With the defaults the small tensors persist and the model's own module holds no unit (as in
    # bench/bench_generation.py): its forward is still the outermost one
    want = _tied_gpt2().generate(torch.tensor([[1, 5, 9, 2]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for r in run_ranks(_per_forward_tied, 2, zero, timeout=300):
        assert torch.equal(r["tokens"], want)
        assert r["tied"] == 1, r
        assert r["gathers"] == r["units"] * 6, r  # one all-gather per unit per token
        assert r["live"] == [], r  # nothing left gathered after generate
