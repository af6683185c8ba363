"""World sizes 1, 3 and 4: uneven padding, shards of unequal use.

1. The oracle (DESIGN.md section 9) at stages 1-3 with SGD (1e-5) and AdamW (the 2% rule) on 1,
   3 and 4 real gloo ranks, as tests/test_stages_oracle.py and tests/test_stage3_oracle.py do on 2.
   Small buckets (100 and 60 elements for some cases) put buckets smaller than N x alignment
   in play, so some ranks own only padding of some buckets.
2. Resharding through checkpoints 2 -> 3 -> 4 -> 1: a run saves on 2 ranks (stage 2), is loaded on
   3 (stage 3), trained and saved, loaded on 4 (stage 1), trained and saved, loaded on 1 (stage 3).
   At every load the parameters, Adam moments and step counters equal what was saved, exactly.
   Every world size trains on the same global batch of 12 rows (12 / N per rank), so the whole
   chain must also train like one process with batch 12 (the 2% rule at the end). The chain's
   GPT has n_embd 30, so its buckets are padded at 3 and 4 ranks.

One process group per world size runs all its cases (spawning 4 ranks on 2 cores costs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from oracle import (
    Case, adam_fraction_off, assert_matches, batch, config_for, loss_of, torch_optimizer,
    train_engine, train_reference,
)

SMALL = (("reduce_bucket_size", 100), ("allgather_bucket_size", 60))  # many tiny buckets
S3 = (("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0))
CASES = [
    Case(stage=1, optimizer="sgd", steps=3),
    Case(stage=1, optimizer="adamw", steps=3, gas=2, clip=0.5),
    Case(stage=2, optimizer="sgd", steps=3, gas=2, clip=0.5),
    Case(stage=2, optimizer="adamw", steps=3, zero=SMALL),
    Case(stage=3, optimizer="sgd", steps=3, zero=S3),
    Case(stage=3, optimizer="adamw", steps=3, zero=S3),
    Case(model="mlp", stage=3, optimizer="sgd", steps=3,
         zero=S3 + (("zeroshard.stage3_unit_classes", ("Linear",)),)),  # frozen layers, tiny units
    Case(model="mlp", stage=1, optimizer="adamw", steps=3, zero=SMALL),
]

# The reshard chain: (world size, stage) in order; each trains STEPS global steps after loading.
CHAIN = [(2, 2), (3, 3), (4, 1), (1, 3)]
STEPS = 2
ROWS = 12  # the global batch of every world size in the chain
CHAIN_CASE = Case(model="gpt", optimizer="adamw")


def chain_model() -> torch.nn.Module:
    """The oracle's tiny GPT with n_embd 30: sizes that are not multiples of 4 (the tiny GPT's
    are all multiples of 32), so buckets are padded at 3 and at 4 ranks."""
    from zeroshard.models import build_gpt
    from zeroshard.models.gpt import GPTConfig

    torch.manual_seed(1234)
    return build_gpt(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=30))


def _id(c: Case) -> str:
    extra = "-".join(f"{k.replace('zeroshard.', '')}={v}" for k, v in c.zero)
    return f"{c.model}-z{c.stage}-{c.optimizer}-gas{c.gas}-clip{c.clip}" + (f"-{extra}" if extra else "")


def full_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {"value", "exp_avg", "exp_avg_sq"}} whole (all ranks' shards gathered), and
    {"": {"step": per-bucket Adam step counters of this rank}}."""
    opt = engine.optimizer
    out: dict[str, dict[str, torch.Tensor]] = {name: {"value": t} for name, t in engine.full_state_dict().items()}
    steps = []
    for bucket, master in zip(engine.buckets, opt.masters):
        state = opt.state.get(master, {})
        if "step" in state:
            steps.append(float(state["step"]))
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                continue
            full = state[key]
            if bucket.layout.shard_count > 1:
                full = torch.empty(bucket.layout.padded_numel)
                dist.all_gather_into_tensor(full, state[key].contiguous())
            for slot in bucket.slots:
                out.setdefault(slot.name, {})[key] = full[slot.offset : slot.end].clone()
    out[""] = {"step": torch.tensor(steps)}
    return out


