"""DeepSpeed's key rules: what loads with a note, what is an error, what is refused.

DeepSpeed 0.19.8 (`runtime/config.py`) reads the top level with `dict.get`, so an unknown or
dotted top-level key is ignored; its blocks are pydantic models with extra="forbid", so an
unknown key inside one is an error; keys of removed features are refused even when disabled
(`_reject_removed_config_keys`). zeroshard follows the same rules and says what it ignored.
"""

from __future__ import annotations

import copy

import pytest

from zeroshard.config import load_config
from zeroshard.policies import ConfigError, NotSupportedYetError

ZERO3 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
         "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "overlap_comm": True}}


def _notes(cfg, world_size=2):
    return load_config(cfg, world_size).notes


def _same_policies(a, b) -> bool:
    keep = ("batch", "precision", "zero", "optimizer", "scheduler", "gradient_clipping", "runtime", "activations")
    return all(getattr(a, k) == getattr(b, k) for k in keep)


def _with(**extra):
    return {**copy.deepcopy(ZERO3), **extra}


# ------------------------------------------------------------------ unknown top-level keys

@pytest.mark.parametrize("key,value,words", [
    ("zero_optimisation", {"stage": 2}, "did you mean 'zero_optimization'?"),
    ("gradient_cliping", 1.0, "did you mean 'gradient_clipping'?"),
    ("reduce_bucket_size", 100, "it belongs in zero_optimization"),
    ("_comment", "ZeRO-3 for 8 GPUs", '= "ZeRO-3 for 8 GPUs"'),
    ("comms_config", {"verbose": False}, "'comms_config' = "),
    ("monitor_config", {"enabled": False}, "'monitor_config' = "),
    ("cuda_visible_devices", "0,1", "'cuda_visible_devices' = "),
])
def test_unknown_top_level_key_loads_with_one_note(key, value, words):
    cfg = _with(**{key: value})
    settings = load_config(cfg, 2)
    mine = [n for n in settings.notes if repr(key) in n]
    assert len(mine) == 1 and "unknown top-level key" in mine[0] and words in mine[0], settings.notes
    assert "DeepSpeed ignores" in mine[0]
    assert _same_policies(settings, load_config(ZERO3, 2))  # ignored means: as if absent, as in DeepSpeed


def test_no_did_you_mean_for_a_far_key():
    note = next(n for n in _notes(_with(comms_config={})) if "comms_config" in n)
    assert "did you mean" not in note  # comms_logger is not close enough to offer


@pytest.mark.parametrize("block,key", [
    ("zero_optimization", "reduce_bucket_sise"), ("fp16", "enabeld"), ("bf16", "loss_scale"),
    ("hybrid_engine", "max_out_token"), ("tensor_parallel", "autotp"), ("aio", "queue_dept"),
])
def test_unknown_key_inside_a_block_stays_an_error(block, key):
    cfg = _with()
    cfg.setdefault(block, {})
    cfg[block] = {**cfg[block], key: 1}
    with pytest.raises(ConfigError) as info:
        load_config(cfg, 2)
    assert f"unknown key {key!r} in {block}" in str(info.value)


# ------------------------------------------------------------------ dotted keys (TRL)

def test_trl_prepare_deepspeed_dotted_keys_are_ignored_as_deepspeed_ignores_them():
    """TRL's prepare_deepspeed (trl/models/utils.py) adds these for a ZeRO-3 reference model with
    hidden size h; DeepSpeed reads only the nested zero_optimization block, so they do nothing."""
    h = 64
    cfg = _with(**{"zero_optimization.reduce_bucket_size": h * h,
                   "zero_optimization.stage3_param_persistence_threshold": 10 * h,
                   "zero_optimization.stage3_prefetch_bucket_size": 0.9 * h * h})
    settings = load_config(cfg, 2)
    plain = load_config(ZERO3, 2)
    assert _same_policies(settings, plain)
    assert settings.zero.reduce_bucket_size == plain.zero.reduce_bucket_size != h * h
    dotted = [n for n in settings.notes if "dotted" in n]
    assert len(dotted) == 1 and "'zero_optimization.reduce_bucket_size'" in dotted[0]
    assert "'zero_optimization.stage3_prefetch_bucket_size'" in dotted[0] and "ignores these too" in dotted[0]


# ------------------------------------------------------------------ blocks of features not built

