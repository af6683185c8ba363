"""Formulas against hand-computed values: the ZeRO paper's Table 1, DeepSpeed's estimators,
communication volumes, activations and parameter counts."""

import json

import pytest

from zeroshard.estimate import (
    GB, GIB, Precision, Stage, Strategy, activation_bytes, ds_estimate_zero2, ds_estimate_zero3,
    estimate_comm, estimate_memory, model_states_per_device, optimizer_bytes_per_param, parse_bytes, parse_count,
    ring_split, shape_from_callable, shape_from_hf_config, shape_from_params,
)
from zeroshard.estimate.comm import QUANT_BLOCK_SIZE
from zeroshard.estimate.model_size import ModelShape
from zeroshard.policies import ConfigError

PHI_PAPER = 7_500_000_000


# ---------------------------------------------------------------- ZeRO paper, Table 1

@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_table1_7_5b_n64(stage, expected_gb):
    got = model_states_per_device(PHI_PAPER, 64, stage, k=12) / GB
    assert round(got, 1 if stage < 3 else 2) == expected_gb


def test_zero_paper_exact_bytes():
    # 2Φ + 2Φ + KΦ/N = 15e9 + 15e9 + 90e9/64
    assert model_states_per_device(PHI_PAPER, 64, 1) == 30_000_000_000 + 1_406_250_000
    assert model_states_per_device(PHI_PAPER, 64, 3) == 120_000_000_000 // 64


def test_estimate_memory_matches_paper_without_extras():
    shape = ModelShape(params=PHI_PAPER, largest_unit=1, largest_layer=1, layers=1, hidden=64, heads=1,
                       vocab=1, source="test")
    for st in Stage:
        m = estimate_memory(shape, Strategy(stage=st, precision=Precision.BF16), 64)
        assert m.model_states == model_states_per_device(PHI_PAPER, 64, st)


def test_k_counts_the_fp32_master_as_the_engine_does():
    assert optimizer_bytes_per_param("adam", Precision.BF16) == 12
    # in fp32 the engine steps the parameter shard itself: no second copy
    assert optimizer_bytes_per_param("adam", Precision.FP32) == 8
    assert Strategy(precision="fp32", optimizer="adamw").k == 8
    # DeepSpeed's convention (a second fp32 copy also in fp32 training), for comparisons
    assert optimizer_bytes_per_param("adam", Precision.FP32, separate_fp32_master=True) == 12
    assert Strategy(precision="fp32", separate_fp32_master=True).k == 12
    assert Strategy(precision="bf16", separate_fp32_master=True).k == 12
    assert optimizer_bytes_per_param("sgd", Precision.FP16) == 4
    with pytest.raises(ConfigError, match="known"):
        optimizer_bytes_per_param("shampoo", Precision.BF16)


def test_7b_n8_worked_example():
    """docs/estimate.md: 7B, bf16 + Adam, N = 8 (decimal GB)."""
    phi = 7_000_000_000
    assert [model_states_per_device(phi, 8, s) / GB for s in range(4)] == [112.0, 38.5, 26.25, 14.0]


# ---------------------------------------------------------------- offload, hpZ, stage-3 extras

def _shape(phi=8_000_000, unit=1_000_000):
    return ModelShape(params=phi, largest_unit=unit, largest_layer=unit, layers=8, hidden=256, heads=4,
                      vocab=1000, source="test")


def test_offload_moves_optimizer_and_fp32_grads_to_host():
    """DeepSpeed's ZeRO-Offload (grads_to_host): the fp32 gradient partition lives on the host."""
    sh = _shape()
    m = estimate_memory(sh, Strategy(stage=2, offload_optimizer="cpu", grads_to_host=True), n=4, gpus_per_node=4)
    assert m.optimizer_states == 0 and m.grads == 0 and m.params == 2 * sh.params
    assert m.host_per_rank == (12 + 4) * sh.params // 4
    assert m.host_per_node == 16 * sh.params


