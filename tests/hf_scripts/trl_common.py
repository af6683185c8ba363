"""What the TRL scripts share: a tiny Llama built from a LlamaConfig, a word-level tokenizer built
in code, in-memory datasets, and the ZeRO-3 DeepSpeed config. Nothing is downloaded."""

from __future__ import annotations

WORDS = [f"w{i}" for i in range(60)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    return LlamaForCausalLM(config)


def sentence(i: int, n: int = 8) -> str:
    start, stride = (7 * i) % len(WORDS), 1 + i % 4
    return " ".join(WORDS[(start + stride * k) % len(WORDS)] for k in range(n))


def ds_config() -> dict:
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 4096,
                                  "stage3_param_persistence_threshold": 0}}


def common_args(args) -> dict:
    import torch

    return dict(output_dir=args.out, per_device_train_batch_size=getattr(args, "batch", 4), max_steps=args.steps,
                learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
                save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
                deepspeed=ds_config() if args.zero3 else None, use_cpu=not torch.cuda.is_available(),
                bf16=False)  # fp32: TRL's configs default to bf16=True (bf16 weights at ZeRO-3, autocast under DDP)