@pytest.mark.parametrize("key,block", [
    ("tensor_parallel", {"autotp_size": 1}),  # OpenRLHF writes this into every config
    ("tensor_parallel", {"autotp_size": 0}),
    ("tensor_parallel", {}),
    ("hybrid_engine", {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                       "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8}),
    ("data_efficiency", {"enabled": False, "seed": 1234,
                         "data_sampling": {"enabled": False, "curriculum_learning": {"enabled": False}}}),
    ("pipeline", {"stages": "auto", "partition": "best", "activation_checkpoint_interval": 0}),
    ("expert_parallel", {"enabled": False, "autoep_size": 1}),
    ("sequence_parallel_size", 1),
    ("timers", {"throughput": {"enabled": True, "synchronized": True}}),
    ("disable_python_gc", 100),
])
def test_inert_block_loads_with_a_note_and_changes_nothing(key, block):
    settings = load_config(_with(**{key: block}), 2)
    mine = [n for n in settings.notes if n.startswith(f"ignored: {key} (")]
    assert len(mine) == 1, settings.notes
    assert _same_policies(settings, load_config(ZERO3, 2))


@pytest.mark.parametrize("key,block,words", [
    ("tensor_parallel", {"autotp_size": 2}, "tensor_parallel.autotp_size = 2: zeroshard"),
    ("hybrid_engine", {"enabled": True, "inference_tp_size": 2}, "hybrid_engine.inference_tp_size = 2"),
    ("data_efficiency", {"enabled": True}, "data_efficiency.enabled = true: zeroshard"),
    ("data_efficiency", {"data_routing": {"random_ltd": {"enabled": True}}},
     "data_efficiency.data_routing.random_ltd.enabled = true"),
    ("expert_parallel", {"enabled": True, "autoep_size": 2}, "expert_parallel.autoep_size = 2"),
    ("sequence_parallel_size", 2, "sequence_parallel_size = 2: zeroshard"),
    ("weight_quantization", {"quantized_initialization": {"num_bits": 8}},
     "weight_quantization.quantized_initialization"),
])
def test_enabled_feature_is_one_refusal_naming_it(key, block, words):
    with pytest.raises(NotSupportedYetError) as info:
        load_config(_with(**{key: block}), 2)
    msg = str(info.value)
    assert words in msg and "does not build" in msg and msg.count("\n") == 0, msg


def test_hybrid_engine_enabled_loads_with_a_note_naming_what_serves_it():
    """DeepSpeed-Chat's `hybrid_engine: {"enabled": true}`: engine.generate() is served
    (tests/test_generation.py); its inference-kernel keys are named as without effect."""
    settings = load_config(_with(hybrid_engine={"enabled": True, "max_out_tokens": 256}), 2)
    mine = [n for n in settings.notes if n.startswith("hybrid_engine.enabled")]
    assert len(mine) == 1 and "engine.generate()" in mine[0] and "max_out_tokens" in mine[0], settings.notes
    assert _same_policies(settings, load_config(ZERO3, 2))


def test_every_feature_row_is_exercised():
    """Each row of foreign.FEATURES is read from a RootConfig field of the same name."""
    from zeroshard.config.foreign import FEATURES, ROOT_FIELDS
    from zeroshard.config.schema import RootConfig

    assert {f.key for f in FEATURES} == set(ROOT_FIELDS) <= set(RootConfig.model_fields)


@pytest.mark.parametrize("key", ["sparse_attention", "elasticity", "curriculum_learning", "compression_training"])
def test_removed_feature_blocks_are_refused_even_when_disabled_as_deepspeed_does(key):
    """DeepSpeed 0.19.8 raises DeepSpeedConfigError for these keys whatever they hold."""
    with pytest.raises(ConfigError) as info:
        load_config(_with(**{key: {"enabled": False}}), 2)
    assert f"removed key(s) {key!r} (" in str(info.value) and "even when disabled" in str(info.value)


def test_notes_reach_the_start_up_banner(caplog, monkeypatch):
    """The engine logs every config note at start-up with ZEROSHARD_VERBOSE=1 (api/banner.py),
    world size 1; without it, one line with each note's head."""
    import logging

    import torch

    from zeroshard.api.initialize import initialize

    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "_comment": "from a public repo",
           "tensor_parallel": {"autotp_size": 1}, "zero_optimization.reduce_bucket_size": 16,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        initialize(model=torch.nn.Linear(4, 4), config=cfg)
    short = [r.getMessage() for r in caplog.records if "note(s), all with --verbose" in r.getMessage()]
    assert len(short) == 1 and "ignored: " in short[0] and len(short[0]) <= 100, short  # the heads, in 100 columns
    caplog.clear()
    monkeypatch.setenv("ZEROSHARD_VERBOSE", "1")
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        initialize(model=torch.nn.Linear(4, 4), config=cfg)
    text = caplog.text
    assert "note: ignored: unknown top-level key '_comment'" in text
    assert "note: ignored: tensor_parallel (" in text and "note: ignored: dotted top-level key(s)" in text


# ------------------------------------------------------------------ fp16.auto_cast

def test_fp16_auto_cast_casts_forward_inputs_as_deepspeed():
    """DeepSpeed's fp16.auto_cast casts floating forward inputs to fp16 (engine._cast_inputs_half):
    zeroshard's cast_forward_inputs, switched on by it even where the zeroshard block left it out."""
    import torch

    import zeroshard

    assert load_config({"fp16": {"enabled": True, "auto_cast": True}, "zeroshard": {"comm_timeout_s": 9}},
                       1).runtime.cast_forward_inputs
    with pytest.raises(ConfigError, match="fp16.auto_cast = true .* zeroshard.cast_forward_inputs = false"):
        load_config({"fp16": {"enabled": True, "auto_cast": True}, "zeroshard": {"cast_forward_inputs": False}}, 1)

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.seen = []

        def forward(self, x, scale):
            self.seen.append((x.dtype, scale.dtype))
            return self.lin(x).float().sum() * scale.float()

    model = Probe()
    engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                                          "fp16": {"enabled": True, "auto_cast": True},
                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.randn(3, 4), torch.tensor(2.0)))
    engine.step()
    assert model.seen == [(torch.float16, torch.float16)]
    engine.close()


