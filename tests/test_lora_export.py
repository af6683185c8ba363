"""`zeroshard export --adapter-only` / `--exclude-frozen` and `save_adapter` (issue 14).

A transformers Llama with peft LoRA adapters (r = 4 on q_proj, v_proj, lora_alpha 8) is
trained 3 AdamW steps in fp32 on 2 real gloo ranks under stages 2 and 3 and saved. The
adapter exported from the checkpoint, loaded with `PeftModel.from_pretrained` onto a base
built from the same config and seed, gives the trained model's logits within 1e-5; the
adapter file holds the adapter tensors and nothing else; the export reads only the
trainable buckets' fp32 masters (never a frozen shard), one tensor at a time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from distributed import run_ranks  # noqa: E402

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

WORLD, R, ALPHA, MICRO, SEQ, STEPS, SEED = 2, 4, 8, 2, 16, 3, 1234
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % LLAMA["vocab_size"]


def base_model():
    import transformers

    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base_model(), LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B starts at zero in peft; nonzero B gives A a gradient from step 1
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def zero_config(stage: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000, "allgather_bucket_size": 4000}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0)
        cfg["zeroshard"] = {"stage3_unit_classes": ["LlamaDecoderLayer"]}
    return cfg


def train(engine, rank: int, steps: int):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, LLAMA["vocab_size"], (MICRO, SEQ + 1), generator=g)
        logits = engine(input_ids=x[:, :-1]).logits
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)))
        engine.step()


def _worker(rank: int, world: int, root: str):
    import zeroshard
    from zeroshard.checkpoint.adapter import save_adapter

    dist.init_process_group("gloo")
    out = {}
    for stage in (2, 3):
        engine = zeroshard.initialize(lora_model(), zero_config(stage))
        train(engine, rank, STEPS)
        engine.save_checkpoint(f"{root}/ckpt-z{stage}")
        engine.save_adapter(f"{root}/online-z{stage}")  # the Engine method over checkpoint.adapter
        with torch.no_grad():
            out[stage] = engine(input_ids=PROBE).logits.float()
        engine.close()
    engine = zeroshard.initialize(base_model(), zero_config(2))  # full fine-tuning: no adapters
    train(engine, rank, 1)
    engine.save_checkpoint(f"{root}/ckpt-full")
    engine.close()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-export")
    logits = run_ranks(_worker, WORLD, str(root), timeout=150)
    return root, logits[0]


def peft_logits(adapter_dir) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(base_model(), str(adapter_dir))
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits.float()


def export_cli(*argv) -> tuple[int, str]:
    from zeroshard.cli.main import main

    return main(["export", *map(str, argv)]), ""


def adapter_count() -> tuple[int, set[str]]:
    model = lora_model()
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return sum(p.numel() for p in model.parameters() if p.requires_grad), names


@pytest.mark.parametrize("stage", [2, 3])
def test_adapter_only_export_loads_with_peft_and_gives_the_trained_logits(trained, tmp_path, stage, capsys):
    root, logits = trained
    out = tmp_path / "adapter"
    from zeroshard.cli.main import main

    assert main(["export", f"{root}/ckpt-z{stage}", str(out), "--adapter-only", "--lora-alpha", str(ALPHA)]) == 0
    assert "adapter_model.safetensors, adapter_config.json" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    got = peft_logits(out)
    want = logits[stage]
    assert (got - want).abs().max().item() <= 1e-5, (got - want).abs().max().item()
    untrained = peft_logits_of(lora_model())
    assert (untrained - want).abs().max().item() > 1e-3  # training moved the adapters: the check has teeth


def peft_logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits.float()


@pytest.mark.parametrize("stage", [2, 3])
def test_adapter_file_holds_only_the_adapter_tensors(trained, tmp_path, stage):
    from safetensors import safe_open

    from zeroshard.checkpoint.adapter import export_adapter

    root, _ = trained
    export_adapter(f"{root}/ckpt-z{stage}", tmp_path, lora_alpha=ALPHA)
    numel, names = adapter_count()
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        total = sum(f.get_tensor(k).numel() for k in keys)
    assert keys == {n.replace(".default.", ".") for n in names}  # peft's keys: adapter name removed
    assert total == numel and all(".lora_A." in k or ".lora_B." in k for k in keys)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == R and cfg["lora_alpha"] == ALPHA and sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]


def test_export_reads_only_trainable_masters_one_tensor_at_a_time(trained, tmp_path, monkeypatch):
    """No frozen shard (stage-3 'value' buckets, module.* entries) is read; the largest read
    is one adapter tensor, within one trainable bucket."""
    from zeroshard.checkpoint.adapter import export_adapter
    from zeroshard.checkpoint.reader import CheckpointReader

    root, _ = trained
    reads: list[tuple[str, int]] = []
    slice_, get = CheckpointReader._slice, CheckpointReader._get

    def spy_slice(self, file, key, lo, hi):
        reads.append((key, hi - lo))
        return slice_(self, file, key, lo, hi)

    def spy_get(self, file, key):
        t = get(self, file, key)
        reads.append((key, t.numel()))
        return t

    monkeypatch.setattr(CheckpointReader, "_slice", spy_slice)
    monkeypatch.setattr(CheckpointReader, "_get", spy_get)
    export_adapter(f"{root}/ckpt-z3", tmp_path, lora_alpha=ALPHA)
    meta = json.loads(next((root / "ckpt-z3").glob("global_step*/meta.json")).read_text())
    trainable = [b for b in meta["buckets"] if "master" in b["fields"]]
    assert len(trainable) < len(meta["buckets"])  # stage 3 has frozen buckets too, never read
    allowed = {f"bucket{b['index']}.master" for b in trainable}
    assert reads and {k for k, _ in reads} <= allowed, {k for k, _ in reads} - allowed
    largest_tensor = max(n for n, _ in [(p.numel(), 0) for p in lora_model().parameters() if p.requires_grad])
    assert max(n for _, n in reads) <= largest_tensor <= max(b["padded_numel"] for b in trainable)


def _without_peft_meta(root, tmp_path):
    """A copy of the stage-2 checkpoint as an older save wrote it: no peft config recorded."""
    import shutil

    from zeroshard.checkpoint.adapter import PEFT_META_KEY

    copy = tmp_path / "old-ckpt"
    shutil.copytree(next((root / "ckpt-z2").glob("global_step*")), copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta.pop(PEFT_META_KEY)
    meta.pop("meta_sha256", None)  # a checkpoint that old had no checksum either
    (copy / "meta.json").write_text(json.dumps(meta))
    return copy


def test_recorded_peft_config_needs_no_alpha(trained, tmp_path):
    """save_checkpoint records the peft config (`peft_meta`, under PEFT_META_KEY) in meta.json,
    so the export needs no --lora-alpha."""
    from zeroshard.checkpoint.adapter import PEFT_META_KEY, export_adapter

    root, logits = trained
    meta = json.loads(next((root / "ckpt-z2").glob("global_step*")).joinpath("meta.json").read_text())
    assert meta[PEFT_META_KEY]["config"]["lora_alpha"] == ALPHA
    export_adapter(root / "ckpt-z2", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["lora_alpha"] == ALPHA and cfg["peft_type"] == "LORA"
    assert (peft_logits(tmp_path / "out") - logits[2]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("stage", [2, 3])
def test_online_save_adapter_gives_the_trained_logits(trained, stage):
    root, logits = trained
    got = peft_logits(root / f"online-z{stage}")
    assert (got - logits[stage]).abs().max().item() <= 1e-5


def test_exclude_frozen_writes_the_trainable_tensors_in_the_full_format(trained, tmp_path, capsys):
    from safetensors import safe_open

    from zeroshard.cli.main import main

    root, _ = trained
    assert main(["export", f"{root}/ckpt-z3", str(tmp_path), "--exclude-frozen"]) == 0
    _, names = adapter_count()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no config.json: not a whole model
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == names


def test_adapter_only_on_a_checkpoint_without_adapters_is_one_clear_error(trained, tmp_path, capsys):
    from zeroshard.cli.main import main

    root, _ = trained
    assert main(["export", f"{root}/ckpt-full", str(tmp_path / "x"), "--adapter-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--adapter-only needs a checkpoint of a model with peft LoRA adapters" in err
    assert not (tmp_path / "x").exists()
    # a LoRA checkpoint that does not record lora_alpha: says what to pass
    assert main(["export", str(_without_peft_meta(root, tmp_path)), str(tmp_path / "y"), "--adapter-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lora-alpha" in err
