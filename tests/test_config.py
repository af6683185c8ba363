"""Config layer: bad configs give one clear ConfigError; real users' configs load."""

from __future__ import annotations

import copy
import json

import pytest

from zeroshard.config import load_config
from zeroshard.policies import (
    ConfigError, NotSupportedYetError, OffloadDevice, Precision, Settings, Stage,
)

# Hugging Face Trainer docs, "ds_config_zero2.json" and "ds_config_zero3.json".
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    "fp16": HF_ZERO2["fp16"],
    "optimizer": HF_ZERO2["optimizer"],
    "scheduler": HF_ZERO2["scheduler"],
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# DeepSpeed's getting-started / ZeRO tutorial minimal configs.
DS_MINIMAL = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": True,
}
DS_ZERO2_TUTORIAL = {
    "zero_optimization": {
        "stage": 2,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
}


def _write(tmp_path, data, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=4))
    return path


def _error(cfg, exc=ConfigError, world_size=2, **kw) -> str:
    with pytest.raises(exc) as info:
        load_config(cfg, world_size, **kw)
    return str(info.value)


def _zero2(**zero):
    return {"zero_optimization": {"stage": 2, **zero}}


# ---------------------------------------------------------------- bad configs

def test_unknown_top_level_key_loads_with_a_note_suggesting_the_closest():
    """DeepSpeed ignores unknown top-level keys; zeroshard too, saying so (tests/test_config_keys.py)."""
    notes = [n for n in load_config({"zero_optimisation": {"stage": 2}}, 2).notes if "zero_optimisation" in n]
    assert len(notes) == 1 and "unknown top-level key 'zero_optimisation'" in notes[0]
    assert "did you mean 'zero_optimization'?" in notes[0]


def test_unknown_nested_key_names_block_and_suggests():
    msg = _error(_zero2(reduce_bucket_sise=10))
    assert "unknown key 'reduce_bucket_sise' in zero_optimization" in msg
    assert "did you mean 'reduce_bucket_size'?" in msg


def test_unknown_key_in_offload_block():
    msg = _error(_zero2(offload_optimizer={"device": "none", "pin_memroy": True}))
    assert "zero_optimization.offload_optimizer" in msg and "did you mean 'pin_memory'?" in msg


def test_unknown_key_in_loosely_read_blocks_is_an_error():
    for block, key, want in [("aio", "queue_dept", "queue_depth"),
                             ("checkpoint", "tag_validaton", "tag_validation"),
                             ("activation_checkpointing", "partition_activation", "partition_activations")]:
        msg = _error({block: {key: 1}})
        assert f"unknown key {key!r} in {block}" in msg and f"did you mean {want!r}" in msg


def test_key_in_wrong_block_says_where_it_belongs():
    notes = load_config({"stage": 2}, 2).notes
    assert any("'stage' (it belongs in zero_optimization" in n for n in notes), notes


def test_fp16_keys_in_bf16_are_explained():
    msg = _error({"bf16": {"enabled": True, "loss_scale": 0}})
    assert "unknown key 'loss_scale' in bf16" in msg and "fp16" in msg


def test_stage3_alias_typo_suggests_prefixed_name():
    msg = _error(_zero2(stage3_prefetch_bucket_sise=5))
    assert "did you mean 'stage3_prefetch_bucket_size'?" in msg


def test_wrong_type_for_stage():
    msg = _error({"zero_optimization": {"stage": "two"}})
    assert 'zero_optimization.stage = "two"' in msg and "expected an integer" in msg


@pytest.mark.parametrize("value, words", [(True, "boolean"), (2.5, "fractional"), ("x", "integer")])
def test_wrong_type_for_bucket_size(value, words):
    msg = _error(_zero2(reduce_bucket_size=value))
    assert "zero_optimization.reduce_bucket_size" in msg and words in msg


def test_block_given_as_scalar():
    msg = _error({"fp16": True})
    assert "fp16 = true" in msg and "expected an object" in msg


def test_stage_4():
    msg = _error({"zero_optimization": {"stage": 4}})
    assert "zero_optimization.stage = 4" in msg and "stage must be 0, 1, 2 or 3" in msg


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size"])
@pytest.mark.parametrize("value", [-1, 0, -5e8])
def test_non_positive_bucket_size(key, value):
    msg = _error(_zero2(**{key: value}))
    assert f"zero_optimization.{key}" in msg and "> 0" in msg


