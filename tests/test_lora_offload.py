"""`zeroshard train --lora R --offload cpu` (issue 14): at stage 3 the frozen base's shards live
on the host tier, the adapters' masters and optimizer states too, and training is the same
as without offload (bit for bit on this CPU-only machine)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

pytest.importorskip("peft")

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "vocab_size": 64, "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0}


def _args(model: str, offload: str) -> argparse.Namespace:
    return argparse.Namespace(config=None, steps=3, micro_batch=2, stage=None, bf16=False, offload=offload,
                              model=model, lora=4)


def _worker(rank, world, model_spec):
    import zeroshard
    from zeroshard.cli.train.config import build_config
    from zeroshard.cli.train.model import build_model

    dist.init_process_group("gloo")
    out = {}
    for offload in ("cpu", "none"):
        torch.manual_seed(0)
        tm = build_model(model_spec, 4)
        engine = zeroshard.initialize(tm.module, build_config(_args(model_spec, offload), tm.unit_classes))
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            x = torch.randint(0, 64, (4, 16), generator=g)[rank * 2:(rank + 1) * 2]
            engine.backward(tm.loss(engine, x, x))
            engine.step()
        frozen = sum(b.shard().numel() * b.shard().element_size() for b in engine.frozen_buckets)
        out[offload] = {"stats": engine.memory_stats(), "frozen_shard_bytes": frozen,
                        "state": engine.full_state_dict(), "stage": int(engine.settings.zero.stage)}
        engine.close()
    return out


def test_lora_with_offload_puts_the_frozen_base_on_the_host(tmp_path):
    cfg = tmp_path / "llama.json"
    cfg.write_text(json.dumps(LLAMA))
    for r in run_ranks(_worker, 2, f"hf:{cfg}", timeout=300):
        off, plain = r["cpu"], r["none"]
        assert off["stage"] == 3 and off["frozen_shard_bytes"] > 0
        s = off["stats"]
        # host: the frozen base's shards, the adapters' shards and their optimizer states
        assert s["tier_host"] >= off["frozen_shard_bytes"] + s["optimizer_states"]
        assert s["tier_host"] == s["params"] + s["optimizer_states"]
        assert plain["stats"]["tier_host"] == 0 and plain["stats"]["model_states"] == s["model_states"]
        for name, value in plain["state"].items():
            assert torch.equal(off["state"][name], value), name
