"""`zeroshard train` checks the NVMe path's free space in the launcher, before any rank starts
(issue 29, item 3): with too little room it says so in one line; the bound it checks is below
what the ranks need exactly, so the launcher never refuses a run the ranks would accept."""

from __future__ import annotations

from collections import namedtuple

import pytest

from zeroshard.cli.train import prelaunch
from zeroshard.cli.train.model import model_shape
from zeroshard.config import load_config

GiB = 2**30
Usage = namedtuple("Usage", "total used free")


def _settings(path: str, stage: int = 3):
    return load_config({
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage,
                              "offload_optimizer": {"device": "nvme", "nvme_path": path},
                              "offload_param": {"device": "nvme", "nvme_path": path}},
    }, 2)


def _free(monkeypatch, nbytes: int):
    from zeroshard.offload import nvme_disk

    monkeypatch.setattr(nvme_disk.shutil, "disk_usage", lambda p: Usage(10 * GiB, 10 * GiB - nbytes, nbytes))


def test_too_little_room_is_one_line_before_launch(tmp_path, monkeypatch):
    # 150m: at least 151M elements, 2 ranks: 302 MB of fp32 masters per rank, x2 local ranks + 1 GiB slack
    _free(monkeypatch, int(1.2 * GiB))
    problem = prelaunch.check_settings(_settings(str(tmp_path)), "150m", 16, local_ranks=2, world_size=2)
    assert problem and "\n" not in problem
    assert repr(str(tmp_path)) in problem and "local rank(s)" in problem and "free" in problem
    _free(monkeypatch, 2 * GiB)
    assert prelaunch.check_settings(_settings(str(tmp_path)), "150m", 16, local_ranks=2, world_size=2) is None


def test_more_ranks_need_less_each(tmp_path, monkeypatch):
    _free(monkeypatch, int(1.2 * GiB))
    assert prelaunch.check_settings(_settings(str(tmp_path)), "150m", 16, local_ranks=2, world_size=16) is None


@pytest.mark.parametrize("spec", ["tiny", "mini", "small"])
def test_the_bound_is_below_the_models_parameter_count(spec):
    from zeroshard.cli.train.model import build_model

    model = build_model(spec)
    module = getattr(model, "module", model)
    assert prelaunch.lower_bound_params(model_shape(spec)) <= sum(p.numel() for p in module.parameters())