def test_inconsistent_batch_sizes_quote_all_numbers():
    msg = _error({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                  "gradient_accumulation_steps": 2}, world_size=2)
    for words in ("inconsistent batch sizes", "train_batch_size = 32", "train_micro_batch_size_per_gpu = 4",
                  "gradient_accumulation_steps = 2", "world_size = 2", "16 != 32"):
        assert words in msg


@pytest.mark.parametrize("cfg, world", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 12, "gradient_accumulation_steps": 5}, 2),
    ({"train_batch_size": 6}, 4),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, 2),
])
def test_non_divisible_batch_sizes(cfg, world):
    msg = _error(cfg, world_size=world)
    assert "do not divide" in msg and f"world_size = {world}" in msg


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_batch_values_must_be_positive_ints(key, value):
    msg = _error({key: value})
    assert key in msg


def test_bad_world_size():
    assert "world_size" in _error({}, world_size=0)


def test_fp16_and_bf16_both_enabled():
    msg = _error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled are both true" in msg


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_nvme_without_path(block):
    msg = _error(_zero2(**{block: {"device": "nvme"}}))
    assert f"zero_optimization.{block}" in msg and "nvme_path" in msg
    assert not isinstance(_exc(_zero2(**{block: {"device": "nvme"}})), NotSupportedYetError)


def _exc(cfg):
    try:
        load_config(cfg, 2)
    except ConfigError as exc:
        return exc
    raise AssertionError("no error")


def test_bad_offload_device():
    msg = _error(_zero2(offload_optimizer={"device": "gpu"}))
    assert 'offload_optimizer.device = "gpu"' in msg and "'none', 'cpu' or 'nvme'" in msg


def test_json_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    msg = _error(path)
    assert "broken.json" in msg and "line 3" in msg and "column" in msg


def test_duplicate_json_key(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    msg = _error(path)
    assert "dup.json" in msg and "duplicate key 'train_batch_size'" in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    msg = _error(str(path))
    assert "not found" in msg and str(path) in msg


def test_top_level_not_an_object(tmp_path):
    assert "JSON object" in _error(_write(tmp_path, [1, 2]))


@pytest.mark.parametrize("cfg, name", [
    ({"amp": {"enabled": True}}, "amp"),
    ({"nebula": {"enabled": False}}, "nebula"),
    ({"sparse_gradients": True}, "sparse_gradients"),
    ({"zero_optimization": {"stage": 2, "mics_shard_size": 8}}, "zero_optimization.mics_shard_size"),
    ({"zero_optimization": {"stage": 2, "zeropp_loco_param": {}}}, "zero_optimization.zeropp_loco_param"),
])
def test_removed_deepspeed_keys(cfg, name):
    msg = _error(cfg)
    assert repr(name) in msg and "DeepSpeed removed them too" in msg


def test_optimizer_type_typos_suggest():
    msg = _error({"optimizer": {"type": "AdamW ", "params": {}}})
    assert 'optimizer.type = "AdamW "' in msg and "did you mean 'adamw'?" in msg
    msg = _error({"optimizer": {"type": "adamm"}})
    assert "unknown optimizer type" in msg and "did you mean 'adam" in msg


def test_scheduler_typo_suggests():
    msg = _error({"scheduler": {"type": "WarmupLr"}})
    assert "unknown scheduler type" in msg and "did you mean 'WarmupLR'?" in msg


def test_max_grad_norm_in_optimizer_params():
    msg = _error({"optimizer": {"type": "adamw", "params": {"max_grad_norm": 1.0}}})
    assert "max_grad_norm" in msg and "gradient_clipping" in msg


def test_compute_grad_norm_false_outside_stages_1_2():
    msg = _error({"zero_optimization": {"stage": 0, "compute_grad_norm": False}})
    assert "zero_optimization.compute_grad_norm = false" in msg and "stage 1 or 2" in msg


def test_partial_offload_needs_stage3():
    msg = _error(_zero2(offload_optimizer={"device": "cpu", "ratio": 0.5}))
    assert "ratio" in msg and "stage 3" in msg


def test_zeroshard_block_is_validated():
    assert "zeroshard.comm_timeout_s = 0" in _error({"zeroshard": {"comm_timeout_s": 0}})
    assert "did you mean 'comm_timeout_s'?" in _error({"zeroshard": {"comm_timeout": 5}})


def test_alias_and_canonical_with_different_values():
    msg = _error(_zero2(stage3_prefetch_bucket_size=1, prefetch_bucket_size=2))
    assert "stage3_prefetch_bucket_size" in msg and "keep one" in msg


def test_several_problems_in_one_error():
    msg = _error({"zero_optimization": {"stage": 2, "foo": 1, "reduce_bucket_size": "x"}, "fp16": {"bar": 2}})
    assert "3 problems" in msg and "'foo'" in msg and "'bar'" in msg and "reduce_bucket_size" in msg


def test_no_pydantic_error_escapes():
    exc = _exc({"zero_optimization": {"stage": "two"}})
    assert type(exc) is ConfigError and exc.__cause__ is None and exc.__suppress_context__


_NSY = [
    (_zero2(zenflow={"topk_ratio": 0.05}), "zero_optimization.zenflow"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states = true"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}, "zero_optimization": {"stage": 1}},
     'data_types.grad_accum_dtype = "fp16"'),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation = false"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing.partition_activations"),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile = true"),
    ({"compile": {"autoep_non_moe": True}}, "compile.autoep_non_moe = true"),
    ({"optimizer": {"type": "MuAdam"}}, 'optimizer.type = "MuAdam"'),
]


