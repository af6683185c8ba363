"""Bucket sizes the config left out are chosen for the model (issue 13); written keys are kept."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard
from zeroshard.config import load_config
from zeroshard.config.model_defaults import bucket_elements, choose_for_model


def test_rule_is_ddp_25_mib_and_at_most_a_quarter_of_the_model():
    assert bucket_elements(48_000_000, 4) == 25 * 2**20 // 4  # 6.55M: a 48M fp32 model gets 8 buckets
    assert bucket_elements(48_000_000, 2) == 12_000_000  # bf16: a quarter of the model
    assert bucket_elements(10_000, 4) == 2**18  # tiny models: one bucket, latency rules


def test_silent_keys_are_chosen_and_said_written_ones_are_honoured():
    silent = load_config({"zero_optimization": {"stage": 2}}, 2)
    chosen = choose_for_model(silent, 48_000_000)
    assert chosen.zero.reduce_bucket_size == chosen.zero.allgather_bucket_size == 6_553_600
    assert any("reduce_bucket_size and allgather_bucket_size not set" in n for n in chosen.notes)
    written = load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}, 2)
    kept = choose_for_model(written, 48_000_000)
    assert kept.zero.reduce_bucket_size == 500_000_000 and kept.zero.allgather_bucket_size == 6_553_600


def test_a_silent_config_gives_a_mid_sized_model_several_buckets(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))  # 2.1M parameters
    engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert len(engine.buckets) >= 4  # DeepSpeed's 5e8 default: 1
    engine.close()
