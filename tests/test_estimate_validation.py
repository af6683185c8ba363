"""The estimator against the engine's ledgers (issue 5, "Validation against the engine").

On gloo, world size 2, the tiny GPT (28,032 parameters, tied embeddings) and a small
MLP with frozen layers (to see padding and frozen parameters), one optimizer step of
AdamW per configuration: stages 0, 1, 2 x fp32, bf16 x gradient accumulation 1, 2.

* memory: `estimate_memory` from the bare parameter count Φ is within 5% of
  `memory_stats()` for params, grads and optimizer states per rank; with the engine's
  padding rule (`plan_layout` over the trainable parameter sizes) it is exact. Frozen
  parameters are not in the estimator's Φ (they have no gradient or state): the test
  adds their compute-dtype bytes to `params`, as the engine counts them.
* transients: `buffers` bounds what the engine holds beyond the states (peak grads
  minus held grads, plus peak comm buffers).
* communication: `estimate_comm(..., layout=plan_layout(...))` equals `comm_stats()`
  exactly for every collective: calls, elements, bytes and ring sent bytes. Padding:
  each bucket is padded to a multiple of shard_count x (16 bytes / itemsize), i.e. 4
  elements (fp32) or 8 (bf16) at stage 0 and 8 / 16 at stages 1-2 on 2 ranks.

`python tests/test_estimate_validation.py` prints the measured vs predicted table that
docs/estimate.md quotes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from distributed import run_ranks  # noqa: E402
from oracle import MICRO, Case, batch, config_for, make_model  # noqa: E402

from zeroshard.estimate import Strategy, estimate_comm, estimate_memory, shape_from_params  # noqa: E402
from zeroshard.estimate.padding import plan_layout  # noqa: E402

WORLD = 2
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
RUNS = {
    f"z{stage}-{prec}-gas{gas}": Case(stage=stage, optimizer="adamw", precision=prec, gas=gas, steps=1)
    for stage in (0, 1, 2) for prec in ("fp32", "bf16") for gas in (1, 2)
}
# FrozenMLP 16-32-32-32-8, layers 0 and 2 frozen: 1,320 trainable elements in buckets of
# 296 and 1,024; bf16 on 2 ranks pads the first to 304 (8 elements of padding).
RUNS.update({
    f"mlp-z{stage}-bf16": Case(model="mlp", stage=stage, optimizer="adamw", precision="bf16", steps=1,
                               zero=(("reduce_bucket_size", 1000),))
    for stage in (0, 2)
})


def _worker(rank, world_size, runs):
    dist.init_process_group("gloo")
    import zeroshard

    out = {}
    for key, case in runs.items():
        model = make_model(case)
        trainable = [p.numel() for p in model.parameters() if p.requires_grad]  # tied weights once
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        config = config_for(case, world_size)
        engine = zeroshard.initialize(model, config)
        engine.reset_comm_stats()  # drop the initial broadcast: count one optimizer step
        engine.reset_memory_stats()
        for m in range(case.gas):
            x, y = batch(case, m, world_size)
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            engine.backward(engine(x[lo:hi], y[lo:hi])[1])
            engine.step()
        assert engine.global_steps == 1
        out[key] = {
            "comm": engine.comm_stats(), "mem": engine.memory_stats(), "trainable": trainable, "frozen": frozen,
            "zero": config["zero_optimization"],
            "layout": [(b.layout.numel, b.layout.padded_numel, b.layout.shard_numel) for b in engine.buckets],
        }
        engine.close()
    return out


def predict(case: Case, r: dict):
    """The estimator's figures for run `r`, from the bare count and from the padded layout."""
    zero = r["zero"]
    strategy = Strategy(stage=case.stage, precision=case.precision, optimizer="adamw",
                        reduce_bucket_size=zero["reduce_bucket_size"],
                        allgather_bucket_size=zero["allgather_bucket_size"])
    phi = sum(r["trainable"])
    shape = shape_from_params(phi)
    layout = plan_layout(r["trainable"], case.stage, case.precision, WORLD, zero["reduce_bucket_size"])
    frozen_bytes = r["frozen"] * strategy.param_bytes
    plain = estimate_memory(shape, strategy, WORLD)
    exact = estimate_memory(shape, strategy, WORLD, layout=layout)
    comm = estimate_comm(phi, strategy, 1, WORLD, case.gas, layout=layout)
    return strategy, layout, plain, exact, comm, frozen_bytes


def predicted_comm(comm) -> dict[str, dict[str, int]]:
    out = {op: {"calls": 0, "elements": 0, "bytes": 0, "sent_bytes": 0} for op in OPS}
    for c in comm.collectives:
        for k in out[c.op]:
            out[c.op][k] += getattr(c, k)
    return out