@pytest.mark.parametrize("cfg, words", _NSY, ids=[w.split(" =")[0] for _, w in _NSY])
def test_not_supported_yet(cfg, words):
    msg = _error(cfg, NotSupportedYetError)
    assert words in msg and "not supported yet by zeroshard" in msg and "remove it or set it to" in msg


def test_not_supported_yet_lists_every_gap():
    cfg = copy.deepcopy(HF_ZERO3)
    cfg["compile"] = {"deepcompile": True}
    cfg["activation_checkpointing"] = {"partition_activations": True}
    msg = _error(cfg, NotSupportedYetError)
    assert "zero_optimization.stage = 3" not in msg  # stage 3 is built
    assert "compile.deepcompile" in msg and "partition_activations" in msg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_is_built_and_the_aio_block_is_mapped(stage):
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 3}}
    if stage == 3:
        zero["offload_param"] = {"device": "nvme", "nvme_path": "/nvme", "buffer_size": 1000}
    aio = {"block_size": 262144, "queue_depth": 4, "thread_count": 2, "single_submit": True, "overlap_events": False}
    s = load_config({"zero_optimization": zero, "gradient_clipping": 1.0, "aio": aio}, 2)
    assert s.zero.offload_optimizer.device is OffloadDevice.NVME and s.zero.offload_optimizer.buffer_count == 3
    assert s.aio.block_size == 262144 and s.aio.queue_depth == 4 and s.aio.intra_op_parallelism == 2
    assert s.aio.single_submit and not s.aio.overlap_events
    if stage == 3:
        assert s.zero.offload_param.device is OffloadDevice.NVME and s.zero.offload_param.buffer_size == 1000
    assert not any("aio" in n and "unused" in n for n in s.notes)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_offload_is_built(stage):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    s = load_config({"zero_optimization": zero, "gradient_clipping": 1.0}, 2)
    assert s.zero.offload_optimizer.device is OffloadDevice.CPU and s.zero.offload_optimizer.pin_memory
    assert s.zero.offload_param.device is (OffloadDevice.CPU if stage == 3 else OffloadDevice.NONE)


def test_offload_below_the_stage_that_uses_it_is_a_note():
    s = load_config({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}}, 2)
    note = "\n".join(s.notes)
    assert 'offload_optimizer.device = "cpu"' in note and 'offload_param.device = "cpu"' in note
    assert s.zero.offload_optimizer.device is OffloadDevice.NONE


def test_stage3_loads_with_its_knobs():
    s = load_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000,
                                           "stage3_max_reuse_distance": 0},
                     "zeroshard": {"stage3_unit_classes": ["Block"], "stage3_min_unit_params": 10}}, 2)
    assert s.zero.stage is Stage.PARAMETERS
    assert s.zero.stage3.prefetch_bucket_size == 1000 and s.zero.stage3.max_reuse_distance == 0
    assert s.zero.stage3.unit_classes == ("Block",) and s.zero.stage3.min_unit_params == 10


