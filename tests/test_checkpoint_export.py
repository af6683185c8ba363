"""Export: a checkpoint becomes Hugging Face style safetensors with equal logits; the CLI.

The tiny GPT runs in this process (world size 1); the transformers GPT-2 trains on 2
gloo ranks at stages 2 and 3 (one spawn) and loads with `from_pretrained`; the same
spawn writes `save_16bit_model` at stage 3 (bf16) and checks its refusal without the
gather flag.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import zeroshard
from distributed import run_ranks
from zeroshard.cli.main import main
from zeroshard.models import build_gpt

CFG = {"train_micro_batch_size_per_gpu": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000}}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def tiny():
    torch.manual_seed(0)
    return build_gpt("tiny")


@pytest.fixture
def saved(tmp_path):
    engine = zeroshard.initialize(tiny(), CFG)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        engine.backward(engine(x, x)[1])
        engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    return engine, tmp_path


def logits(model, x):
    with torch.no_grad():
        return model(x)[0]


def test_export_single_file_gives_equal_logits(saved):
    engine, tmp = saved
    assert main(["export", str(tmp / "ck"), str(tmp / "out")]) == 0
    assert sorted(os.listdir(tmp / "out")) == ["model.safetensors"]
    exported = load_file(tmp / "out" / "model.safetensors")
    assert "lm_head.weight" in exported and torch.equal(exported["lm_head.weight"], exported["wte.weight"])
    a, b = tiny(), tiny()
    a.load_state_dict(exported)  # strict: every name, tied ones included
    b.load_state_dict(engine.full_state_dict())
    x = torch.randint(0, 64, (3, 16))
    assert torch.equal(logits(a, x), logits(b, x))


def test_export_shards_with_index_and_bf16(saved):
    engine, tmp = saved
    assert main(["export", str(tmp / "ck"), str(tmp / "out"), "--dtype", "bf16", "--max-shard-size", "20KB"]) == 0
    index = json.loads((tmp / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(f for f in os.listdir(tmp / "out") if f.startswith("model-"))
    merged = {}
    for f in shards:
        merged.update(load_file(tmp / "out" / f))
    full = engine.full_state_dict()
    assert set(merged) == set(full) and index["metadata"]["total_size"] == sum(t.nbytes for t in merged.values())
    for name, t in merged.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].to(torch.bfloat16)), name


def test_save_16bit_model_writes_compute_dtype(tmp_path):
    engine = zeroshard.initialize(tiny(), {**CFG, "bf16": {"enabled": True}})
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, x)[1])
    engine.step()
    assert engine.save_16bit_model(tmp_path) == ["model.safetensors"]
    saved = load_file(tmp_path / "model.safetensors")
    for name, t in engine.module.state_dict().items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], t), name


def test_inspect_cli(saved, capsys):
    _, tmp = saved
    assert main(["inspect", str(tmp / "ck")]) == 0
    out = capsys.readouterr().out
    for text in ("step 3", "stage 0", "AdamW", "rank00000.model.safetensors", "rank00000.optim.safetensors",
                 "ok", "lm_head.weight = wte.weight"):
        assert text in out, text
    assert main(["inspect", str(tmp / "ck"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    rank_file = tmp / "ck" / "global_step3" / "rank00000.model.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-8] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    assert main(["inspect", str(tmp / "ck")]) == 1
    assert "sha256 differs" in capsys.readouterr().out.replace("\n", " ").replace("│", "")


@pytest.mark.parametrize("cmd", ["export", "inspect"])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, cmd):
    argv = [cmd, str(tmp_path)] + ([str(tmp_path / "out")] if cmd == "export" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"zeroshard {cmd}: " in err and "not a zeroshard checkpoint directory" in err


# -- transformers GPT-2 ---------------------------------------------------------------------------
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_config(stage: int, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, **zero}}
    if stage == 3:  # GPT2Block units sharded at rest; biases and norms whole
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
        cfg["zeroshard"] = {"stage3_unit_classes": ["GPT2Block"]}
    return cfg


def _train(engine, rank: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def _gpt2_worker(rank, world_size, root):
    import torch.distributed as dist

    from zeroshard.policies import CheckpointError

    dist.init_process_group("gloo")
    out = {}
    for stage in (2, 3):
        engine = zeroshard.initialize(gpt2(), _gpt2_config(stage))
        _train(engine, rank)
        engine.save_checkpoint(f"{root}/s{stage}")
        out[f"full{stage}"] = engine.full_state_dict()
        if stage == 3:
            out["units"] = len(engine.units)
            try:  # stage 3 without stage3_gather_16bit_weights_on_model_save
                engine.save_16bit_model(f"{root}/refused")
                out["refused"] = None
            except CheckpointError as exc:
                out["refused"] = str(exc)
        engine.close()
    engine = zeroshard.initialize(gpt2(), {**_gpt2_config(3, stage3_gather_16bit_weights_on_model_save=True),
                                           "bf16": {"enabled": True}})
    _train(engine, rank, steps=2)
    out["written16"] = engine.save_16bit_model(f"{root}/16bit", max_shard_size="20KB")
    out["full16"] = engine.full_state_dict()
    engine.close()
    return out


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gpt2")
    return run_ranks(_gpt2_worker, 2, str(root), timeout=240), root


@pytest.mark.parametrize("stage", [2, 3])
def test_transformers_gpt2_export_loads_with_from_pretrained(gpt2_runs, stage):
    transformers = pytest.importorskip("transformers")
    results, root = gpt2_runs
    full = results[0][f"full{stage}"]
    if stage == 3:
        assert results[0]["units"] >= 2  # the blocks (and the root's leftovers) sharded at rest
    out = root / f"hf{stage}"
    assert main(["export", str(root / f"s{stage}"), str(out)]) == 0
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    reference = gpt2().eval()
    reference.load_state_dict(full)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, reference(input_ids=x).logits)
    assert not torch.equal(reference.transformer.wte.weight, gpt2().transformer.wte.weight)  # it trained


def test_save_16bit_model_stage3_writes_real_weights(gpt2_runs):
    transformers = pytest.importorskip("transformers")
    results, root = gpt2_runs
    full = results[0]["full16"]
    out = root / "16bit"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert results[0]["written16"] == sorted(set(index["weight_map"].values())) + [
        "model.safetensors.index.json", "config.json"]
    assert results[1]["written16"] == []  # rank 0 writes; the others only gather
    merged = {}
    for f in set(index["weight_map"].values()):
        merged.update(load_file(out / f))
    assert set(merged) == set(full)
    for name, t in merged.items():
        assert t.dtype == torch.bfloat16 and t.shape == full[name].shape, name
        assert torch.equal(t, full[name].to(torch.bfloat16)), name  # real weights, not placeholders
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.transformer.h[1].mlp.c_fc.weight,
                                                          merged["transformer.h.1.mlp.c_fc.weight"])


def test_save_16bit_model_stage3_without_the_flag_refuses(gpt2_runs):
    results, root = gpt2_runs
    for r in results:
        message = r["refused"]
        assert message is not None, "save_16bit_model wrote a stage-3 model without the gather flag"
        assert "stage3_gather_16bit_weights_on_model_save" in message and "zeroshard export" in message
    assert not (root / "refused").exists()  # nothing written, no placeholders
