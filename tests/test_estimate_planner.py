"""The advisor's route: smallest stage that fits, offload only when needed, ZeRO++ when
the inter-node link is the bottleneck, and the smallest cluster when nothing fits."""

import pytest

from zeroshard.estimate import (
    Cluster, OffloadDevice, Stage, Workload, deepspeed_config, gpu_spec, inter_node_link, parse_bytes, plan,
    shape_from_params,
)
from zeroshard.policies import ConfigError


def cluster(nodes=1, g=1, gpu="a100-80gb", cpu="512GiB", link="ib-hdr-8x", nvme="0"):
    return Cluster(nodes, g, gpu_spec(gpu), inter_node_link(link).bw_per_node, parse_bytes(cpu),
                   nvme=parse_bytes(nvme))


def test_small_model_gets_plain_data_parallelism():
    p = plan(shape_from_params("125M"), cluster(g=8), Workload())
    assert p.winner.strategy.stage == Stage.DATA_PARALLEL


def test_13b_on_8x80gb_takes_the_smallest_stage_that_fits():
    p = plan(shape_from_params("13B"), cluster(g=8), Workload())
    w = p.winner
    assert w.strategy.stage >= Stage.GRADIENTS and w.strategy.offload_optimizer == OffloadDevice.NONE
    rejected = [c for c in p.candidates if not c.fits]
    assert {int(c.strategy.stage) for c in rejected} == {0, 1}


CASES = [("7B", cluster(g=8)), ("13B", cluster(g=8)), ("1.3B", cluster(gpu="rtx4090")), ("7B", cluster(g=2)),
         ("350M", cluster(g=8, gpu="a100-40gb")), ("30B", cluster(2, 8)), ("7B", cluster(gpu="rtx4090", cpu="128GiB"))]