def test_defaults_of_unbuilt_features_are_fine():
    cfg = {"fp16": {"enabled": True, "auto_cast": False}, "prescale_gradients": False,
           "gradient_predivide_factor": 1.0, "gradient_allreduce_op": "mean",
           "managed_gradient_accumulation": True, "data_types": {"grad_accum_dtype": None},
           "torch_autocast": {"enabled": False}, "compile": {"deepcompile": False},
           "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"},
                                 "zero_hpz_partition_size": 1}}
    assert load_config(cfg, 2).zero.stage is Stage.GRADIENTS


def test_fp16_only_features_ignored_when_fp16_disabled():
    s = load_config({"fp16": {"enabled": False, "auto_cast": True}}, 1)
    assert s.precision.compute is Precision.FP32


# ---------------------------------------------------------------- real configs

def test_hf_zero3_with_its_cpu_offload_loads(tmp_path):
    s = load_config(_write(tmp_path, HF_ZERO3), 8, hidden_size=4096)
    assert s.zero.offload_param.device is OffloadDevice.CPU and s.zero.offload_optimizer.device is OffloadDevice.CPU


def test_hf_zero2_with_cpu_offload_loads(tmp_path):
    s = load_config(_write(tmp_path, HF_ZERO2), 8)
    assert s.zero.stage is Stage.GRADIENTS and s.zero.offload_optimizer.device is OffloadDevice.CPU


def test_hf_zero2_without_offload_loads(tmp_path):
    cfg = copy.deepcopy(HF_ZERO2)
    del cfg["zero_optimization"]["offload_optimizer"]
    s = load_config(_write(tmp_path, cfg), 8)
    assert isinstance(s, Settings)
    assert s.zero.stage is Stage.GRADIENTS
    assert s.zero.reduce_bucket_size == 200_000_000 and s.zero.allgather_bucket_size == 200_000_000
    assert isinstance(s.zero.reduce_bucket_size, int)
    assert s.zero.overlap_comm and s.zero.contiguous_gradients and s.zero.reduce_scatter
    assert s.zero.offload_optimizer.device is OffloadDevice.NONE
    assert s.precision.compute is Precision.FP32 and s.precision.loss_scale is None  # fp16 "auto" -> off
    assert s.optimizer.type == "adamw" and dict(s.optimizer.params) == {}
    assert s.scheduler.type == "WarmupLR" and dict(s.scheduler.params) == {}
    assert s.gradient_clipping == 0.0
    assert (s.batch.train_batch_size, s.batch.micro_batch_size, s.batch.gradient_accumulation_steps) == (8, 1, 1)
    assert s.steps_per_print == 2000 and s.wall_clock_breakdown is False
    notes = "\n".join(s.notes)
    assert "gradient_clipping \"auto\" read as 0" in notes
    assert "optimizer.params.lr" in notes and "train_batch_size" in notes
    json.dumps(s.raw)


def test_hf_zero3_variant_at_stage2_loads_with_notes():
    cfg = copy.deepcopy(HF_ZERO3)
    zero = cfg["zero_optimization"]
    zero["stage"] = 2
    del zero["offload_optimizer"], zero["offload_param"]
    s = load_config(cfg, 2, hidden_size=4096)
    assert s.zero.stage is Stage.GRADIENTS
    assert s.zero.reduce_bucket_size == 4096 * 4096
    ignored = [n for n in s.notes if n.startswith("ignored at stage 2")]
    assert len(ignored) == 1
    for key in ("prefetch_bucket_size", "max_live_parameters", "gather_16bit_weights_on_model_save"):
        assert key in ignored[0]
    assert s.zero.stage3.prefetch_bucket_size == 50_000_000  # not effective below stage 3
    assert s.raw["zero_optimization"]["prefetch_bucket_size"] == 15099494


