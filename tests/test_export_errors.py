"""Export survives bad input (issue 29, item 5): an OUT that is a file or cannot be made, a
meta.json edited by hand (its checksum is checked on every read: export, inspect, resume),
a truncated shard, and a write that fails half way each give one clear error, exit 2 from
`zeroshard export`, and leave nothing half-written in OUT."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import zeroshard
from zeroshard.checkpoint.reader import resolve
from zeroshard.cli.main import main
from zeroshard.models import build_gpt

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_optimization": {"stage": 1}}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    engine = zeroshard.initialize(build_gpt("tiny"), CFG)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    engine.backward(engine(x, x)[1])
    engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    return engine, tmp_path / "ck"


def _export_error(capsys, *argv) -> str:
    assert main(["export", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeroshard export: ") and "Traceback" not in err, err
    return err


def test_out_that_is_a_file_or_cannot_be_made(saved, capsys, tmp_path):
    _, ck = saved
    (tmp_path / "a_file").write_text("x")
    assert "is a file, not a directory" in _export_error(capsys, ck, tmp_path / "a_file")
    assert "cannot create the export directory" in _export_error(capsys, ck, "/proc/zeroshard-export")


@pytest.mark.parametrize("edit", ["same-size-shape", "other-size-shape"])
def test_an_edited_meta_json_is_refused_on_every_read(saved, capsys, tmp_path, edit):
    engine, ck = saved
    path = os.path.join(resolve(str(ck)), "meta.json")
    meta = json.loads(open(path).read())
    name = "transformer.wte.weight" if "transformer.wte.weight" in meta["tensors"] else next(iter(meta["tensors"]))
    shape = meta["tensors"][name]["shape"]
    meta["tensors"][name]["shape"] = [shape[1], shape[0]] if edit == "same-size-shape" else [shape[0] + 1, shape[1]]
    with open(path, "w") as fh:
        json.dump(meta, fh, indent=1)
    out = tmp_path / "out"
    err = _export_error(capsys, ck, out)
    assert "meta.json" in err and "checksum does not match" in err, err
    assert not out.exists() or os.listdir(out) == []
    assert main(["inspect", str(ck)]) == 2
    assert "checksum does not match" in capsys.readouterr().err
    with pytest.raises(zeroshard.CheckpointError, match="checksum does not match"):
        engine.load_checkpoint(ck)


def test_a_truncated_shard_is_one_line_and_nothing_is_written(saved, capsys, tmp_path):
    _, ck = saved
    tag = resolve(str(ck))
    shard = os.path.join(tag, "rank00000.model.safetensors")
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) // 2)
    out = tmp_path / "out"
    err = _export_error(capsys, ck, out)
    assert "rank00000.model.safetensors" in err, err
    assert not out.exists() or os.listdir(out) == []


def test_a_write_that_fails_half_way_leaves_nothing_in_out(saved, capsys, tmp_path):
    _, ck = saved
    out = tmp_path / "small"
    out.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(out)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        err = _export_error(capsys, ck, out)
        left = os.listdir(out)
    finally:
        subprocess.run(["umount", str(out)], capture_output=True)
    assert "cannot write the export" in err, err
    assert left == [], left  # no model.safetensors.tmp, no staging folder
