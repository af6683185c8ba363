"""DESIGN.md section 9: stages 0, 1, 2 on 2 real ranks train like one process with the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from oracle import Case, assert_matches, config_for, sgd_close, train_engine, train_reference

WORLD = 2

CASES = [
    Case(model=m, stage=s, optimizer=o, gas=g, clip=c)
    for m in ("gpt", "mlp")
    for s in (0, 1, 2)
    for o in ("sgd", "adamw")
    for g, c in ((1, 0.0), (2, 0.5))
] + [
    # the knobs that change how, not what: results must not move
    Case(stage=2, gas=2, zero=(("contiguous_gradients", False),)),
    Case(stage=2, gas=2, zero=(("overlap_comm", False),)),
    Case(stage=1, zero=(("reduce_scatter", False),)),
    Case(stage=2, zero=(("reduce_bucket_size", 100_000), ("allgather_bucket_size", 100_000))),
    Case(stage=1, optimizer="adamw", zero=(("sub_group_size", 2_000),)),
    Case(model="hf-gpt2", stage=2, optimizer="sgd"),
    Case(model="hf-llama", stage=1, optimizer="adamw", gas=2),
]


def _worker(rank: int, world_size: int, cases: list[Case]):
    dist.init_process_group("gloo")  # zeroshard must use an existing default group as is
    out = []
    for case in cases:
        engine, losses = train_engine(case, rank, world_size)
        out.append((engine.full_state_dict(), losses, engine.get_global_grad_norm()))
        engine.close()
        assert dist.is_initialized(), "engine.close() destroyed a process group it did not create"
    return out


@pytest.fixture(scope="module")
def results():
    ranks = run_ranks(_worker, WORLD, CASES, timeout=600)
    return {case: [r[i] for r in ranks] for i, case in enumerate(CASES)}


def _id(c: Case) -> str:
    extra = "-".join(f"{k}={v}" for k, v in c.zero)
    return f"{c.model}-z{c.stage}-{c.optimizer}-gas{c.gas}-clip{c.clip}" + (f"-{extra}" if extra else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_single_process(case: Case, results):
    per_rank = results[case]
    ref = train_reference(case, WORLD)
    for rank, (state, losses, norm) in enumerate(per_rank):
        assert_matches(case, state, ref)
        assert norm is not None and norm > 0
    # both ranks return the same full model
    a, b = per_rank[0][0], per_rank[1][0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_clipping_actually_clipped(results):
    """The clipped cases only prove something if the norm exceeded the threshold."""
    norms = [results[c][0][2] for c in CASES if c.clip > 0]
    assert max(norms) > 0.5, f"clip threshold 0.5 never reached (norms {norms}); the clip tests are vacuous"


def _zero_grad_worker(rank: int, world_size: int):
    from oracle import MICRO, batch, loss_of, make_model

    import zeroshard

    out = []
    for stage in (2, 3):
        case = Case(stage=stage, gas=2)
        engine = zeroshard.initialize(make_model(case), config_for(case, world_size))
        for micro in range(4):
            x, y = batch(case, micro, world_size)
            engine.backward(loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
            if micro == 0:
                engine.zero_grad()  # the window's first micro-batch is dropped
            engine.step()
        out.append(engine.full_state_dict())
        engine.close()
    return out


def test_zero_grad_inside_a_window_on_two_ranks():
    """Stages 2-3 on 2 gloo ranks, where each gradient is reduced from where autograd left it
    (Comm.reduce_scatter_pieces) onto the accumulator: zero_grad() after a window's first
    micro-step empties the accumulator lazily, so the second micro-step must overwrite it, not
    add to it; the window after that accumulates again."""
    from oracle import batch, loss_of, make_model, sgd_close, torch_optimizer

    got = run_ranks(_zero_grad_worker, WORLD, timeout=300)
    for s, stage in enumerate((2, 3)):
        case = Case(stage=stage, gas=2)
        model = make_model(case)
        opt = torch_optimizer(case, model.parameters())
        for window in ([1], [2, 3]):
            for micro in window:
                x, y = batch(case, micro, WORLD)
                (loss_of(model, x, y) / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        ref = {k: v.detach().float() for k, v in model.state_dict().items()}
        for rank in range(WORLD):
            assert not sgd_close(got[rank][s], ref), (stage, rank, sgd_close(got[rank][s], ref)[:3])


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return (y + self.b(y) if use_b else y).pow(2).mean()


def _branch_rows(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _unused_on_one_rank_worker(rank: int, world_size: int):
    import zeroshard

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 2, "ignore_unused_parameters": True},
              "zeroshard": {"comm_timeout_s": 20}}
    engine = zeroshard.initialize(_Branchy(), config)
    for _ in range(2):
        engine.backward(engine(_branch_rows(rank), use_b=rank == 1))  # rank 0 never uses `b`
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def test_a_parameter_unused_on_one_rank_reduces_as_zero_there():
    """Stage 2 on 2 ranks, `b` used by rank 1 only: rank 0 sends zeros for it, so both ranks send
    the same pieces (Comm.reduce_scatter_pieces) and `b` moves by half of rank 1's gradient."""
    ref = _Branchy()
    for _ in range(2):
        grads = [torch.autograd.grad(ref(_branch_rows(r), use_b=r == 1), list(ref.parameters()), allow_unused=True)
                 for r in range(WORLD)]
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * sum(g[i] if g[i] is not None else torch.zeros_like(p) for g in grads) / WORLD
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    for state in run_ranks(_unused_on_one_rank_worker, WORLD, timeout=120):
        assert not sgd_close(state, want), sgd_close(state, want)[:3]


def _sparse_embedding_worker(rank: int, world_size: int):
    import zeroshard

    out = []
    for sparse, zero in ((True, {}), (False, {}), (True, {"reduce_scatter": False})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=sparse), torch.nn.Linear(8, 1))
        engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 2,
                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                              "zero_optimization": {"stage": 2, **zero}})
        for step in range(2):
            x = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(x).square().mean())
            engine.step()
        out.append(engine.full_state_dict())
        engine.close()
    return out


def test_a_sparse_embedding_gradient_reduces_as_its_dense_form():
    """An Embedding(sparse=True) leaves a sparse gradient: stage 2 densifies it where it waits
    (gloo's piecewise reduction) or where it is copied into the bucket (the path NCCL takes,
    here through reduce_scatter: false), and trains as the dense embedding does."""
    for sparse, dense, bucketed in run_ranks(_sparse_embedding_worker, WORLD, timeout=120):
        assert set(sparse) == set(dense) == set(bucketed)
        for k in dense:
            assert torch.allclose(sparse[k], dense[k], rtol=1e-6, atol=1e-7), k
            assert torch.allclose(bucketed[k], dense[k], rtol=1e-6, atol=1e-7), k