def test_stage3_keys_and_offload_param_at_stage2_are_notes_not_errors():
    s = load_config(_zero2(offload_param={"device": "cpu"}, zero_hpz_partition_size=1,
                           stage3_max_live_parameters=1e9), 2)
    note = next(n for n in s.notes if n.startswith("ignored at stage 2"))
    assert 'offload_param.device = "cpu"' in note and "zero_hpz_partition_size" in note
    assert "max_live_parameters" in note
    assert s.zero.offload_param.device is OffloadDevice.NONE
    assert s.zero.zeropp.quantized_weights is False


def test_zeropp_below_stage3_is_one_error():
    """ZeRO++ switched on below stage 3 (issue 12): one error naming every key and the fix."""
    msg = _error(_zero2(zero_quantized_weights=True, zero_hpz_partition_size=2))
    assert "zero_quantized_weights = true" in msg and "zero_hpz_partition_size = 2" in msg
    assert "stage is 2" in msg and "set stage 3" in msg


def test_deepspeed_minimal_legacy_config():
    s = load_config(DS_MINIMAL, 2)
    assert s.zero.stage is Stage.OPTIMIZER_STATES
    assert s.zero.allgather_bucket_size == 500_000_000
    assert s.optimizer.type == "adam" and s.optimizer.params == {"lr": 0.00015}
    assert s.precision.compute is Precision.FP16 and s.precision.reduce is Precision.FP16
    assert s.precision.loss_scale is not None and s.precision.loss_scale.dynamic
    assert (s.batch.train_batch_size, s.batch.micro_batch_size, s.batch.gradient_accumulation_steps) == (8, 4, 1)
    assert any('legacy "zero_optimization": true' in n for n in s.notes)


def test_legacy_zero_true_takes_allgather_size():
    s = load_config({"zero_optimization": True, "allgather_size": 1e8}, 1)
    assert s.zero.stage is Stage.OPTIMIZER_STATES and s.zero.allgather_bucket_size == 100_000_000
    assert load_config({"zero_optimization": False}, 1).zero.stage is Stage.DATA_PARALLEL


def test_deepspeed_zero2_tutorial_config(tmp_path):
    s = load_config(_write(tmp_path, DS_ZERO2_TUTORIAL), 4)
    assert s.zero.reduce_bucket_size == 500_000_000 and s.zero.allgather_bucket_size == 500_000_000
    assert s.zero.overlap_comm is True


def test_floats_written_5e8_become_ints(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, '
                    '"allgather_bucket_size": 2.5e8, "sub_group_size": 1e9}, "train_batch_size": 1.6e1}')
    s = load_config(path, 2)
    assert s.zero.reduce_bucket_size == 500_000_000 and type(s.zero.reduce_bucket_size) is int
    assert s.zero.allgather_bucket_size == 250_000_000 and s.zero.sub_group_size == 1_000_000_000
    assert s.batch.train_batch_size == 16 and type(s.batch.train_batch_size) is int


def test_bfloat16_legacy_name():
    s = load_config({"bfloat16": {"enabled": True}}, 1)
    assert s.precision.compute is Precision.BF16 and s.precision.reduce is Precision.BF16
    assert "bf16" in s.raw and "bfloat16" not in s.raw
    assert any("bfloat16" in n for n in s.notes)
    assert "keep 'bf16'" in _error({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


@pytest.mark.parametrize("prefixed", [True, False])
def test_stage3_aliases_both_ways(prefixed):
    keys = {"prefetch_bucket_size": 123, "param_persistence_threshold": 456, "model_persistence_threshold": 7,
            "max_live_parameters": 8, "max_reuse_distance": 9, "gather_16bit_weights_on_model_save": True,
            "module_granularity_threshold": 10, "use_all_reduce_for_fetch_params": True,
            "allgather_sequential": True}
    zero = {("stage3_" + k if prefixed else k): v for k, v in keys.items()}
    # Loaded at stage 2 (stage 3 is not built): the values land in raw under the canonical names.
    s = load_config({"zero_optimization": {"stage": 2, **zero}}, 1)
    assert {k: s.raw["zero_optimization"][k] for k in keys} == keys
    from zeroshard.config.build import zero_policy
    from zeroshard.config.schema import RootConfig
    from zeroshard.config.normalize import normalize
    data, _ = normalize({"zero_optimization": {"stage": 3, **zero, "leaf_module": {"classes": ["Block"]}}}, None)
    validated = RootConfig.model_validate(data).zero
    s3 = zero_policy(validated).stage3
    assert (s3.prefetch_bucket_size, s3.param_persistence_threshold, s3.max_live_parameters) == (123, 456, 8)
    assert s3.gather_16bit_weights_on_model_save and s3.unit_classes == ("Block",)
    # accepted and validated, not acted on (no policy field): DeepSpeed's tuning knobs
    assert (validated.module_granularity_threshold, validated.use_all_reduce_for_fetch_params,
            validated.allgather_sequential) == (10, True, True)


def test_deprecated_zero_keys_are_mapped_with_notes():
    s = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False,
                                           "stage3_gather_fp16_weights_on_model_save": True,
                                           "cpu_offload_use_pin_memory": True}}, 1)
    assert s.raw["zero_optimization"]["gather_16bit_weights_on_model_save"] is True
    assert "cpu_offload" not in s.raw["zero_optimization"]
    notes = "\n".join(s.notes)
    assert "cpu_offload is deprecated" in notes and "stage3_gather_fp16_weights_on_model_save is deprecated" in notes
    s = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}, 1)
    assert s.zero.offload_optimizer.device is OffloadDevice.CPU


