"""TRL's GRPOTrainer, unchanged, with a Python reward function (the number of distinct words in a
completion). `--per-forward` sets ds3_gather_for_generation=False; `--beta` > 0 adds TRL's
reference model. With `--zero3` a ZeRO-3 DeepSpeed config, else plain DDP. Rank 0 prints
`RESULT {json}`: the losses, the mean rewards and its completions' texts."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report  # noqa: E402
from trl_common import common_args, llama, sentence, tokenizer  # noqa: E402

COMPLETIONS: list[str] = []


def distinct_words(completions, **kwargs) -> list[float]:
    COMPLETIONS.extend(completions)
    return [float(len(set(c.split()))) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero3", action="store_true")
    p.add_argument("--per-forward", action="store_true")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    # a local folder (each rank its own), so that TRL can build the beta > 0 reference from it
    model = os.path.join(args.out, f"init{os.environ.get('RANK', '0')}")
    llama().save_pretrained(model)
    data = Dataset.from_dict({"prompt": [" ".join(sentence(i).split()[:3]) for i in range(64)]})
    config = GRPOConfig(**common_args(args), num_generations=4, max_completion_length=6, beta=args.beta,
                        ds3_gather_for_generation=not args.per_forward, temperature=1.0)
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_words, args=config, train_dataset=data,
                          processing_class=tokenizer())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        report(losses=[h["loss"] for h in logs], rewards=[h.get("reward") for h in logs], completions=COMPLETIONS)


if __name__ == "__main__":
    main()
