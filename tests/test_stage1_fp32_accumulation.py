"""Stage 1 with a bf16 model and `data_types.grad_accum_dtype` "fp32" (DeepSpeed's BF16_Optimizer
path: each micro-step's bf16 gradient added into a full fp32 buffer, the buffer reduced at the
accumulation boundary in `communication_data_type`, bf16 by default) on 2 real ranks, against
that recipe written out in one process; and the ledger's gradient bytes against the buffers."""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_ranks

WORLD, GAS, STEPS, LR = 2, 3, 3, 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 12))


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 12, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _config(accum: str | None) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": 1}, **({"data_types": {"grad_accum_dtype": accum}} if accum else {})}


def _worker(rank, world_size, accum):
    import zeroshard

    engine = zeroshard.initialize(_model(), _config(accum))
    for step in range(STEPS):
        for m in range(GAS):
            engine.backward(_loss(engine(_batch(step, m, rank))))
            engine.step()
    padded = sum(b.layout.padded_numel for b in engine.buckets)
    out = {"state": engine.full_state_dict(), "grads": engine.memory_stats()["grads"], "padded": padded}
    engine.close()
    return out


def _reference() -> dict[str, torch.Tensor]:
    """fp32 masters; per rank the bf16 model's micro-gradients (loss / GAS) summed in fp32; each
    rank's sum divided by the world size and rounded to bf16, summed across ranks in bf16."""
    master = _model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels' summation order
    try:
        _train(master)
    finally:
        torch.set_num_threads(threads)
    return master.state_dict()


def _train(master: torch.nn.Module) -> None:
    for step in range(STEPS):
        reduced = {n: torch.zeros_like(p, dtype=torch.bfloat16) for n, p in master.named_parameters()}
        for rank in range(WORLD):
            model = copy.deepcopy(master).to(torch.bfloat16)
            acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
            for m in range(GAS):
                model.zero_grad(set_to_none=True)
                (_loss(model(_batch(step, m, rank).bfloat16())) / GAS).backward()
                for n, p in model.named_parameters():
                    acc[n] += p.grad.float()
            for n in reduced:
                reduced[n] += (acc[n] / WORLD).bfloat16()
        with torch.no_grad():
            for n, p in master.named_parameters():
                p -= LR * reduced[n].float()


@pytest.mark.parametrize("accum", ["fp32", None])
def test_stage1_accumulates_bf16_gradients_in_fp32_across_ranks(accum):
    results = run_ranks(_worker, WORLD, accum, timeout=180)
    want = _reference()
    for r in results:
        got = {k: v.float() for k, v in r["state"].items()}
        if accum:  # the recipe's fp32 masters, exactly (the same kernels, one thread, in this run)
            for k, w in want.items():
                assert torch.equal(got[k], w), k
            assert r["grads"] == r["padded"] * (2 + 4)  # the bf16 buffer autograd fills + the fp32 accumulator
        else:  # the bf16 running sum differs from it
            assert any(not torch.equal(got[k], w) for k, w in want.items())
            assert r["grads"] == r["padded"] * 2