def test_aio_nested_in_zero_optimization_with_thread_count():
    s = load_config({"zero_optimization": {"stage": 2, "aio": {"block_size": 262144, "thread_count": 2}}}, 1)
    assert s.raw["aio"] == {"block_size": 262144, "intra_op_parallelism": 2}
    assert "aio" not in s.raw["zero_optimization"]
    notes = "\n".join(s.notes)
    assert "zero_optimization.aio moved" in notes and "thread_count is the old name" in notes
    assert "intra_op_parallelism = 2" in notes


def test_top_level_aio_thread_count_conflict():
    msg = _error({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})
    assert "thread_count" in msg and "intra_op_parallelism" in msg


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("given, expect", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, lambda w: (64, 4, 64 // (4 * w))),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, lambda w: (64, 64 // (2 * w), 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, lambda w: (8 * w, 4, 2)),
    ({"train_batch_size": 64}, lambda w: (64, 64 // w, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, lambda w: (3 * w, 3, 1)),
    ({}, lambda w: (w, 1, 1)),
    ({"gradient_accumulation_steps": 4}, lambda w: (4 * w, 1, 4)),
])
def test_batch_arithmetic(world, given, expect):
    b = load_config(given, world).batch
    assert (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps) == expect(world)
    assert b.train_batch_size == b.micro_batch_size * b.gradient_accumulation_steps * world


@pytest.mark.parametrize("world", [1, 2, 8])
def test_batch_all_three_consistent(world):
    b = load_config({"train_batch_size": 16 * world, "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": 4}, world).batch
    assert (b.micro_batch_size, b.gradient_accumulation_steps) == (4, 4)


def test_hidden_size_auto_heuristics():
    cfg = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    s = load_config(cfg, 1, hidden_size=4096)
    assert s.zero.reduce_bucket_size == 16777216
    zero_raw = s.raw["zero_optimization"]
    assert zero_raw["prefetch_bucket_size"] == 15099494
    assert zero_raw["param_persistence_threshold"] == 40960
    assert any("hidden_size 4096" in n for n in s.notes)


def test_auto_without_hidden_size_uses_deepspeed_defaults():
    s = load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, 1)
    assert s.zero.reduce_bucket_size == 500_000_000
    assert "reduce_bucket_size" not in s.raw["zero_optimization"]
    assert any("pass hidden_size" in n for n in s.notes)


def test_auto_for_precision_and_clipping():
    s = load_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"}, 1)
    assert s.precision.compute is Precision.FP32 and s.gradient_clipping == 0.0


def test_auto_on_unknown_key_is_still_named():
    assert any("did you mean 'train_batch_size'" in n for n in load_config({"train_batch_sise": "auto"}, 2).notes)
    assert "did you mean 'enabled'" in _error({"fp16": {"enabeld": "auto"}})


def test_gradient_clipping():
    s = load_config({"gradient_clipping": 1.0}, 1)
    assert s.gradient_clipping == 1.0 and not any("gradient_clipping" in n for n in s.notes)
    s = load_config({}, 1)
    assert s.gradient_clipping == 0.0
    assert any("gradient_clipping not set" in n and "1.0" in n for n in s.notes)
    assert load_config({"gradient_clipping": 0}, 1).gradient_clipping == 0.0
    assert "gradient_clipping = -1" in _error({"gradient_clipping": -1})


def test_fp16_loss_scale_policy_and_communication_dtype():
    s = load_config({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 12,
                              "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": True,
                              "min_loss_scale": 0.5}, "communication_data_type": "fp32"}, 1)
    p = s.precision
    assert p.compute is Precision.FP16 and p.reduce is Precision.FP32
    assert p.master is Precision.FP32 and p.optimizer_states is Precision.FP32
    ls = p.loss_scale
    assert (ls.static_scale, ls.initial_scale_power, ls.loss_scale_window, ls.hysteresis,
            ls.consecutive_hysteresis, ls.min_loss_scale) == (128.0, 12, 500, 3, True, 0.5)
    assert not ls.dynamic
    s = load_config({"bf16": {"enabled": True}, "communication_data_type": "fp32"}, 1)
    assert s.precision.reduce is Precision.FP32 and s.precision.loss_scale is None
    assert load_config({"communication_data_type": "bf16"}, 1).precision.reduce is Precision.BF16
    assert "communication_data_type" in _error({"communication_data_type": "int8"})


