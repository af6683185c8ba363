"""Bad input gives a clear error naming the file and the problem; nothing is ever unpickled.

World size 1, in this process: these are properties of the files, not of the ranks.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal

import pytest
import torch

import zeroshard
from zeroshard.checkpoint.format import dumps, seal_meta
from zeroshard.checkpoint import files as ckpt_files
from zeroshard.checkpoint import inspect
from zeroshard.models import FrozenMLP, GPTConfig, build_gpt
from zeroshard.policies import CheckpointError

CFG = {"train_micro_batch_size_per_gpu": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000}}
RANK0 = "rank00000.model.safetensors"


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def gpt(n_embd: int = 32):
    torch.manual_seed(0)
    return build_gpt(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=n_embd))


def trained(steps: int = 2, model=None, cfg=CFG):
    engine = zeroshard.initialize(model or gpt(), cfg)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        engine.backward(engine(x, x)[1])
        engine.step()
    return engine


@pytest.fixture
def saved(tmp_path):
    engine = trained()
    engine.save_checkpoint(tmp_path / "ck", tag="a")
    return engine, tmp_path / "ck", tmp_path / "ck" / "a"


def load_error(path, model=None, **kw) -> str:
    with pytest.raises(CheckpointError) as err:
        zeroshard.initialize(model or gpt(), CFG).load_checkpoint(path, **kw)
    return str(err.value)


def test_truncated_shard(saved):
    _, root, tag = saved
    data = (tag / RANK0).read_bytes()
    (tag / RANK0).write_bytes(data[: len(data) // 2])
    msg = load_error(root)
    assert RANK0 in msg and "truncated" in msg, msg


def test_altered_shard(saved):
    _, root, tag = saved
    data = bytearray((tag / RANK0).read_bytes())
    data[-100] ^= 0x01  # one bit of one parameter
    (tag / RANK0).write_bytes(bytes(data))
    msg = load_error(root)
    assert RANK0 in msg and "sha256" in msg and "altered" in msg, msg


def test_missing_rank_file(saved):
    _, root, tag = saved
    os.remove(tag / RANK0)
    msg = load_error(root)
    assert RANK0 in msg and "missing rank file" in msg, msg


def test_weights_only_load_needs_no_optimizer_file(saved):
    engine, root, tag = saved
    os.remove(tag / "rank00000.optim.safetensors")
    assert "rank00000.optim.safetensors" in load_error(root)
    fresh = zeroshard.initialize(gpt(), CFG)
    fresh.load_checkpoint(root, load_optimizer_states=False)
    assert torch.equal(fresh.full_state_dict()["wte.weight"], engine.full_state_dict()["wte.weight"])
    assert not fresh.optimizer.state


def test_incompatible_model_names(saved):
    _, root, _ = saved
    msg = load_error(root, model=FrozenMLP())
    assert "meta.json" in msg and "does not match the model" in msg and "missing from the checkpoint" in msg, msg


def test_incompatible_model_shapes(saved):
    _, root, _ = saved
    msg = load_error(root, model=gpt(n_embd=48))
    assert "shape differs" in msg and "wte.weight saved (64, 32), model (64, 48)" in msg, msg


def test_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    msg = load_error(tmp_path)
    assert str(tmp_path) in msg and "not a zeroshard checkpoint directory" in msg, msg
    assert "no such checkpoint directory" in load_error(tmp_path / "nowhere")


def test_no_space_left_keeps_the_previous_checkpoint(saved, monkeypatch):
    engine, root, _ = saved
    real = ckpt_files._write
    budget = [50_000]

    def full_disk(f, data):
        budget[0] -= len(data)
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)

    monkeypatch.setattr(ckpt_files, "_write", full_disk)
    with pytest.raises(CheckpointError) as err:
        engine.save_checkpoint(root, tag="b")
    assert "no space left" in str(err.value) and RANK0 in str(err.value), err.value
    monkeypatch.setattr(ckpt_files, "_write", real)
    assert sorted(os.listdir(root)) == ["a", "latest"]  # no partial tag left behind
    assert (root / "latest").read_text() == "a"
    fresh = zeroshard.initialize(gpt(), CFG)
    fresh.load_checkpoint(root)
    assert all(torch.equal(v, engine.full_state_dict()[k]) for k, v in fresh.full_state_dict().items())


@pytest.mark.parametrize("where,latest", [("prepare_tag", "a"), ("name_table_of", "a"), ("rank_file", "a"),
                                          ("all_records", "a"), ("agree", "b")])
def test_a_stop_inside_a_save_leaves_no_partial_tag(saved, monkeypatch, where, latest):
    """A stop signal raises StopRequested (a BaseException) wherever the main thread is, also
    as a collective returns: the save ends with no `.tmp-` tag, and `latest` names the previous
    tag, or the new one if the stop came after the commit (the final `agree`)."""
    from zeroshard.checkpoint import save as save_mod
    from zeroshard.cli.rank_guard import StopRequested

    engine, root, _ = saved
    real = getattr(save_mod, where)

    def stopped(*args, **kw):
        real(*args, **kw)
        raise StopRequested(signal.SIGINT)

    monkeypatch.setattr(save_mod, where, stopped)
    with pytest.raises(StopRequested):
        engine.save_checkpoint(root, tag="b")
    assert sorted(os.listdir(root)) == sorted({"a", latest, "latest"})
    assert (root / "latest").read_text() == latest


class _RunsCode:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_files_are_refused_without_running_them(saved, tmp_path):
    _, root, tag = saved
    marker = tmp_path / "code-ran"
    payload = pickle.dumps({"weights": _RunsCode(str(marker))})
    torch_payload = tmp_path / "evil.pt"
    torch.save({"weights": _RunsCode(str(marker))}, torch_payload)

    (tag / RANK0).write_bytes(payload)  # sizes and checksums no longer match
    assert RANK0 in load_error(root)
    meta = json.loads((tag / "meta.json").read_text())  # a consistent forgery: meta.json agrees too
    for blob in (payload, torch_payload.read_bytes()):
        (tag / RANK0).write_bytes(blob)
        meta["files"][RANK0].update(bytes=len(blob), sha256=ckpt_files.sha256_of(str(tag / RANK0)))
        (tag / "meta.json").write_bytes(dumps(seal_meta(meta)))  # its checksum forged too
        msg = load_error(root)
        assert RANK0 in msg and "not a readable safetensors file" in msg, msg
    (tag / "meta.json").write_bytes(payload)
    msg = load_error(root)
    assert "meta.json" in msg and "not valid JSON" in msg, msg
    assert not marker.exists(), "unpickling ran code"


def test_client_state_must_be_json(saved):
    engine, root, _ = saved
    with pytest.raises(CheckpointError) as err:
        engine.save_checkpoint(root, tag="b", client_state={"sampler": {"order": torch.arange(3)}})
    assert "client_state" in str(err.value) and "sampler.order is a Tensor" in str(err.value), err.value
    assert sorted(os.listdir(root)) == ["a", "latest"]


def test_invalid_tag_and_keep_last(saved):
    engine, root, _ = saved
    with pytest.raises(CheckpointError, match="not a valid checkpoint tag"):
        engine.save_checkpoint(root, tag="../escape")
    with pytest.raises(CheckpointError, match="keep_last"):
        engine.save_checkpoint(root, tag="b", keep_last=0)


def test_keep_last_prunes_old_tags_and_same_tag_overwrites(saved):
    engine, root, _ = saved
    for tag in ("b", "c", "d"):
        engine.save_checkpoint(root, tag=tag, keep_last=2)
    assert sorted(os.listdir(root)) == ["c", "d", "latest"]
    engine.save_checkpoint(root, tag="d", client_state={"again": True})
    assert sorted(os.listdir(root)) == ["c", "d", "latest"]
    assert zeroshard.initialize(gpt(), CFG).load_checkpoint(root) == {"again": True}


def test_other_optimizer_loads_weights_only_when_asked(saved):
    engine, root, _ = saved
    sgd = {**CFG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(CheckpointError, match="optimizer states are for AdamW, the engine runs SGD"):
        zeroshard.initialize(gpt(), sgd).load_checkpoint(root)
    fresh = zeroshard.initialize(gpt(), sgd)
    fresh.load_checkpoint(root, load_optimizer_states=False)
    assert torch.equal(fresh.full_state_dict()["wte.weight"], engine.full_state_dict()["wte.weight"])


def test_frozen_parameters_and_inspect(tmp_path):
    model = FrozenMLP()
    engine = zeroshard.initialize(model, CFG)
    x = torch.randn(2, 16)
    engine.backward(engine(x, torch.randn(2, 8))[1])
    engine.step()
    engine.save_checkpoint(tmp_path, tag="mlp")
    torch.manual_seed(99)
    fresh = zeroshard.initialize(FrozenMLP(), CFG)
    fresh.load_checkpoint(tmp_path)
    want, got = engine.full_state_dict(), fresh.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    report = inspect(tmp_path)
    assert report["ok"] and report["global_steps"] == 1 and report["files"][0]["check"] == "ok"
    assert report["trainable_parameters"] < report["parameters"]