def test_offload_as_zeroshards_engine_keeps_the_gradient_shard_on_the_device():
    sh = _shape()
    m = estimate_memory(sh, Strategy(stage=2, offload_optimizer="cpu", reduce_bucket_size=10**6), n=4)
    assert (m.params, m.grads, m.optimizer_states) == (2 * sh.params, 2 * sh.params // 4, 0)
    assert (m.host_params, m.host_grads, m.host_optimizer_states) == (0, 0, 12 * sh.params // 4)
    # the step: one sub-group (capped by reduce_bucket_size) upcast on the host, two pinned bf16 stagings
    assert m.host_buffers == (4 + 2 * 2) * 10**6
    cpu = estimate_memory(sh, Strategy(stage=2, offload_optimizer="cpu", reduce_bucket_size=10**6,
                                       host_is_device=True), n=4)
    assert cpu.host_buffers == 4 * 10**6 and cpu.host_at_rest == m.host_at_rest


def test_fp32_master_placement_with_offload():
    """fp32: the shard is its own master only in the same memory as the optimizer."""
    sh, n = _shape(), 4
    own = sh.params // n

    def mem(**kw):
        return estimate_memory(sh, Strategy(stage=3, precision="fp32", **kw), n)
    gpu_opt = mem(offload_optimizer="cpu")
    assert gpu_opt.host_optimizer_states == 12 * own and gpu_opt.params == 4 * own
    assert mem(offload_optimizer="cpu", host_is_device=True).host_optimizer_states == 8 * own
    both = mem(offload_optimizer="cpu", offload_param="cpu")
    assert both.host_optimizer_states == 8 * own and both.host_params == 4 * own and both.params == 0
    dev_opt = mem(offload_param="cpu")  # device optimizer over host parameter shards: a device master
    assert dev_opt.optimizer_states == 12 * own
    assert mem(offload_param="cpu", host_is_device=True).optimizer_states == 8 * own


def test_offload_ratio_splits_whole_shards():
    from zeroshard.estimate.padding import BucketPlan, offload_split

    assert offload_split([1312, 6352, 6352], 0.5) == [True, True, False]
    assert offload_split([10, 10], 0.0) == [False, False] and offload_split([10, 10], 1.0) == [True, True]
    layout = BucketPlan((2624, 12704, 12704), (2624, 12704, 12704), 2)
    m = estimate_memory(_shape(phi=28032, unit=12704), Strategy(stage=3, offload_optimizer="cpu", offload_ratio=0.5),
                        2, layout=layout)
    assert m.host_optimizer_states == 12 * (1312 + 6352) and m.optimizer_states == 12 * 6352
    assert Strategy(stage=3, offload_optimizer="cpu", offload_ratio=0.5).label() == "stage 3 opt→cpu 50%"
    with pytest.raises(ConfigError, match="ratio"):
        Strategy(stage=3, offload_ratio=0.5)
    with pytest.raises(ConfigError, match="ratio"):
        Strategy(stage=3, offload_optimizer="cpu", offload_ratio=1.5)


def test_nvme_offload_puts_states_on_nvme():
    sh = _shape()
    m = estimate_memory(sh, Strategy(stage=3, offload_optimizer="nvme", offload_param="nvme"), n=2, gpus_per_node=2)
    assert m.nvme_per_rank == (12 + 4) * sh.params // 2 + 2 * sh.params // 2  # states, fp32 grads, params
    assert m.params == 0 and m.optimizer_states == 0 and m.host_per_rank > 0


def test_hpz_secondary_copy_and_stage3_live_params():
    sh = _shape()
    m = estimate_memory(sh, Strategy(stage=3, hpz_partition_size=4, quantized_weights=True), n=16)
    assert m.hpz_secondary == 2 * sh.params // 4
    assert m.live_params == 2 * 2 * sh.largest_unit  # unit in use + prefetched unit, bf16
    assert m.buffers == 2 * 2 * sh.largest_unit  # two units' bf16 gradients: one reducing, one filling


def test_strategy_rejects_impossible_combinations():
    with pytest.raises(ConfigError, match="stage 3"):
        Strategy(stage=2, offload_param="cpu")
    with pytest.raises(ConfigError, match="stage 3"):
        Strategy(stage=1, quantized_gradients=True)
    with pytest.raises(ConfigError, match="negative"):
        Strategy(optimizer_bytes=-1)


# ---------------------------------------------------------------- DeepSpeed's estimators

def test_ds_zero2_formula_hand_values():
    phi = 1_000_000_000
    assert ds_estimate_zero2(phi, 8, 1, cpu_offload=False) == (int(phi * 4 * 8 * 1.5), 4 * phi + 2 * phi)
    assert ds_estimate_zero2(phi, 8, 1, cpu_offload=True) == (int(phi * 32 * 1.5), 2 * phi)
    assert ds_estimate_zero2(phi, 2, 1, cpu_offload=True) == (int(phi * 16 * 1.5), 2 * phi)


def test_ds_zero3_formula_hand_values():
    phi, layer = 1_000_000_000, 10_000_000
    cpu, gpu, ll = ds_estimate_zero3(phi, layer, 8, 2, cpu_offload=False)
    assert (gpu, ll) == (4 * layer + 18 * phi // 16, 4 * layer)
    assert cpu == int(layer * 4 * 8 * 1.5)
    cpu, gpu, _ = ds_estimate_zero3(phi, layer, 8, 2, cpu_offload=True, cpu_offload_params=True)
    assert gpu == 4 * layer and cpu == int(phi * 18 / 2 * 1.5)


def test_ours_vs_deepspeed_where_they_define_the_same_quantity():
    phi, n = 1_600_000_000, 8
    sh = ModelShape(params=phi, largest_unit=10_000_000, largest_layer=10_000_000, layers=8, hidden=256,
                    heads=4, vocab=1000, source="test")
    # zero2 + cpu offload: both put only the 16-bit parameters on the GPU.
    # (DeepSpeed's model of the gradient: streamed to a host fp32 partition, grads_to_host)
    m = estimate_memory(sh, Strategy(stage=2, offload_optimizer="cpu", grads_to_host=True), n, n)
    assert m.model_states == ds_estimate_zero2(phi, n, 1, cpu_offload=True)[1]
    # zero2 without offload: DeepSpeed counts a full 16-bit gradient and an fp32 gradient
    # partition: its figure exceeds the paper's 2Φ + 14Φ/N by exactly 2Φ + 2Φ/N.
    m = estimate_memory(sh, Strategy(stage=2), n, n)
    assert ds_estimate_zero2(phi, n, 1, cpu_offload=False)[1] - m.model_states == 2 * phi + 2 * phi // n
    # zero3 without offload: DeepSpeed = 4*largest_layer + 18Φ/N; ours 16Φ/N model states.
    m = estimate_memory(sh, Strategy(stage=3), n, n)
    assert ds_estimate_zero3(phi, sh.largest_layer, n, 1, cpu_offload=False)[1] - m.model_states == \
        4 * sh.largest_layer + 2 * phi // n
    # zero3 with both offloads: host per node equals DeepSpeed's cpu figure without its 1.5 factor.
    m = estimate_memory(sh, Strategy(stage=3, offload_optimizer="cpu", offload_param="cpu", grads_to_host=True),
                        2 * n, n)
    cpu, gpu, _ = ds_estimate_zero3(phi, sh.largest_layer, n, 2, True, True, True)
    assert m.host_per_node == pytest.approx(cpu / 1.5, rel=1e-9) and m.model_states == 0
    # zero3 with optimizer offload: both put the 2Φ/N parameter shard on the device.
    m = estimate_memory(sh, Strategy(stage=3, offload_optimizer="cpu", grads_to_host=True), n, n)
    cpu, gpu, ll = ds_estimate_zero3(phi, sh.largest_layer, n, 1, True, False, True)
    assert m.model_states == gpu - ll and m.host_per_node == pytest.approx(cpu / 1.5)


# ---------------------------------------------------------------- communication

@pytest.mark.parametrize("stage,units", [(0, 2.0), (1, 2.0), (2, 2.0), (3, 3.0)])
def test_comm_paper_units(stage, units):
    c = estimate_comm(1_000_000, Strategy(stage=stage), nodes=1, gpus_per_node=8)
    # stages >= 1 add the 1-element fp32 all-reduce of the global gradient norm (2 paper units)
    norm = 2 if stage else 0
    assert c.total("paper_elements") == units * 1_000_000 + norm
    assert c.paper_units == pytest.approx(units, abs=1e-5)
    assert c.total("paper_elements") - norm == units * 1_000_000
    assert estimate_comm(1_000_000, Strategy(stage=stage, compute_grad_norm=False), 1, 8).paper_units == units


def model_sized(c):
    """The collectives over the model (everything but the scalar gradient-norm all-reduce)."""
    return [x for x in c.collectives if x.what != "global gradient norm"]


def test_gradient_norm_allreduce_only_when_sharded():
    for stage in (1, 2, 3):
        norm = [x for x in estimate_comm(800, Strategy(stage=stage), 1, 2).collectives
                if x.what == "global gradient norm"]
        assert [(x.op, x.elements, x.bytes, x.sent_bytes, x.calls) for x in norm] == [("all_reduce", 1, 4, 4, 1)]
    assert len(estimate_comm(800, Strategy(stage=0), 1, 8).collectives) == 1  # stage 0: whole gradients
    assert len(estimate_comm(800, Strategy(stage=1), 1, 1).collectives) == 2  # one rank: nothing to combine
    fp16 = Strategy(stage=1, precision="fp16", compute_grad_norm=False)  # overflow flag still needed
    assert estimate_comm(800, fp16, 1, 8).collectives[-1].what == "global gradient norm"


def test_stage1_and_2_send_exactly_what_plain_dp_sends():
    phi, n = 1_000_000, 8
    sent = [sum(x.sent_bytes for x in model_sized(estimate_comm(phi, Strategy(stage=s), 1, n))) for s in (0, 1, 2)]
    assert sent[0] == sent[1] == sent[2] == 2 * 2 * phi * (n - 1) // n  # bf16, ring (n-1)/n
    s3 = sum(x.sent_bytes for x in model_sized(estimate_comm(phi, Strategy(stage=3), 1, n)))
    assert s3 == 3 * 2 * phi * (n - 1) // n


def test_ring_split_adds_up_to_flat_ring():
    s = 1_024_000
    intra, inter = ring_split(s, nodes=4, per_node=8)
    assert intra + inter == s * 31 // 32
    assert inter == s * 3 // 32 and intra == s * 7 // 8
    assert ring_split(s, 1, 8)[1] == 0


def test_padding_to_multiple_of_n():
    c = estimate_comm(1001, Strategy(stage=2), 1, 8)
    assert all(col.elements == 1008 for col in model_sized(c))


def test_gradient_accumulation_per_stage():
    phi = 800
    calls = lambda st: [c.calls for c in model_sized(estimate_comm(phi, Strategy(stage=st), 1, 8, 4))]
    assert calls(0) == [1] and calls(1) == [1, 1] and calls(2) == [4, 1] and calls(3) == [4, 4, 4]


def test_zeropp_qwz_hpz_qgz():
    phi, nodes, g = 8 * 2048 * 100, 4, 8
    n = nodes * g
    base = estimate_comm(phi, Strategy(stage=3), nodes, g)
    zpp = estimate_comm(phi, Strategy(stage=3, quantized_weights=True, hpz_partition_size=8,
                                      quantized_gradients=True), nodes, g)
    fwd_b, bwd_b, rs_b = model_sized(base)
    fwd, bwd, rs = model_sized(zpp)
    # qwZ: int8 + one fp32 scale per block of each shard: just over half the bf16 bytes
    assert fwd.bytes == phi + (phi // n // QUANT_BLOCK_SIZE + (phi // n % QUANT_BLOCK_SIZE > 0)) * n * 4
    assert 0.5 < fwd.bytes / fwd_b.bytes < 0.51
    # hpZ: backward all-gather never leaves the node
    assert bwd.inter_bytes == 0 and bwd_b.inter_bytes > 0
    assert bwd.intra_bytes == 2 * phi * 7 // 8
    # qgZ: int4, inter-node hop carries only the node-reduced 1/g slice: 1/4 of bf16 RS bytes
    assert rs.inter_bytes < rs_b.inter_bytes / 3.9
    assert zpp.paper_units == base.paper_units == pytest.approx(3.0, abs=1e-5)
    assert zpp.total("inter_bytes") < base.total("inter_bytes") / 3


# ---------------------------------------------------------------- activations

def test_activations_korthikanti_eq1():
    s, b, h, a, L, V = 2048, 1, 4096, 32, 32, 32000
    full = activation_bytes(s, b, h, a, L, V, checkpointing=False, flash_attention=False)
    assert full.per_layer == s * b * h * (34 + 5 * a * s / h)
    flash = activation_bytes(s, b, h, a, L, V, flash_attention=True)
    assert flash.per_layer == 34 * s * b * h
    ac = activation_bytes(s, b, h, a, L, V, checkpointing=True)
    assert ac.stored == 2 * s * b * h * L and ac.recompute == flash.per_layer
    assert ac.total < flash.total / 5
    with pytest.raises(ConfigError, match="positive"):
        activation_bytes(0, 1, h, a, L, V)


# ---------------------------------------------------------------- sizes and parsing

def test_parse_sizes():
    assert parse_count("7B") == 7 * 10**9 and parse_count("1.3e9") == 1_300_000_000
    assert parse_count("350M") == 350_000_000 and parse_count("2T") == 2 * 10**12 and parse_count("5K") == 5000
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("80GB") == 80 * GB and parse_bytes("24") == 24 * GIB
    for bad in ("-7B", "7X", "abc", "0"):
        with pytest.raises(ConfigError):
            parse_count(bad)
    with pytest.raises(ConfigError, match="negative"):
        parse_bytes("-1GB")


def test_shape_from_params_infers_a_plausible_shape():
    sh = shape_from_params("175B")
    assert sh.shape_inferred and sh.layers == 96 and sh.hidden == 12288  # GPT-3's shape
    sh = shape_from_params("7B", layers=32, hidden=4096)
    assert not sh.shape_inferred and sh.largest_unit == 12 * 4096 * 4096


LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
             "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}


def _write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


def test_analytic_counts_known_models(tmp_path):
    assert shape_from_hf_config(_write(tmp_path, LLAMA2_7B)).params == 6_738_415_616  # Llama-2-7b
    assert shape_from_hf_config(_write(tmp_path, GPT2)).params == 124_439_808  # gpt2
    mistral = dict(LLAMA2_7B, model_type="mistral", intermediate_size=14336, num_key_value_heads=8)
    assert shape_from_hf_config(_write(tmp_path, mistral)).params == 7_241_732_096  # Mistral-7B-v0.1


def test_not_a_model_config(tmp_path):
    with pytest.raises(ConfigError, match="not a Hugging Face model config.*DeepSpeed"):
        shape_from_hf_config(_write(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 2}}))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON"):
        shape_from_hf_config(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="does not exist"):
        shape_from_hf_config(str(tmp_path / "missing.json"))


SMALL_CONFIGS = [
    dict(LLAMA2_7B, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=100),
    dict(LLAMA2_7B, model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=1, vocab_size=100),
    dict(LLAMA2_7B, model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True),
    dict(GPT2, n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32),
]


@pytest.mark.parametrize("cfg", SMALL_CONFIGS, ids=lambda c: c["model_type"])
def test_analytic_count_equals_transformers_meta_count(tmp_path, cfg):
    pytest.importorskip("transformers")
    path = _write(tmp_path, cfg)
    analytic = shape_from_hf_config(path)
    meta = shape_from_hf_config(path, use_transformers=True)
    assert analytic.params == meta.params
    assert analytic.largest_unit == meta.largest_unit


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_callable_on_meta_device():
    sh = shape_from_callable("torch.nn:Transformer")  # default nn.Transformer(), 44M params, no memory
    assert sh.params == 44_140_544
    assert sh.largest_unit == 4_204_032  # one decoder layer: 2 attentions 2x1,050,624 + FFN 2,099,712 + 3 norms
    with pytest.raises(ConfigError, match="cannot import"):
        shape_from_callable("no_such_module_xyz:build")
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        shape_from_callable("builtins:dict")
    with pytest.raises(ConfigError, match="module:callable"):
        shape_from_callable("torch.nn.Transformer")


def test_callable_counts_tied_weights_once():
    from zeroshard.models.gpt import GPT_PRESETS  # noqa: F401  (the tiny GPT: 28,032 parameters)
    import zeroshard.models.gpt as gpt

    gpt._estimate_tiny = lambda: gpt.build_gpt("tiny")
    try:
        sh = shape_from_callable("zeroshard.models.gpt:_estimate_tiny")
    finally:
        del gpt._estimate_tiny
    assert sh.params == 28_032 and sh.layers == 2 and sh.hidden == 32


# ---------------------------------------------------------------- the engine's padding rule

def test_plan_layout_packs_last_first_and_pads_per_bucket():
    from zeroshard.estimate.padding import bucket_numels, padded_size, plan_layout

    assert bucket_numels([1024, 32, 256, 8], 1000) == [296, 1024]  # reversed; 1024 > cap sits alone
    assert padded_size(296, 2, 8) == 304 and padded_size(3, 2, 8) == 16 and padded_size(32, 1, 4) == 32
    lay = plan_layout([1024, 32, 256, 8], stage=2, precision="bf16", n=2, reduce_bucket_size=1000)
    assert (lay.padded, lay.shards, lay.padding) == ((304, 1024), (152, 512), 8)
    assert plan_layout([1024, 32, 256, 8], 0, "fp32", 2, 1000).padded == (296, 1024)  # stage 0: 1 shard


def test_layout_makes_memory_and_comm_exact_and_must_match_the_stage():
    from zeroshard.estimate.padding import plan_layout

    sizes = [1024, 32, 256, 8]
    s = Strategy(stage=2, precision="bf16", optimizer="adamw", reduce_bucket_size=1000, allgather_bucket_size=200)
    lay = plan_layout(sizes, 2, "bf16", 2, 1000)
    m = estimate_memory(shape_from_params(sum(sizes)), s, 2, layout=lay)
    assert (m.params, m.grads, m.optimizer_states) == (2 * 1328, 2 * 664, 12 * 664)
    c = estimate_comm(sum(sizes), s, 1, 2, 3, layout=lay)
    by = {(x.op, x.what): x for x in c.collectives}
    rs, ag = by[("reduce_scatter", "gradients")], by[("all_gather", "updated parameters")]
    assert (rs.calls, rs.elements) == (2 * 3, 1328 * 3)  # stage 2: every micro-step, one per bucket
    assert (ag.calls, ag.elements) == (2 + 6, 1328)  # 152/100 -> 2 chunks, 512/100 -> 6 chunks
    with pytest.raises(ConfigError, match="splits 1 ways"):
        estimate_memory(shape_from_params(sum(sizes)), Strategy(stage=0), 2, layout=lay)