# ------------------------------------------------------------------ data_types.grad_accum_dtype

@pytest.mark.parametrize("cfg", [
    {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}, "zero_optimization": {"stage": 3}},
    {"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "torch.float16"}},
    {"data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 2}},
    {"data_types": {"grad_accum_dtype": "float"}},
])
def test_grad_accum_dtype_of_the_model_loads(cfg):
    """DeepSpeed's default accumulates in the model's dtype, as zeroshard does: the same dtype written
    out changes nothing (LLaMA-Factory's hparam_sweep/ds_z3_e7_gradaccum_bf16.json writes bf16)."""
    settings = load_config(cfg, 2)
    plain = load_config({k: v for k, v in cfg.items() if k != "data_types"}, 2)
    assert _same_policies(settings, plain)


def test_grad_accum_dtype_other_than_the_model():
    bf16_fp32 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(ConfigError, match="at stage 0: DeepSpeed refuses this mix too"):
        load_config(bf16_fp32, 2)  # runtime/engine.py _do_optimizer_sanity_check: NotImplementedError
    bf16_fp16 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}
    for stage in (1, 2, 3):
        assert load_config({**bf16_fp32, "zero_optimization": {"stage": stage}}, 2).precision.grad_accum.value == "fp32"
        with pytest.raises(NotSupportedYetError, match='data_types.grad_accum_dtype = "fp16": not supported yet'):
            load_config({**bf16_fp16, "zero_optimization": {"stage": stage}}, 2)
    with pytest.raises(ConfigError, match="expected fp32, fp16 or bf16"):
        load_config({"data_types": {"grad_accum_dtype": "fp64"}}, 2)


@pytest.mark.parametrize("stage, comm", [(1, None), (1, "fp32"), (2, None), (3, None)])
def test_fp32_grad_accumulation_of_bf16_gradients(stage, comm):
    """grad_accum_dtype "fp32" with bf16 (DeepSpeed: fp32 partition accumulators at stages 2-3, which
    reduce every micro-step; at stage 1 BF16_Optimizer's full fp32 gradient buffer, reduced at the
    boundary in `communication_data_type`, bf16 by default): over 4 micro-steps the gradient shard is
    the fp32 sum of the bf16 micro-gradients, exactly (at stage 1 rounded once to the bf16 of the
    reduction, unless that is fp32); without it, the bf16 running sum (world size 1, so the shard
    is the whole bucket)."""
    import copy

    import torch

    import zeroshard

    gas = 4
    torch.manual_seed(3)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    xs = [torch.randn(2, 16, generator=torch.Generator().manual_seed(m)) for m in range(gas)]
    ref = copy.deepcopy(base).to(torch.bfloat16)
    fp32_sum = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    bf16_sum = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for x in xs:
        ref.zero_grad(set_to_none=True)
        (ref(x.to(torch.bfloat16)).float().pow(2).mean() * (1 / gas)).backward()
        for n, p in ref.named_parameters():
            fp32_sum[n] += p.grad.float()
            bf16_sum[n] += p.grad

    def shards(accum):
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
               "bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": stage}, "zeroshard": {"step_during_backward": False},
               **({"data_types": {"grad_accum_dtype": accum}} if accum else {}),
               **({"communication_data_type": comm} if comm else {})}
        if stage == 3:
            cfg["zeroshard"]["stage3_unit_classes"] = ["Linear"]
        model = copy.deepcopy(base)
        names = {id(p): n for n, p in model.named_parameters()}
        engine = zeroshard.initialize(model, cfg)
        for m, x in enumerate(xs):
            engine.backward(engine(x).float().pow(2).mean())
            if m < gas - 1:
                engine.step()
        out = {}
        for b, bucket in enumerate(engine.buckets):
            shard = engine.grads.grad_shard(b)
            for slot, p in zip(bucket.slots, bucket.params):
                out[names[id(p)]] = shard[slot.offset:slot.end].view(slot.shape).clone()
        engine.step()
        engine.close()
        return out

    with_fp32, plain = shards("fp32"), shards(None)
    assert all(t.dtype == torch.float32 for t in with_fp32.values())
    if stage == 1 and comm is None:  # the boundary's reduction rounds the fp32 sum to bf16 once
        fp32_sum = {n: t.bfloat16().float() for n, t in fp32_sum.items()}
    for n in fp32_sum:
        assert torch.equal(with_fp32[n], fp32_sum[n]), n
        assert torch.equal(plain[n].float(), bf16_sum[n].float()), n
    assert any(not torch.equal(fp32_sum[n], bf16_sum[n].float()) for n in fp32_sum)  # the knob changes something
