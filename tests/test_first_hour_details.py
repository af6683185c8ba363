"""The small wrong things a new user met (issue 29, item 7), each checked where it is decided."""

from __future__ import annotations

import argparse
import os

import pytest

from zeroshard.config import load_config
from zeroshard.policies import ConfigError


def test_a_device_is_not_called_a_folder():
    from zeroshard.models.text import NoTextError, text_tokens

    with pytest.raises(NoTextError, match="not a regular file or a folder"):
        text_tokens("/dev/zero")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_is_not_a_fractional_part(value):
    with pytest.raises(ConfigError) as err:
        load_config({"train_micro_batch_size_per_gpu": value}, 1)
    assert "fractional" not in str(err.value) and str(value) in str(err.value), err.value


@pytest.mark.parametrize("trainable,rule", [
    (7_168, "the floor of 262,144 elements"),
    (8_000_000, "a quarter of the 8,000,000 trainable parameters"),
    (1_000_000_000, "25 MiB of float32, DDP's bucket cap"),
])
def test_the_bucket_note_says_which_rule_chose_the_size(trainable, rule):
    from zeroshard.config.model_defaults import choose_for_model

    settings = choose_for_model(load_config({"train_micro_batch_size_per_gpu": 1}, 1), trainable)
    note = next(n for n in settings.notes if "reduce_bucket_size" in n)
    assert rule in note, note
    size = settings.zero.reduce_bucket_size
    assert f"{size:,} elements ({rule}" in note


def test_the_benchmark_questions_are_in_english():
    import zeroshard.bench.answers as answers

    text = open(answers.__file__, encoding="utf-8").read()
    assert all(ord(ch) < 0x2E80 for ch in text), "CJK text in an English tool"


def test_small_nvme_sizes_are_not_zero_gib(tmp_path):
    from zeroshard.offload.nvme import check_space

    line = check_space(str(tmp_path), 450_000, 2)
    assert "0.86 MiB" in line and "0.00 GiB" not in line, line


def test_stage3_keys_of_the_embedded_config_are_dropped_at_other_stages():
    from zeroshard.cli.train.args import add_train_arguments
    from zeroshard.cli.train.config import build_config

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    for stage in (1, 2):
        cfg = build_config(p.parse_args(["--stage", str(stage)]), ["Block"])
        assert not [k for k in cfg["zero_optimization"] if k.startswith("stage3_")], cfg
        assert not any("stage3" in n or "stage 3" in n for n in load_config(cfg, 2).notes)
    cfg = build_config(p.parse_args([]), ["Block"])
    assert cfg["zero_optimization"]["stage3_max_reuse_distance"] == 0  # the default run keeps them


def test_tiny_runs_with_the_default_seq_len():
    from zeroshard.cli.train.model import check_model, default_seq_len

    assert default_seq_len("tiny") == 16 and default_seq_len("mini") == 64
    assert check_model("tiny", default_seq_len("tiny"), None) is None