@pytest.mark.parametrize("params, where", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_the_choice_is_the_fastest_fit_with_margin_and_its_reasons_agree(params, where):
    """Issue 45: a lower stage is kept only within SPEED_TRADE of the fastest fit of the winner's
    tier, a tight fit (above 95 % of usable memory) only when nothing fits with margin, and no
    route line contradicts itself ("less traffic (2.0 Φ vs 2.0 Φ)")."""
    import re

    from zeroshard.estimate.planner import SPEED_TRADE, TIGHT_MARGIN, candidate_strategies

    p = plan(shape_from_params(params), where, Workload())
    w = p.winner
    tiers = candidate_strategies(Workload(), p.shape.hidden)
    tier = next(t for t in tiers if w.strategy in t)
    roomy = [c for c in p.candidates if c.fits and c.strategy in tier
             and c.memory.device_total <= (1 - TIGHT_MARGIN) * c.device_budget]
    if roomy:
        assert w in roomy
        fastest = min(c.time.step for c in roomy)
        assert w.time.step <= fastest * (1 + SPEED_TRADE) + 5e-4
        lower = [c for c in roomy if c.strategy.stage < w.strategy.stage]
        assert all(c.time.step > fastest * (1 + SPEED_TRADE) for c in lower)  # each traded for speed
    for line in p.route:
        for a, b in re.findall(r"less \(?(?:traffic \()?([0-9.]+) Φ vs ([0-9.]+) Φ", line):
            assert float(a) < float(b), line
    assert p.route[-1].startswith(f"winner: {w.label()}")


def test_7b_on_one_24gb_gpu_offloads_to_host():
    p = plan(shape_from_params("7B"), cluster(gpu="rtx4090", cpu="128GiB"), Workload())
    s = p.winner.strategy
    assert s.offload_optimizer == OffloadDevice.CPU
    assert p.winner.memory.device_total <= p.winner.device_budget
    assert p.winner.memory.host_per_node <= p.winner.host_budget


def test_nvme_when_host_memory_is_short():
    p = plan(shape_from_params("7B"), cluster(gpu="rtx4090", cpu="32GiB", nvme="2TB"), Workload())
    assert p.winner.strategy.offload_optimizer == OffloadDevice.NVME


def test_zeropp_chosen_when_inter_node_link_is_the_bottleneck():
    work = Workload(seq=2048, micro_batch=1)
    # 100 Gb/s per node: ZeRO++ saves more than its quantization costs (test_estimate_quantization);
    # at 400 Gb/s (efa-p4d) it no longer does for this model
    slow = plan(shape_from_params("175B"), cluster(64, 8, gpu="a100-40gb", link="roce-100g"), work)
    assert slow.winner.strategy.stage == Stage.PARAMETERS and slow.winner.strategy.zeropp
    fast = plan(shape_from_params("175B"), cluster(64, 8, gpu="a100-40gb", link="ib-ndr-8x"), work)
    assert not fast.winner.strategy.zeropp


def test_fits_nowhere_reports_smallest_cluster():
    p = plan(shape_from_params("70B"), cluster(gpu="rtx4090", cpu="64GiB"), Workload())
    assert p.winner is None
    cl, cand = p.smallest_fit
    assert cand.fits and cl.world_size > 1
    # one node fewer does not fit
    if cl.nodes > 1:
        smaller = plan(shape_from_params("70B"), cl.with_size(cl.nodes - 1), Workload())
        assert smaller.winner is None


def test_deepspeed_config_keys_and_batch_arithmetic():
    p = plan(shape_from_params("7B"), cluster(gpu="rtx4090", cpu="128GiB"), Workload(micro_batch=2,
                                                                                      gradient_accumulation_steps=4))
    cfg = deepspeed_config(p.winner.strategy, p.work, p.cluster)
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 1
    z = cfg["zero_optimization"]
    assert z["stage"] == int(p.winner.strategy.stage) and z["offload_optimizer"]["device"] == "cpu"
    assert cfg["bf16"] == {"enabled": True}
    allowed = {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
               "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "sub_group_size", "offload_optimizer",
               "offload_param", "zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients"}
    assert set(z) <= allowed


def test_workload_validation():
    with pytest.raises(ConfigError):
        Workload(micro_batch=0)
    with pytest.raises(ConfigError, match="nodes"):
        cluster(nodes=0)


@pytest.mark.parametrize("params,kw", [("13B", dict(g=8)), ("7B", dict(gpu="rtx4090", cpu="128GiB")),
                                       ("175B", dict(nodes=64, g=8, gpu="a100-40gb", link="efa-p4d"))])
def test_config_loader_knows_every_key_the_planner_writes(params, kw):
    """Keys must be DeepSpeed's: the loader may say "not supported yet", never "unknown key"."""
    config = pytest.importorskip("zeroshard.config")
    if not hasattr(config, "load_config"):
        pytest.skip("zeroshard.config.load_config not written yet")
    from zeroshard.policies import NotSupportedYetError

    p = plan(shape_from_params(params), cluster(**kw), Workload())
    cfg = deepspeed_config(p.winner.strategy, p.work, p.cluster)
    try:
        settings = config.load_config(cfg, world_size=p.cluster.world_size)
    except NotSupportedYetError:
        return
    # unknown top-level keys load (as in DeepSpeed) with a note: there must be none
    assert not [n for n in settings.notes if "top-level key" in n], settings.notes


# ---------------------------------------------------------------- issue 10: the offload route
def _route_index(p, label):
    return next(i for i, line in enumerate(p.route) if line.startswith(label + ":"))


def _7b_24gb(mem="24GiB", **work):
    from dataclasses import replace

    cl = cluster()
    return plan(shape_from_params("7B"), replace(cl, gpu=replace(gpu_spec("a100-80gb"), memory=parse_bytes(mem))),
                Workload(**work))


def test_parameter_offload_comes_after_checkpointing_with_optimizer_offload():
    """DeepSpeed's gradient model (fp32 partition on the host): stage 2 + optimizer offload + AC
    fits and is predicted faster than parameter offload, so it wins; the route says why."""
    p = _7b_24gb(grads_to_host=True)
    w = p.winner
    assert w.label() == "stage 2 opt→cpu +AC" and w.time.step == pytest.approx(3.14, abs=0.01)
    assert _route_index(p, "stage 2 opt→cpu +AC") < _route_index(p, "stage 3 opt→cpu param→cpu")
    assert "same step time" in p.route[_route_index(p, "stage 3 opt→cpu +AC")]
    for label in ("stage 3 opt→cpu param→cpu", "stage 3 opt→cpu param→cpu +AC"):
        line = p.route[_route_index(p, label)]
        assert "also fits" in line and "slower" in line and "adds parameter offload" in line, line


def test_engine_keeps_gradients_on_the_device_so_7b_needs_parameter_offload_on_24gb():
    """zeroshard's engine keeps the 16-bit gradient shard (2Φ at N = 1) on the device under
    optimizer offload: stage 2 + offload + AC needs 27 GiB, and only parameter offload fits."""
    p = _7b_24gb()
    assert p.winner.label() == "stage 3 opt→cpu param→cpu +AC"
    assert "rejected, device needs 27.3 GiB" in p.route[_route_index(p, "stage 2 opt→cpu +AC")]
    assert "nothing fits in the cheaper tiers" in p.route[_route_index(p, "stage 3 opt→cpu param→cpu +AC")]
    # every optimizer-only candidate, with and without AC, is tried before parameter offload
    first_param = _route_index(p, "stage 3 opt→cpu param→cpu")
    assert all(_route_index(p, lab) < first_param for lab in
               ("stage 1 opt→cpu", "stage 2 opt→cpu", "stage 3 opt→cpu", "stage 2 opt→cpu +AC", "stage 3 opt→cpu +AC"))


def test_engine_model_with_room_for_the_gradient_prefers_checkpointing_to_parameter_offload():
    p = _7b_24gb(mem="40GiB")
    assert p.winner.label() == "stage 1 opt→cpu +AC"  # on one GPU stage 1 holds what stage 2 holds: the lower wins
    line = p.route[_route_index(p, "stage 3 opt→cpu param→cpu")]
    assert "also fits" in line and "adds parameter offload" in line