def test_overlap_comm_defaults_to_true_with_note():
    s = load_config({"zero_optimization": {"stage": 1}}, 1)
    assert s.zero.overlap_comm is True and any("overlap_comm not set" in n for n in s.notes)
    assert load_config(_zero2(overlap_comm=False), 1).zero.overlap_comm is False


def test_compute_grad_norm_false_at_stage2():
    s = load_config(_zero2(compute_grad_norm=False), 1)
    assert s.zero.compute_grad_norm is False


def test_optimizer_and_scheduler_specs():
    s = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": "auto"}},
                     "scheduler": {"type": "WarmupDecayLR",
                                   "params": {"warmup_num_steps": 100, "total_num_steps": "auto"}}}, 1)
    assert s.optimizer.type == "adamw" and dict(s.optimizer.params) == {"lr": 3e-4, "betas": [0.9, 0.95]}
    assert s.scheduler.type == "WarmupDecayLR" and dict(s.scheduler.params) == {"warmup_num_steps": 100}
    for name in ("SGD", "Adagrad", "adam"):
        assert load_config({"optimizer": {"type": name}}, 1).optimizer.type == name.lower()


def test_comms_logger_runtime_and_pass_through():
    s = load_config({"comms_logger": {"enabled": True, "verbose": True, "prof_all": False,
                                      "prof_ops": ["all_reduce"]},
                     "zeroshard": {"comm_timeout_s": 30, "cast_forward_inputs": False},
                     "steps_per_print": 10, "wall_clock_breakdown": True}, 1)
    # only `enabled` acts; the rest of DeepSpeed's block is accepted and kept in raw
    assert s.comms_logger.enabled is True
    assert s.raw["comms_logger"] == {"enabled": True, "verbose": True, "prof_all": False, "prof_ops": ["all_reduce"]}
    assert s.runtime.comm_timeout_s == 30.0 and s.runtime.cast_forward_inputs is False
    assert s.steps_per_print == 10 and s.wall_clock_breakdown is True


def test_monitors_and_profilers_are_accepted_with_notes():
    s = load_config({"tensorboard": {"enabled": True, "output_path": "/tmp/tb", "job_name": "x"},
                     "wandb": {"enabled": False, "project": "p"},
                     "flops_profiler": {"enabled": True, "profile_step": 2},
                     "memory_breakdown": True, "log_level": "info",
                     "checkpoint": {"load_universal": True},
                     "activation_checkpointing": {"contiguous_memory_optimization": True,
                                                  "number_checkpoints": 4}}, 1)
    notes = "\n".join(s.notes)
    for words in ("memory_breakdown", "log_level", "checkpoint:", "activation_checkpointing:"):
        assert words in notes
    assert "wandb" not in notes and "tensorboard" not in notes and "flops" not in notes  # they act (test_monitors.py)
    assert s.monitors == (("tensorboard", (("enabled", True), ("output_path", "/tmp/tb"), ("job_name", "x"))),)


