"""The estimator's offload figures against the engine's ledger (issue 10).

On gloo, world size 2, the tiny GPT (28,032 parameters), one AdamW step per case: stages 1,
2, 3 with `offload_optimizer: cpu`, stage 3 with optimizer + parameter offload, and stage 3
with `offload_optimizer.ratio: 0.5`, each in fp32 and bf16; and
the FrozenMLP (frozen layers, bucket padding) at stages 1 and 2.

* With the engine's padded layout (`plan_layout` at stages 1/2, `plan_stage3_layout` over the
  unit sizes at stage 3) `estimate_memory(..., host_is_device=True)` equals `memory_stats()`
  exactly, per tier (`tier_device`, `tier_host`) and per category (device + host).
* From the bare count Φ the categories are within 5% (as for stages 0-2); with a ratio below
  1 the host share is whole shards, so the Φ-only host states are within half the largest
  shard's states of the measured ones.
* This machine has no GPU: host and device are the same memory, and in fp32 the parameter
  shard stays its own master (K = 8 on the host). The GPU estimate (`host_is_device=False`)
  differs from these measurements by exactly the separate fp32 host master (4 bytes per
  offloaded element) in fp32 with the optimizer alone offloaded, and nowhere else at rest.
* Transients at stages 1/2 (peak gradients beyond the held ones, plus peak comm buffers) stay
  within `buffers + host_buffers`.

`python tests/test_estimate_offload.py` prints the table docs/estimate.md quotes.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from distributed import run_ranks  # noqa: E402
from oracle import MICRO, Case, batch, config_for, loss_of, make_model  # noqa: E402

from zeroshard.estimate import Strategy, estimate_memory, shape_from_params  # noqa: E402
from zeroshard.estimate.padding import plan_layout, plan_stage3_layout  # noqa: E402

WORLD = 2
NO_REUSE = (("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0))
OPT = {"offload_optimizer": {"device": "cpu"}}
BOTH = {**OPT, "offload_param": {"device": "cpu"}}
RATIO = {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}
RUNS = {}
for _prec in ("fp32", "bf16"):
    for _stage in (1, 2, 3):
        RUNS[f"z{_stage}-{_prec}-opt"] = (Case(stage=_stage, optimizer="adamw", precision=_prec, steps=1,
                                                zero=NO_REUSE if _stage == 3 else ()), OPT)
    RUNS[f"z3-{_prec}-opt+param"] = (Case(stage=3, optimizer="adamw", precision=_prec, steps=1, zero=NO_REUSE), BOTH)
    RUNS[f"z3-{_prec}-ratio0.5"] = (Case(stage=3, optimizer="adamw", precision=_prec, steps=1, zero=NO_REUSE), RATIO)
# FrozenMLP 16-32-32-32-8, layers 0 and 2 frozen (whole on the device at stages 1/2): buckets of
# 296 and 1,024 trainable elements; bf16 on 2 ranks pads the first to 304.
RUNS.update({f"mlp-z{st}-{prec}-opt": (Case(model="mlp", stage=st, optimizer="adamw", precision=prec, steps=1,
                                            zero=(("reduce_bucket_size", 1000),)), OPT)
             for st, prec in ((1, "fp32"), (2, "bf16"))})
CATEGORIES = ("params", "grads", "optimizer_states")


def _worker(rank, world_size, runs):
    dist.init_process_group("gloo")
    import zeroshard

    out = {}
    for key, (case, offload) in runs.items():
        config = config_for(case, world_size)
        config["zero_optimization"].update(offload)
        model = make_model(case)
        trainable = [p.numel() for p in model.parameters() if p.requires_grad]  # tied weights once
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        engine = zeroshard.initialize(model, config)
        engine.reset_memory_stats()
        x, y = batch(case, 0, world_size)
        lo, hi = rank * MICRO, (rank + 1) * MICRO
        engine.backward(loss_of(engine, x[lo:hi], y[lo:hi]))
        engine.step()
        assert engine.global_steps == 1
        out[key] = {"mem": engine.memory_stats(), "trainable": trainable, "frozen": frozen, "zero": config["zero_optimization"],
                    "buckets": [(b.layout.numel, b.layout.padded_numel) for b in engine.buckets]}
        engine.close()
    return out


def strategy_for(case: Case, offload: dict, zero: dict, host_is_device: bool = True) -> Strategy:
    block = offload.get("offload_optimizer", {})
    return Strategy(stage=case.stage, precision=case.precision, optimizer="adamw",
                    offload_optimizer=block.get("device", "none"),
                    offload_param=offload.get("offload_param", {}).get("device", "none"),
                    offload_ratio=block.get("ratio", 1.0), reduce_bucket_size=zero["reduce_bucket_size"],
                    allgather_bucket_size=zero["allgather_bucket_size"], host_is_device=host_is_device)


def predict(key: str, r: dict, host_is_device: bool = True):
    """(layout, Φ-only estimate, padded-layout estimate) for run `key`."""
    case, offload = RUNS[key]
    strategy = strategy_for(case, offload, r["zero"], host_is_device)
    phi = sum(r["trainable"])
    if case.stage == 3:  # the units the engine chose (module structure), padded by the estimator's rule
        layout = plan_stage3_layout([numel for numel, _ in r["buckets"]], case.precision, WORLD)
    else:
        layout = plan_layout(r["trainable"], case.stage, case.precision, WORLD, r["zero"]["reduce_bucket_size"])
    shape = shape_from_params(phi + r["frozen"])
    if r["frozen"]:  # the frozen layers: compute-dtype parameters only
        shape = replace(shape, trainable=phi)
    return layout, estimate_memory(shape, strategy, WORLD), estimate_memory(shape, strategy, WORLD, layout=layout)


def by_category(est) -> dict[str, int]:
    return {"params": est.params + est.host_params, "grads": est.grads + est.host_grads,
            "optimizer_states": est.optimizer_states + est.host_optimizer_states,
            "tier_device": est.device_at_rest, "tier_host": est.host_at_rest}


@pytest.fixture(scope="module")
def ledgers():
    return run_ranks(_worker, WORLD, RUNS, timeout=180)


@pytest.mark.parametrize("key", list(RUNS))
def test_padded_estimate_equals_memory_stats_per_tier_and_category(ledgers, key):
    for rank in range(WORLD):
        r = ledgers[rank][key]
        layout, _, exact = predict(key, r)
        assert list(zip(layout.numels, layout.padded)) == [tuple(b) for b in r["buckets"]], "layout rule"
        want = by_category(exact)
        got = {k: r["mem"][k] for k in want}
        assert got == want, f"{key} rank {rank}"
        assert r["mem"]["tier_nvme"] == 0 and r["mem"]["comm_buffers"] == 0


@pytest.mark.parametrize("key", list(RUNS))
def test_phi_only_estimate_is_close(ledgers, key):
    case, offload = RUNS[key]
    for rank in range(WORLD):
        r = ledgers[rank][key]
        layout, plain, exact = predict(key, r)
        got, want = by_category(plain), by_category(exact)
        if "ratio" in offload.get("offload_optimizer", {}):
            # whole shards go to the host: the split misses ratio x elements by at most half a shard
            k_host = strategy_for(case, offload, r["zero"]).k_on(host=True)
            slack = k_host * max(layout.shards) / 2
            assert abs(plain.host_optimizer_states - exact.host_optimizer_states) <= slack, (key, rank)
            assert got["optimizer_states"] == pytest.approx(r["mem"]["optimizer_states"], rel=0.05)
            continue
        for k in want:
            assert got[k] == pytest.approx(r["mem"][k], rel=0.05), f"{key} rank {rank} {k}: Φ-only estimate"


@pytest.mark.parametrize("key", list(RUNS))
def test_gpu_estimate_differs_by_the_separate_fp32_master_only(ledgers, key):
    """What the GPU case adds at rest, stated: a separate fp32 host master in fp32 training when
    the optimizer is offloaded but the parameter shard stays on the device."""
    case, offload = RUNS[key]
    r = ledgers[0][key]
    layout, _, cpu = predict(key, r, host_is_device=True)
    _, _, gpu = predict(key, r, host_is_device=False)
    host_elems = cpu.host_optimizer_states // strategy_for(case, offload, r["zero"]).k_on(host=True)
    master = 4 * host_elems if case.precision == "fp32" and "offload_param" not in offload else 0
    assert gpu.host_optimizer_states - cpu.host_optimizer_states == master
    assert (gpu.params, gpu.grads, gpu.optimizer_states, gpu.host_params, gpu.host_grads) == \
        (cpu.params, cpu.grads, cpu.optimizer_states, cpu.host_params, cpu.host_grads)
    assert gpu.host_buffers > cpu.host_buffers  # the pinned staging buffers exist only with a GPU


@pytest.mark.parametrize("key", [k for k in RUNS if not k.startswith("z3")])
def test_stage12_transients_within_buffers(ledgers, key):
    for rank in range(WORLD):
        r = ledgers[rank][key]
        _, _, exact = predict(key, r)
        mem = r["mem"]
        transient = mem["peak_grads"] - mem["grads"] + mem["peak_comm_buffers"]
        assert transient <= exact.buffers + exact.host_buffers, (key, rank, transient)


CLI_LABELS = {"opt": "stage {st} opt→cpu", "opt+param": "stage 3 opt→cpu param→cpu", "ratio0.5": "stage 3 opt→cpu 50%"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cli_estimate_json_matches_memory_stats(ledgers, precision, capsys):
    """What `zeroshard estimate --params 28032 --gpus-per-node 2 --cpu-only --offload-ratio 0.5
    --json` prints (from the bare count) against the engine, per tier and category: within 5%;
    the ratio row's tiers within half the largest shard's states (whole shards move)."""
    import json

    from zeroshard.cli.main import main

    assert main(["estimate", "--params", "28032", "--gpus-per-node", str(WORLD), "--cpu-only", "--precision",
                 precision, "--optimizer", "adamw", "--offload-ratio", "0.5", "--json"]) == 0
    by_label = {c["label"]: c["memory"] for c in json.loads(capsys.readouterr().out)["candidates"]}
    for key, (case, offload) in RUNS.items():
        if case.model != "gpt" or case.precision != precision:
            continue
        est = by_label[CLI_LABELS[key.split("-", 2)[2]].format(st=case.stage)]
        cli = {"params": est["params"] + est["host_params"], "grads": est["grads"] + est["host_grads"],
               "optimizer_states": est["optimizer_states"] + est["host_optimizer_states"],
               "tier_device": est["device_at_rest"], "tier_host": est["host_at_rest"]}
        for rank in range(WORLD):
            r = ledgers[rank][key]
            slack = 0
            if "ratio" in key:
                layout = predict(key, r)[0]
                slack = strategy_for(case, offload, r["zero"]).k_on(host=True) * max(layout.shards) / 2
            for k, v in cli.items():
                tol = slack if k.startswith("tier") else 0
                assert abs(v - r["mem"][k]) <= max(tol, 0.05 * r["mem"][k]), (key, rank, k, v, r["mem"][k])


def table(ledgers) -> str:
    rows = ["| run | tier_device measured = estimate | tier_host measured = estimate | params / grads / optimizer "
            "(dev+host) measured | Φ-only worst | GPU case: host + fp32 master |",
            "|---|---|---|---|---|---|"]
    for key in RUNS:
        r = ledgers[0][key]
        _, plain, exact = predict(key, r)
        _, _, gpu = predict(key, r, host_is_device=False)
        mem, want, rough = r["mem"], by_category(exact), by_category(plain)
        ok = all(mem[k] == want[k] for k in want)
        worst = max(abs(rough[k] - mem[k]) / mem[k] for k in CATEGORIES)
        rows.append(f"| {key} | {mem['tier_device']:,} = {want['tier_device']:,} | {mem['tier_host']:,} = "
                    f"{want['tier_host']:,} | {' / '.join(f'{mem[k]:,}' for k in CATEGORIES)} {'✓' if ok else '✗'} "
                    f"| {worst:.2%} | {gpu.host_at_rest - exact.host_at_rest:+,} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(run_ranks(_worker, WORLD, RUNS, timeout=180)))
