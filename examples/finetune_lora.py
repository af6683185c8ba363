"""LoRA fine-tuning of a transformers causal LM (peft) under ZeRO stage 3.

    python examples/finetune_lora.py                                 # one process
    python examples/finetune_lora.py --steps 10 --save ckpt          # then: zeroshard export ckpt out --adapter-only
    zeroshard launch --nproc 2 examples/finetune_lora.py --steps 30  # two ranks

The model is a tiny Llama built from a config (nothing is downloaded); for a real one,
load pretrained weights with `AutoModelForCausalLM.from_pretrained(...)` instead. Only
the adapters are trainable, so only they get gradients and optimizer state; stage 3 still
shards the frozen base weights across the ranks and gathers one decoder layer at a time.
Needs `pip install 'zeroshard[hf]'` (transformers, peft).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

import zeroshard
from zeroshard.models import batch_iterator
from zeroshard.models.corpus import stdlib_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--save", metavar="DIR", help="save a checkpoint to DIR at the end (then: zeroshard export DIR OUT --adapter-only)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, use_cache=False)
    base = AutoModelForCausalLM.from_config(config)  # byte-level vocabulary: 256
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            task_type="CAUSAL_LM"))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    engine = zeroshard.initialize(model, {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0},
        "zeroshard": {"stage3_unit_classes": ["LlamaDecoderLayer"]},
    })
    batches = batch_iterator(stdlib_corpus(), 8, args.seq_len, engine.rank, engine.world_size)
    losses = []
    for step in range(args.steps):
        x, y = next(batches)
        logits = engine(input_ids=x.to(engine.device)).logits
        # (x, y) are already shifted by one; `labels=` would shift again
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(engine.device).flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)

    if args.save:
        engine.save_checkpoint(args.save)  # records the peft config: `zeroshard export --adapter-only` needs nothing more
    mem = engine.memory_stats()
    if engine.rank == 0:
        print(f"parameters: {total:,}, trainable (LoRA): {adapters:,}")
        # fp32 training: the fp32 parameter shard is its own master, so Adam holds 8 bytes per
        # trainable element (momentum + variance); a 16-bit run adds a 4-byte fp32 master (12)
        k = 8 if engine.train_state.compute_dtype == torch.float32 else 12
        print(f"held per rank (bytes): params {mem['params']:,} (all {total:,} x 4 / {engine.world_size}, "
              f"sharded), optimizer states {mem['optimizer_states']:,} ({k} x adapters / {engine.world_size})")
        first, last = losses[:5], losses[-5:]  # fewer than 5 when --steps is small
        print(f"loss {sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f}")
    engine.close()


if __name__ == "__main__":
    main()