def test_offload_none_blocks_map_to_defaults():
    s = load_config(_zero2(offload_optimizer={"device": "none", "pin_memory": False, "buffer_count": 8}), 1)
    off = s.zero.offload_optimizer
    assert off.device is OffloadDevice.NONE and off.pin_memory is False and off.buffer_count == 8
    assert s.zero.offload_param.buffer_count == 5


def test_input_dict_is_not_mutated():
    cfg = copy.deepcopy(HF_ZERO3)
    cfg["zero_optimization"]["stage"] = 2
    del cfg["zero_optimization"]["offload_optimizer"], cfg["zero_optimization"]["offload_param"]
    before = copy.deepcopy(cfg)
    load_config(cfg, 2, hidden_size=1024)
    assert cfg == before


def test_settings_raw_is_json_and_holds_resolved_batch(tmp_path):
    s = load_config(_write(tmp_path, {"train_batch_size": 32, "zero_optimization": {"stage": 1}}), 4)
    assert json.loads(json.dumps(s.raw)) == {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
                                             "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1}}


def test_config_layer_imports_only_policies_and_no_torch():
    import ast
    import pathlib

    import zeroshard.config as pkg
    for file in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("torch"), (file.name, name)
                if name.startswith("zeroshard"):
                    assert name == "zeroshard.policies" or name.startswith("zeroshard.config"), (file.name, name)


def test_block_at_wrong_level_says_where_it_belongs():
    notes = load_config({"offload_optimizer": {"device": "cpu"}}, 2).notes
    assert any("'offload_optimizer' (it belongs in zero_optimization" in n for n in notes), notes
    msg = _error({"zero_optimization": {"stage": 2, "train_batch_size": 8}})
    assert "belongs in the top level" in msg


def test_non_string_key():
    assert "key 1 at top level is not a string" in _error({1: 2})


def test_a_key_left_out_gets_its_policy_default():
    """Each knob's default is declared once, on its policy: a config that leaves a block or a
    key out runs on exactly the policy's default (and the estimator prices the same one)."""
    import dataclasses

    from zeroshard.policies import (
        ActivationOffloadPolicy, AioPolicy, CommsLoggerPolicy, LossScalePolicy, OffloadDevice, RuntimePolicy,
        Stage, Stage3Policy, ZeroPolicy,
    )

    s = load_config({"train_batch_size": 1}, 1)
    assert s.zero == ZeroPolicy() and s.aio == AioPolicy() and s.runtime == RuntimePolicy()
    assert s.comms_logger == CommsLoggerPolicy() and s.activations == ActivationOffloadPolicy()
    s = load_config({"train_batch_size": 1, "fp16": {"enabled": True}, "aio": {}, "zeroshard": {},
                     "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}}, 1)
    default = ZeroPolicy()
    assert s.zero == dataclasses.replace(
        default, stage=Stage.PARAMETERS,
        offload_optimizer=dataclasses.replace(default.offload_optimizer, device=OffloadDevice.CPU),
        offload_param=dataclasses.replace(default.offload_param, device=OffloadDevice.CPU))
    assert s.zero.stage3 == Stage3Policy() and s.zero.offload_param.buffer_count == 5
    assert s.precision.loss_scale == LossScalePolicy() and s.aio == AioPolicy() and s.runtime == RuntimePolicy()

    from zeroshard.estimate import Strategy

    est = Strategy()
    assert (est.reduce_bucket_size, est.allgather_bucket_size, est.overlap_comm, est.compute_grad_norm,
            est.sub_group_size, est.hpz_partition_size, est.offload_ratio) == (
        default.reduce_bucket_size, default.allgather_bucket_size, default.overlap_comm, default.compute_grad_norm,
        default.sub_group_size, default.zeropp.hpz_partition_size, default.offload_optimizer.ratio)
    assert (est.prefetch_bucket_size, est.max_live_parameters) == (
        default.stage3.prefetch_bucket_size, default.stage3.max_live_parameters)
    assert (est.optimizer_buffer_count, est.param_buffer_count, est.param_buffer_size, est.activation_buffer_count) == (
        default.offload_optimizer.buffer_count, default.offload_param.buffer_count, default.offload_param.buffer_size,
        ActivationOffloadPolicy().buffer_count)