def _chain_config(stage: int, world_size: int) -> dict:
    zero = S3 if stage == 3 else ()
    cfg = config_for(CHAIN_CASE.with_(stage=stage, zero=zero), world_size)
    cfg["train_micro_batch_size_per_gpu"] = ROWS // world_size
    return cfg


def _chain_train(engine, steps: range, rank: int, world_size: int) -> list[float]:
    per = ROWS // world_size
    losses = []
    for step in steps:
        x, y = batch(CHAIN_CASE, step, ROWS // 2)  # 12 rows: the oracle's MICRO (2) x 6
        loss = loss_of(engine, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _chain_link(rank: int, world_size: int, root: str, position: int) -> dict:
    """Link `position` of CHAIN: load the previous link's checkpoint (if any), train, save."""
    import zeroshard

    _, stage = CHAIN[position]
    engine = zeroshard.initialize(chain_model(), _chain_config(stage, world_size))
    out: dict = {"layout": [(b.layout.padded_numel, b.layout.padding) for b in engine.buckets]}
    start = 0
    if position:
        engine.load_checkpoint(f"{root}/link{position - 1}")
        out["loaded"] = full_states(engine)
        out["counters"] = (engine.global_steps, engine.micro_steps)
        start = engine.global_steps
    out["losses"] = _chain_train(engine, range(start, start + STEPS), rank, world_size)
    out["saved"] = full_states(engine)
    if position < len(CHAIN) - 1:
        engine.save_checkpoint(f"{root}/link{position}")
    engine.close()
    return out


def probe(engine, case: Case) -> torch.Tensor:
    """What this rank's module computes on one input shared by every rank (not an all-gather
    of the same shards: the parameters each rank's forward really uses)."""
    if case.model == "mlp":
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(3, 16, generator=g), torch.randn(3, 8, generator=g)
    else:
        x = y = torch.arange(3 * 16).reshape(3, 16) % 64
    with torch.no_grad():
        return engine(x, y)[0].detach().float().clone()


def _worker(rank: int, world_size: int, cases: list[Case], root: str, links: list[int]):
    dist.init_process_group("gloo")
    out = {"cases": []}
    for case in cases:
        engine, losses = train_engine(case, rank, world_size)
        out["cases"].append({"state": engine.full_state_dict(), "losses": losses, "probe": probe(engine, case),
                             "padding": [b.layout.padding for b in engine.buckets],
                             "shard": [b.layout.shard_numel for b in engine.buckets]})
        engine.close()
    for position in links:
        out[f"link{position}"] = _chain_link(rank, world_size, root, position)
    return out


def _single(rank: int, world_size: int, cases: list[Case], root: str, links: list[int]):
    """World size 1 runs in this process (no group needed), as a user's plain script does."""
    out = {"cases": []}
    for case in cases:
        engine, losses = train_engine(case, 0, 1)
        out["cases"].append({"state": engine.full_state_dict(), "losses": losses,
                             "padding": [b.layout.padding for b in engine.buckets],
                             "shard": [b.layout.shard_numel for b in engine.buckets]})
        engine.close()
    for position in links:
        out[f"link{position}"] = _chain_link(0, 1, root, position)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world size: [per-rank results]}; the chain's links run in order 2, 3, 4, 1."""
    root = str(tmp_path_factory.mktemp("reshard"))
    results = {2: run_ranks(_worker, 2, [], root, [0], timeout=300)}
    results[3] = run_ranks(_worker, 3, CASES, root, [1], timeout=600)
    results[4] = run_ranks(_worker, 4, CASES, root, [2], timeout=600)
    results[1] = run_ranks(_single, 1, CASES, root, [3], timeout=300)
    return results


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_oracle_at_world_size(runs, case, world_size):
    ref = train_reference(case, world_size)
    per_rank = [r["cases"][CASES.index(case)] for r in runs[world_size]]
    for result in per_rank:
        assert_matches(case, result["state"], ref)
    first = per_rank[0]["state"]
    for rank, result in enumerate(per_rank[1:], 1):
        assert all(torch.equal(first[k], result["state"][k]) for k in first), f"rank {rank} differs from rank 0"
        assert torch.equal(result["probe"], per_rank[0]["probe"]), (
            f"rank {rank}'s module computes differently from rank 0's "
            f"(max {(result['probe'] - per_rank[0]['probe']).abs().max().item():.3g})")


def test_padding_is_really_uneven(runs):
    """The world sizes do what they are here for: padded buckets at 3 and 4 ranks, and (small
    buckets) a bucket whose padding is larger than a shard, so a rank holds no parameter of it."""
    for world_size in (3, 4):
        cases = runs[world_size][0]["cases"]
        assert any(p > 0 for c in cases for p in c["padding"]), f"no padding at world size {world_size}"
        assert any(p >= s for c in cases for p, s in zip(c["padding"], c["shard"])), (
            f"world size {world_size}: no bucket with a shard of padding only")


def _assert_equal_states(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: names differ {set(got) ^ set(want)}"
    for name, fields in want.items():
        if name == "":
            continue
        assert set(got[name]) == set(fields), f"{where}: {name} fields {set(got[name])} vs {set(fields)}"
        for key, tensor in fields.items():
            assert torch.equal(got[name][key], tensor), (
                f"{where}: {name}.{key} differs by {(got[name][key] - tensor).abs().max().item():.3g}")


def test_reshard_2_3_4_1_states_exactly_equal(runs):
    for position in range(1, len(CHAIN)):
        world_size, stage = CHAIN[position]
        prev_world, prev_stage = CHAIN[position - 1]
        saved = runs[prev_world][0][f"link{position - 1}"]["saved"]
        for rank, r in enumerate(runs[world_size]):
            link = r[f"link{position}"]
            where = f"{prev_world} ranks stage {prev_stage} -> {world_size} ranks stage {stage}, rank {rank}"
            _assert_equal_states(link["loaded"], saved, where)
            assert link["counters"] == (position * STEPS, position * STEPS), where
            assert set(link["loaded"][""]["step"].tolist()) == {float(position * STEPS)}, where
    # the layouts really differ along the chain: shards of 2, 3, 4 and 1, padded at 3 and 4
    for i, (w, stage) in enumerate(CHAIN):
        layout = runs[w][0][f"link{i}"]["layout"]
        assert all(padded % w == 0 for padded, _ in layout), (w, stage, layout)
        if w in (3, 4):
            assert any(pad for _, pad in layout), f"no padding at {w} ranks stage {stage}: {layout}"


def test_reshard_chain_trains_like_one_process(runs):
    """The parameters at the end of the chain are those of one process trained 8 steps on the
    same 12-row batches (the 2% rule of AdamW), and every rank agrees at every link."""
    model = chain_model()
    opt = torch_optimizer(CHAIN_CASE, list(model.parameters()))
    for step in range(len(CHAIN) * STEPS):
        x, y = batch(CHAIN_CASE, step, ROWS // 2)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    final = {k: v["value"] for k, v in runs[1][0][f"link{len(CHAIN) - 1}"]["saved"].items() if k}
    frac = adam_fraction_off(final, ref)
    assert frac <= 0.02, f"{frac:.2%} of entries differ by > 1e-3 relative after the 2->3->4->1 chain"
    for position, (world_size, _) in enumerate(CHAIN):
        ranks = runs[world_size]
        for r in ranks[1:]:
            _assert_equal_states(r[f"link{position}"]["saved"], ranks[0][f"link{position}"]["saved"],
                                 f"link {position}: rank vs rank 0")
