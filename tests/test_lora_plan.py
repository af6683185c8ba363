"""`zeroshard estimate/plan --lora` against the engine (issue 14).

A transformers Llama built from a config.json, with peft LoRA adapters (r = 8, peft's
default targets for llama: q_proj, v_proj), trained one AdamW step in bf16 on 2 real
gloo ranks under stages 2 and 3. The estimator, fed only the config.json and `--lora 8`,
must count exactly peft's adapter parameters and give params / grads / optimizer
states per rank within 5% of `memory_stats()`.
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

from zeroshard.estimate import Strategy, estimate_memory, shape_from_hf_config  # noqa: E402
from zeroshard.estimate.lora import add_adapters, lora_from_hf_config, lora_from_module  # noqa: E402

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

WORLD, R, MICRO, SEQ = 2, 8, 2, 16
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64,
         "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False}
BUCKET = 20_000


def lora_model(cfg: dict, r: int = R, targets=None):
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in cfg.items()
                                                                     if k != "model_type"}))
    if targets == ["all-linear"]:
        targets = "all-linear"  # peft takes this one as a string
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets,
                                           task_type="CAUSAL_LM"))


def zero_config(stage: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0)
        cfg["zeroshard"] = {"stage3_unit_classes": ["LlamaDecoderLayer"]}
    return cfg


def _worker(rank: int, world: int):
    import zeroshard

    dist.init_process_group("gloo")
    out = {}
    for stage in (2, 3):
        model = lora_model(LLAMA)
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        engine = zeroshard.initialize(model, zero_config(stage))
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, LLAMA["vocab_size"], (MICRO, SEQ + 1), generator=g)
        logits = engine(input_ids=x[:, :-1]).logits
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)))
        engine.step()
        out[stage] = {"mem": engine.memory_stats(), "adapters": adapters, "total": total}
        engine.close()
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, WORLD, timeout=120)


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return path


def predicted(config_json, stage: int):
    shape = shape_from_hf_config(str(config_json))
    count = lora_from_hf_config(LLAMA, R)
    shape = add_adapters(shape, count.params, count.describe())
    strategy = Strategy(stage=stage, precision="bf16", optimizer="adamw", reduce_bucket_size=BUCKET,
                        allgather_bucket_size=BUCKET)
    return shape, estimate_memory(shape, strategy, WORLD)


def test_lora_count_equals_peft(measured):
    """The analytic count of the config and the meta-device count equal peft's, for the
    default targets, all-linear and an explicit list."""
    r = measured[0][2]
    assert lora_from_hf_config(LLAMA, R).params == r["adapters"]
    assert lora_from_hf_config(LLAMA, R).targets == ("q_proj", "v_proj")  # peft's default for llama
    for targets in (["all-linear"], ["q_proj", "k_proj", "o_proj", "down_proj"]):
        model = lora_model(LLAMA, 4, targets)
        want = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert lora_from_hf_config(LLAMA, 4, targets).params == want, targets
        import transformers
        with torch.device("meta"):  # the base alone: peft's injected lora_A / lora_B are Linear too
            base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **{k: v for k, v in LLAMA.items() if k != "model_type"}))
        assert lora_from_module(base, 4, targets).params == want, targets


def test_shape_totals_equal_the_peft_model(config_json, measured):
    shape, _ = predicted(config_json, 2)
    r = measured[0][2]
    assert shape.params == r["total"] and shape.trainable_params == r["adapters"]


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_estimate_matches_memory_stats(config_json, measured, stage):
    _, est = predicted(config_json, stage)
    for rank in range(WORLD):
        mem = measured[rank][stage]["mem"]
        for cat, want in (("params", est.params), ("grads", est.grads), ("optimizer_states", est.optimizer_states)):
            assert want == pytest.approx(mem[cat], rel=0.05), (stage, rank, cat, want, mem[cat])


def test_frozen_base_costs_only_its_parameters(config_json):
    """Stage 2: the frozen base is whole on every rank (2 bytes each, no gradient, no state);
    stage 3 shards it; the adapters' gradient and optimizer states are all that scale with K."""
    s2, e2 = predicted(config_json, 2)
    _, e3 = predicted(config_json, 3)
    assert e2.params == 2 * s2.frozen_params + 2 * s2.trainable_params
    assert e2.optimizer_states == 12 * -(-s2.trainable_params // WORLD)
    assert e3.params == 2 * (-(-s2.frozen_params // WORLD) + -(-s2.trainable_params // WORLD))


def test_lora_targets_the_model_lacks_is_one_clear_error(config_json, capsys):
    from zeroshard.cli.main import main

    rc = main(["plan", "--hf-config", str(config_json), "--lora", "8", "--lora-targets", "q_proj,c_attn"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "no module named 'c_attn'" in err and "q_proj" in err
    assert main(["plan", "--params", "7B", "--lora-targets", "q_proj"]) == 2
    assert "needs --lora" in capsys.readouterr().err


def test_cli_estimate_lora_json_matches_memory_stats(config_json, measured, capsys):
    """The figures `zeroshard estimate --hf-config config.json --lora 8` prints, per rank."""
    from zeroshard.cli.main import main

    assert main(["estimate", "--hf-config", str(config_json), "--lora", str(R), "--gpus-per-node", str(WORLD),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["trainable"] == measured[0][2]["adapters"]
    by_label = {c["label"]: c["memory"] for c in out["candidates"]}
    for stage in (2, 3):
        est = by_label[f"stage {stage}"]
        for rank in range(WORLD):
            mem = measured[rank][stage]["mem"]
            for cat in ("params", "grads", "optimizer_states"):
                assert est[cat] == pytest.approx(mem[cat], rel=0.05), (stage, rank, cat, est[cat], mem[cat])
