"""Stage 3 on 2 real ranks trains like one process with the whole batch (DESIGN.md section 9),
for awkward models too: tied embeddings, control flow that changes between steps, activation
checkpointing (reentrant and not) over frozen and trainable parameters, frozen layers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from oracle import Case, assert_matches, train_engine, train_reference

WORLD = 2
NO_REUSE = (("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0))
NO_PREFETCH = (("stage3_prefetch_bucket_size", 0),)
SMALL_WHOLE = (("stage3_param_persistence_threshold", 100),)

CASES = [
    Case(stage=3, optimizer="sgd", zero=NO_REUSE),
    Case(stage=3, optimizer="adamw", zero=NO_REUSE),
    Case(stage=3, optimizer="sgd", zero=NO_REUSE + NO_PREFETCH),
    Case(stage=3, optimizer="sgd", gas=2, clip=0.5, zero=SMALL_WHOLE),
    Case(stage=3, optimizer="adamw", gas=2, zero=SMALL_WHOLE + NO_PREFETCH),
    Case(stage=3, optimizer="sgd"),  # DeepSpeed's defaults: reuse within 1e9 elements, persistence 1e5
    Case(stage=3, optimizer="sgd", zero=NO_REUSE + (("zeroshard.stage3_unit_classes", ()),
                                                    ("zeroshard.stage3_min_unit_params", 3000))),
    Case(model="gpt-skip", stage=3, optimizer="sgd", steps=6, zero=NO_REUSE),
    Case(model="gpt-skip", stage=3, optimizer="adamw", steps=6, gas=2, zero=SMALL_WHOLE),
    Case(model="gpt-ckpt-reentrant", stage=3, optimizer="sgd", zero=NO_REUSE),
    Case(model="gpt-ckpt-nonreentrant", stage=3, optimizer="sgd", zero=NO_REUSE),
    Case(model="gpt-ckpt-nonreentrant", stage=3, optimizer="adamw", gas=2, zero=SMALL_WHOLE),
    Case(model="gpt-outside", stage=3, optimizer="sgd", zero=NO_REUSE),
    Case(model="hf-gpt2", stage=3, optimizer="sgd", zero=NO_REUSE),
    Case(model="hf-gpt2", stage=3, optimizer="adamw", gas=2, zero=SMALL_WHOLE),
    Case(model="hf-llama", stage=3, optimizer="sgd", zero=NO_REUSE),
    Case(model="hf-llama", stage=3, optimizer="adamw", zero=SMALL_WHOLE),
    Case(model="lora", stage=3, optimizer="sgd", zero=NO_REUSE),
    Case(model="lora", stage=3, optimizer="adamw", gas=2, zero=NO_REUSE + NO_PREFETCH),
    Case(model="mlp", stage=3, optimizer="sgd", zero=NO_REUSE + (("zeroshard.stage3_unit_classes", ("Linear",)),)),
]


def _id(c: Case) -> str:
    extra = "-".join(f"{k.replace('stage3_', '').replace('zeroshard.', '')}={v}" for k, v in c.zero)
    return f"{c.model}-{c.optimizer}-gas{c.gas}-clip{c.clip}" + (f"-{extra}" if extra else "")


def _worker(rank: int, world_size: int, cases: list[Case]):
    dist.init_process_group("gloo")
    out = []
    for case in cases:
        engine, losses = train_engine(case, rank, world_size)
        out.append((engine.full_state_dict(), losses))
        engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    ranks = run_ranks(_worker, WORLD, CASES, timeout=600)
    return {case: [r[i] for r in ranks] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_stage3_matches_single_process(case: Case, results):
    ref = train_reference(case, WORLD)
    for state, losses in results[case]:
        assert_matches(case, state, ref)
    a, b = results[case][0][0], results[case][1][0]
    assert all(torch.equal(a[k], b[k]) for k in a)
