"""Fuzzed configs: random mutations of real DeepSpeed configs give only zeroshard's clear errors.

Seeds are configs users really have: examples/ds_config_zero3.json, the Hugging Face Trainer's
ds_config_zero2/zero3, DeepSpeed's tutorial configs, and configs written from the tables of
the reference (shared/reference/deepspeed-config.md: offload, aio, checkpoint, monitors...).
Mutations: change a value's type or range (bools, huge/negative/fractional/inf/nan numbers,
strings, "auto", lists, objects, null), add unknown keys (misspelt, non-string, nested), delete
keys, wrap a value in a list or an object, move a block somewhere else; and the same configs as
JSON files, whole, cut short, with a byte changed, a duplicate key or undecodable bytes.
ZS_FUZZ_EXAMPLES=N and ZS_FUZZ_RANDOM=1 search harder by hand (6,000 random examples passed).

What must come out: either Settings, or one zeroshard ConfigError (NotSupportedYetError is
one) whose message names a key of the config; never a TypeError, KeyError, AttributeError,
RecursionError or a pydantic ValidationError from inside. Whatever loads is also handed to
the optimizer and scheduler builders over a dummy parameter, the next place a config value
is read, with the same rule.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroshard.config import load_config
from zeroshard.policies import ConfigError, Settings, ZeroShardError

ROOT = Path(__file__).resolve().parents[1]
# ZS_FUZZ_EXAMPLES=5000 searches harder by hand; CI runs the bounded default.
EXAMPLES = int(os.environ.get("ZS_FUZZ_EXAMPLES", "300"))
DERANDOMIZE = not os.environ.get("ZS_FUZZ_RANDOM")  # CI: the same examples every run

HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **{k: v for k, v in HF_ZERO2.items() if k != "zero_optimization"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
}
DS_MINIMAL = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "fp16": {"enabled": True},
              "zero_optimization": True}
DS_ZERO2_TUTORIAL = {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                           "reduce_scatter": True, "reduce_bucket_size": 5e8,
                                           "allgather_bucket_size": 5e8}}
# From the reference tables: legacy and deprecated forms, offload, aio in both places, the
# blocks DeepSpeed reads loosely, monitors, zeroshard's own block.
REFERENCE_MIX = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
    "bfloat16": {"enabled": True},
    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.1,
                                                      "warmup_num_steps": 10, "total_num_steps": 100}},
    "zero_optimization": {"stage": 1, "cpu_offload": False, "stage3_gather_fp16_weights_on_model_save": False,
                          "aio": {"block_size": 1048576, "thread_count": 2}, "sub_group_size": 1e9,
                          "compute_grad_norm": True, "elastic_checkpoint": False, "leaf_module": {"classes": []}},
    "checkpoint": {"tag_validation": "Warn", "writer": {"type": "fast", "io_buffer_size": 67108864}},
    "activation_checkpointing": {"partition_activations": False, "number_checkpoints": None},
    "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
    "tensorboard": {"enabled": False, "output_path": "runs/"},
    "flops_profiler": {"enabled": False, "profile_step": 1},
    "communication_data_type": "fp32",
    "zeroshard": {"comm_timeout_s": 60, "stage3_unit_classes": ["Block"], "stage3_min_unit_params": 1000},
}
OFFLOAD_NVME = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 10}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme",
                                                        "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4,
                                                "pipeline_read": False, "pipeline_write": False, "ratio": 1.0},
                          "zero_quantized_weights": False, "zero_hpz_partition_size": 1},
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
            "overlap_events": True},
}
SEEDS = [json.loads((ROOT / "examples" / "ds_config_zero3.json").read_text()), HF_ZERO2, HF_ZERO3,
         DS_MINIMAL, DS_ZERO2_TUTORIAL, REFERENCE_MIX, OFFLOAD_NVME]

# Errors that come from inside (what a user must never see).
FORBIDDEN = ("Traceback", "pydantic", "errors.pydantic.dev", "For further information", "object at 0x")

KEY_NAMES = ["stage", "enabled", "lr", "type", "params", "device", "reduce_bucket_size", "zero_optimization",
             "stage3_prefetch_bucket_size", "offload_optimizer", "thread_count", "fp16", "bf16", "aio",
             "ratio", "betas", "total_num_steps", "warmup_num_steps", "loss_scale", "nvme_path", "cpu_offload",
             "bfloat16", "allgather_size", "train_batch_size", "zeroshard", "stage3_unit_classes", "auto",
             "reduce_bucket_sise", "zero_optimisation", "Stage", " stage", "", "__class__", "max_grad_norm",
             "nebula", "mics_shard_size", "leaf_module", "classes", "writer", "comm_timeout_s"]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-3, max_value=5),
    st.sampled_from([0, -1, 2**31, 2**63, 10**30, 5e8, 1e9, 1e300, -0.0, 0.5, 2.5, 1e-12]),
    st.sampled_from([math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from(["auto", "true", "yes", "off", "cpu", "nvme", "none", "fp16", "bf16", "Adam", "AdamW",
                     "WarmupLR", "OneCycle", "1e9", "2.5", "nan", "inf", " 3 ", "", "\x00", "sum", "mean"]),
    st.text(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(KEY_NAMES) | st.text(max_size=4), inner, max_size=3)),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys / list indices) into the config, the root included."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _get(node: Any, path: tuple) -> Any:
    for k in path:
        node = node[k]
    return node


@st.composite
def mutated(draw) -> dict:
    cfg = copy.deepcopy(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(cfg)
        path = draw(st.sampled_from(paths))
        target = _get(cfg, path)
        op = draw(st.sampled_from(["replace", "replace", "replace", "add_key", "delete", "wrap_list",
                                   "wrap_dict", "move", "non_str_key", "auto"]))
        if op == "add_key" and isinstance(target, dict):
            target[draw(st.sampled_from(KEY_NAMES) | st.text(max_size=8))] = draw(values)
        elif op == "non_str_key" and isinstance(target, dict):
            target[draw(st.sampled_from([1, None, 2.5, True, ("a",)]))] = draw(values)
        elif not path:
            continue  # the root stays a dict: load_config's top-level type check is its own test
        else:
            parent, key = _get(cfg, path[:-1]), path[-1]
            if op == "replace":
                parent[key] = draw(values)
            elif op == "auto":
                parent[key] = "auto"
            elif op == "delete":
                del parent[key]
            elif op == "wrap_list":
                parent[key] = [target]
            elif op == "wrap_dict":
                parent[key] = {draw(st.sampled_from(KEY_NAMES)): target}
            elif op == "move":
                dest = _get(cfg, draw(st.sampled_from(paths)))
                if isinstance(dest, dict) and dest is not target:
                    dest[key if isinstance(key, str) else str(key)] = copy.deepcopy(target)
    return cfg


def _key_names(node: Any) -> set[str]:
    names: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            names.add(str(k))
            names.add(repr(k))
            names |= _key_names(v)
    elif isinstance(node, list):
        for v in node:
            names |= _key_names(v)
    return names


def check_config(cfg: dict, world_size: int, hidden_size: int | None) -> Settings | None:
    """load_config(cfg) -> Settings or one clear ConfigError; anything else fails."""
    try:
        result = load_config(cfg, world_size, hidden_size=hidden_size)
    except ConfigError as exc:
        _assert_clear(exc, cfg)
        return None
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"load_config raised {type(exc).__name__}: {exc}\nconfig: {cfg!r}")
    assert isinstance(result, Settings)
    return result


def _assert_clear(exc: ZeroShardError, cfg: dict) -> None:
    msg = str(exc)
    assert msg.strip(), f"empty error message for {cfg!r}"
    for bad in FORBIDDEN:
        assert bad not in msg, f"internal text {bad!r} in the error: {msg}\nconfig: {cfg!r}"
    names = _key_names(cfg) | {"world_size", "train_batch_size", "gradient_accumulation_steps",
                               "train_micro_batch_size_per_gpu"}
    assert any(n and n in msg for n in names), f"the error names no key of the config: {msg}\nconfig: {cfg!r}"


def check_builders(settings_: Settings, cfg: dict) -> None:
    """The optimizer and scheduler specs build over a dummy parameter, or fail with ConfigError."""
    from zeroshard.optim.factory import build_optimizer
    from zeroshard.optim.schedulers import build_scheduler

    param = torch.nn.Parameter(torch.zeros(4))
    try:
        opt = (build_optimizer(settings_.optimizer, [param]) if settings_.optimizer is not None
               else torch.optim.SGD([param], lr=0.1))
        if settings_.scheduler is not None:
            sched = build_scheduler(settings_.scheduler, opt)
            opt.step()
            sched.step()
    except ConfigError as exc:
        _assert_clear(exc, cfg)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"optimizer/scheduler build raised {type(exc).__name__}: {exc}\nconfig: {cfg!r}")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=mutated(), world_size=st.integers(1, 8), hidden_size=st.none() | st.integers(1, 4096))
def test_mutated_configs_give_clear_errors(cfg, world_size, hidden_size):
    check_config(cfg, world_size, hidden_size)


@settings(max_examples=EXAMPLES * 2 // 3, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=mutated(), world_size=st.integers(1, 4))
def test_mutated_configs_that_load_build_their_optimizer_and_scheduler(cfg, world_size):
    result = check_config(cfg, world_size, None)
    if result is not None:
        check_builders(result, cfg)


@settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=mutated(), op=st.sampled_from(["whole", "truncate", "flip", "duplicate", "binary"]),
       where=st.integers(0, 100_000), byte=st.integers(0, 255))
def test_mutated_json_files_give_clear_errors(cfg, op, where, byte):
    """The same configs as DeepSpeed JSON files, some also cut short, with a byte changed, a
    key given twice or undecodable bytes: ConfigError naming the file or a key, nothing else."""
    import tempfile

    data = json.dumps(cfg, skipkeys=True, default=str).encode()
    at = where % (len(data) + 1)
    if op == "truncate":
        data = data[:at]
    elif op == "flip" and data:
        data = data[: at % len(data)] + bytes([byte]) + data[at % len(data) + 1 :]
    elif op == "duplicate":
        data = b'{"train_batch_size": 8, "train_batch_size": 8, ' + data[1:] if len(data) > 2 else data
    elif op == "binary":
        data = b"\xff\xfe" + data
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ds_config.json")
        with open(path, "wb") as f:
            f.write(data)
        try:
            load_config(path, 2)
        except ConfigError as exc:
            msg = str(exc)
            for bad in FORBIDDEN:
                assert bad not in msg, f"internal text {bad!r} in the error: {msg}"
            names = _key_names(cfg) | {"train_batch_size", "world_size"}
            assert "ds_config.json" in msg or any(n and n in msg for n in names), msg
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"load_config(file) raised {type(exc).__name__}: {exc}\ncontents: {data[:300]!r}")


@pytest.mark.parametrize("seed", range(len(SEEDS)))
def test_seeds_load_or_refuse_clearly(seed):
    """The unmutated seeds: each loads, or (offload, NVMe: not built) is one clear refusal."""
    check_config(copy.deepcopy(SEEDS[seed]), 2, 1024)


# Regressions the fuzzer found (kept as plain examples so they run every time).
# Before the fixes each of these gave a TypeError from the optimizer or scheduler build, or an
# error naming a key the user never wrote ('bf16' for 'bfloat16', key 1 for True).
FOUND: list[tuple[dict, str]] = [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": None}}}, "optimizer.params: eps = null"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": None}}}, "weight_decay = null"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [[0.9], 0.95]}}}, "betas = [[0.9], 0.95]"),
    ({"optimizer": {"type": "SGD", "params": {"lr": "fast"}}}, "lr = \"fast\": expected a number"),
    ({"optimizer": {"type": "SGD", "params": {"lr": math.inf}}}, "expected a finite number"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": "maybe"}}}, "amsgrad"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": None}}}, "total_num_steps = null"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_min_lr": {"stage": 0}}}},
     "warmup_min_lr"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "warmup_num_steps = 0"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_type": 3}}},
     "warmup_type = 3"),
    ({"bfloat16": []}, "bfloat16 = []"),
    ({"bfloat16": {"enabled": "x"}}, "bfloat16.enabled"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "x"}},
     "zero_optimization.stage3_prefetch_bucket_size"),
    ({"aio": {"thread_count": -1}}, "aio.thread_count"),
    ({"train_batch_size": 8, True: None}, "key True at top level is not a string"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {None: 1}}},
     "key None in zero_optimization.offload_optimizer is not a string"),
]


@pytest.mark.parametrize("cfg,expected", FOUND, ids=[json.dumps(c, default=str)[:50] for c, _ in FOUND])
def test_found_by_fuzzing(cfg, expected):
    with pytest.raises(ConfigError) as info:
        load_config(copy.deepcopy(cfg), 2)
    _assert_clear(info.value, cfg)
    assert expected in str(info.value)


def test_valid_params_still_reach_the_builders_as_numbers():
    """The type checks coerce what DeepSpeed accepts (strings of numbers, 1e3 for an int)."""
    s = load_config({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3", "betas": [0.9, "0.99"]}},
                     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e3}}}, 2)
    assert s.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.99]}
    assert s.scheduler.params == {"warmup_num_steps": 1000}
    check_builders(s, {})
