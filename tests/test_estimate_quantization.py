"""The estimator charges ZeRO++'s quantize + dequantize (issue 24): the bytes a quantized
collective quantizes and dequantizes per step, their time at timing.QUANTIZE_BW, and `plan`
recommending ZeRO++ only where the link time it saves exceeds that cost."""

import pytest

import zeroshard.estimate.timing as timing
from zeroshard.estimate import (Cluster, Precision, Stage, Strategy, Workload, estimate_comm, evaluate, gpu_spec,
                                inter_node_link, plan, shape_from_params)

P = 1 << 24  # divisible by every group size below: no padding to account for


def _codec(strategy: Strategy, nodes: int = 2, per_node: int = 2, gas: int = 1) -> dict[str, int]:
    est = estimate_comm(P, strategy, nodes, per_node, gradient_accumulation_steps=gas)
    return {f"{c.phase} {c.op}": c.codec_bytes for c in est.collectives}


@pytest.mark.parametrize("precision,width", [(Precision.FP32, 4), (Precision.BF16, 2)])
def test_codec_bytes_are_what_the_quantized_collectives_quantize_and_dequantize(precision, width):
    n, k = 4, 2
    plain = _codec(Strategy(stage=Stage.PARAMETERS, precision=precision))
    assert set(plain.values()) == {0}
    qwz = _codec(Strategy(stage=Stage.PARAMETERS, precision=precision, quantized_weights=True), gas=3)
    # each gather quantizes the rank's shard and dequantizes the whole bucket; fwd and bwd, 3 micro-steps
    assert qwz["forward all_gather"] == qwz["backward all_gather"] == 3 * width * (P // n + P)
    hpz = _codec(Strategy(stage=Stage.PARAMETERS, precision=precision, quantized_weights=True,
                          hpz_partition_size=2))
    assert hpz["backward all_gather"] == 0  # hpZ's backward gather is not quantized
    qgz = _codec(Strategy(stage=Stage.PARAMETERS, precision=precision, quantized_gradients=True))
    grad = Strategy(stage=Stage.PARAMETERS, precision=precision).grad_bytes
    # hop 1: the bucket quantized, k parts of P/k dequantized; hop 2: the same with P/k
    assert qgz["backward all_to_all"] == grad * (2 * P + 2 * (P // k))
    one_node = _codec(Strategy(stage=Stage.PARAMETERS, precision=precision, quantized_gradients=True), 1, 4)
    assert one_node["backward all_to_all"] == grad * 2 * P  # no second hop on one node


def test_quantization_time_is_codec_bytes_at_half_the_roundtrip_rate():
    shape = shape_from_params("1.3B")
    cl = Cluster(2, 8, gpu_spec("a100-80gb"), inter_node_link("roce-100g").bw_per_node, 1 << 40)
    s = Strategy(stage=Stage.PARAMETERS, precision=Precision.BF16, quantized_weights=True, quantized_gradients=True)
    c = evaluate(shape, s, cl, Workload(seq=2048, micro_batch=1, precision=Precision.BF16))
    codec = c.comm.total("codec_bytes")
    assert codec > 0
    assert c.time.quantization == pytest.approx(codec / (2 * timing.QUANTIZE_BW))
    slow = timing.estimate_time(shape, s, cl, c.comm, 2048, 1, quantize_bw=1e9)
    assert slow.quantization == pytest.approx(codec / 2e9)
    assert slow.step - c.time.step == pytest.approx(slow.quantization - c.time.quantization)
    with pytest.raises(ValueError):
        timing.quantization_seconds(c.comm, 0.0)


def _plan_30b(link: str):
    cl = Cluster(2, 8, gpu_spec("a100-40gb"), inter_node_link(link).bw_per_node, 1 << 41)
    return plan(shape_from_params("30B"), cl, Workload(seq=2048, micro_batch=1))


def test_plan_recommends_zeropp_only_where_the_link_saves_more_than_quantization_costs(monkeypatch):
    # 30B on 2 nodes x 8 A100-40GB (stage 3), one 100 Gb/s link per node: ZeRO++ saves more
    # inter-node time than quantizing costs at the stated GPU rate
    slow_link = _plan_30b("roce-100g")
    assert slow_link.winner.strategy.stage == Stage.PARAMETERS and slow_link.winner.strategy.zeropp
    assert slow_link.winner.time.quantization > 0
    # the same cluster where quantizing runs at a tenth of that rate: it costs more than the
    # link saves, so ZeRO++ is tried, loses, and is not recommended
    monkeypatch.setattr(timing, "QUANTIZE_BW", timing.QUANTIZE_BW / 10)
    slow_codec = _plan_30b("roce-100g")
    assert slow_codec.winner.strategy.stage == Stage.PARAMETERS and not slow_codec.winner.strategy.zeropp
    assert any("trying ZeRO++" in line for line in slow_codec.route), slow_codec.route
    # ... while on a 25 Gb/s link the saving still exceeds even that cost
    slower_link = _plan_30b("eth-25g")
    assert slower_link.winner.strategy.zeropp and slower_link.winner.time.quantization > 1.0


def test_the_rate_comes_from_the_argument_then_the_cluster_then_the_device_kind():
    """A measured rate passed as Cluster(quantize_bw=...) is what `evaluate` and `plan` charge;
    where the host is the device (CPU ranks) the stated CPU rate, else the GPU one."""
    from dataclasses import replace

    from zeroshard.policies import ConfigError

    shape = shape_from_params("1.3B")
    gpu = Cluster(2, 8, gpu_spec("a100-80gb"), inter_node_link("roce-100g").bw_per_node, 1 << 40)
    work = Workload(seq=2048, micro_batch=1, precision=Precision.BF16)
    s = Strategy(stage=Stage.PARAMETERS, precision=Precision.BF16, quantized_weights=True, quantized_gradients=True)
    codec = evaluate(shape, s, gpu, work).comm.total("codec_bytes")
    assert evaluate(shape, s, gpu, work).time.quantization == pytest.approx(codec / (2 * timing.QUANTIZE_BW))
    cpu = replace(s, host_is_device=True)
    assert evaluate(shape, cpu, gpu, work).time.quantization == pytest.approx(codec / (2 * timing.CPU_QUANTIZE_BW))
    measured = replace(gpu, quantize_bw=3e9)
    for strategy in (s, cpu):
        assert evaluate(shape, strategy, measured, work).time.quantization == pytest.approx(codec / 6e9)
    t = timing.estimate_time(shape, s, measured, evaluate(shape, s, measured, work).comm, 2048, 1, quantize_bw=1e9)
    assert t.quantization == pytest.approx(codec / 2e9)
    with pytest.raises(ConfigError, match="quantize"):
        replace(gpu, quantize_bw=0.0)


def test_plan_charges_the_clusters_measured_rate():
    # 30B on 2 x 8 A100-40GB over roce-100g picks ZeRO++ at the stated GPU rate (above); with a
    # measured rate of a tenth of it on the Cluster, ZeRO++ loses and is not recommended
    from dataclasses import replace

    cl = Cluster(2, 8, gpu_spec("a100-40gb"), inter_node_link("roce-100g").bw_per_node, 1 << 41)
    work = Workload(seq=2048, micro_batch=1)
    assert plan(shape_from_params("30B"), cl, work).winner.strategy.zeropp
    slow = plan(shape_from_params("30B"), replace(cl, quantize_bw=timing.QUANTIZE_BW / 10), work)
    assert slow.winner.strategy.stage == Stage.PARAMETERS and not slow.winner.strategy.zeropp
    assert any("trying ZeRO++" in line for line in slow.route), slow.route