@pytest.fixture(scope="module")
def ledgers():
    return run_ranks(_worker, WORLD, RUNS, timeout=120)


@pytest.mark.parametrize("key", list(RUNS))
def test_layout_rule_matches_engine_buckets(ledgers, key):
    case = RUNS[key]
    for rank in range(WORLD):
        r = ledgers[rank][key]
        layout = predict(case, r)[1]
        assert [(n, p, p // layout.shard_count) for n, p in zip(layout.numels, layout.padded)] == \
            [tuple(b) for b in r["layout"]]


@pytest.mark.parametrize("key", list(RUNS))
def test_memory_per_rank_matches_memory_stats(ledgers, key):
    case = RUNS[key]
    for rank in range(WORLD):
        r = ledgers[rank][key]
        _, _, plain, exact, _, frozen_bytes = predict(case, r)
        mem = r["mem"]
        for cat, p_plain, p_exact in (("params", plain.params + frozen_bytes, exact.params + frozen_bytes),
                                      ("grads", plain.grads, exact.grads),
                                      ("optimizer_states", plain.optimizer_states, exact.optimizer_states)):
            assert p_plain == pytest.approx(mem[cat], rel=0.05), f"{key} rank {rank} {cat}: Φ-only estimate"
            assert p_exact == mem[cat], f"{key} rank {rank} {cat}: padded estimate"
        # transients beyond the states: stage-2 buckets in flight, fp32 upcast at the step, gather staging
        transient = mem["peak_grads"] - mem["grads"] + mem["peak_comm_buffers"]
        assert transient <= exact.buffers, f"{key} rank {rank}: engine transients exceed the estimate"
        assert mem["comm_buffers"] == 0


@pytest.mark.parametrize("key", list(RUNS))
def test_comm_elements_match_comm_stats_exactly(ledgers, key):
    case = RUNS[key]
    for rank in range(WORLD):
        r = ledgers[rank][key]
        comm = predict(case, r)[4]
        want = predicted_comm(comm)
        for op in OPS:
            got = {k: r["comm"][op][k] for k in ("calls", "elements", "bytes", "sent_bytes")}
            assert got == want[op], f"{key} rank {rank} {op}"


def test_fp32_adamw_is_sixteen_bytes_per_parameter_at_stage0(ledgers):
    """4 params + 4 grads + 8 (Adam): in fp32 the parameter itself is the master, as in DDP."""
    r = ledgers[0]["z0-fp32-gas1"]
    phi = sum(r["trainable"])
    assert r["mem"]["params"] + r["mem"]["grads"] + r["mem"]["optimizer_states"] == 16 * phi


def test_gradient_accumulation_multiplies_only_stage2_reduce_scatter(ledgers):
    for stage in (0, 1, 2):
        one, two = (ledgers[0][f"z{stage}-bf16-gas{g}"]["comm"] for g in (1, 2))
        for op in OPS:
            factor = 2 if (stage == 2 and op == "reduce_scatter") else 1
            assert two[op]["elements"] == factor * one[op]["elements"], (stage, op)


def table(ledgers) -> str:
    """Markdown: rank 0's measured vs predicted (Φ-only / padded layout) bytes and elements."""
    rows = ["| run | Φ (padded) | params | grads | optimizer (incl. master) | Φ-only worst | transient ≤ buffers "
            "| AR / RS / AG elements measured = predicted |",
            "|---|---|---|---|---|---|---|---|"]
    for key, case in RUNS.items():
        r = ledgers[0][key]
        _, layout, plain, exact, comm, frozen_bytes = predict(case, r)
        mem, want = r["mem"], predicted_comm(comm)
        worst = max(abs(p - mem[c]) / mem[c] for c, p in (("params", plain.params + frozen_bytes),
                                                          ("grads", plain.grads),
                                                          ("optimizer_states", plain.optimizer_states)))
        ok = all(r["comm"][op][k] == want[op][k] for op in OPS for k in ("calls", "elements", "bytes", "sent_bytes"))
        transient = mem["peak_grads"] - mem["grads"] + mem["peak_comm_buffers"]
        elems = " / ".join(f"{r['comm'][op]['elements']:,}" for op in ("all_reduce", "reduce_scatter", "all_gather"))
        rows.append(f"| {key} | {layout.numel:,} ({layout.padded_total:,}) | {mem['params']:,} = {exact.params + frozen_bytes:,} "
                    f"| {mem['grads']:,} = {exact.grads:,} | {mem['optimizer_states']:,} = {exact.optimizer_states:,} "
                    f"| {worst:.2%} | {transient:,} ≤ {exact.buffers:,} | {elems} {'✓' if ok else '✗'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(run_ranks(_worker, WORLD, RUNS, timeout=120)))
