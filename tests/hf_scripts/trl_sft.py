"""TRL's SFTTrainer, unchanged: a tiny Llama, a tokenizer built in code, an in-memory dataset.
With `--zero3` a ZeRO-3 DeepSpeed config, else plain DDP. Rank 0 prints `RESULT {json}`: the losses."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report  # noqa: E402
from trl_common import common_args, llama, sentence, tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero3", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model = llama()  # before the config: built whole on every rank, then partitioned by the engine
    data = Dataset.from_dict({"text": [sentence(i) for i in range(64)]})
    config = SFTConfig(**common_args(args), max_length=32, packing=False)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer())
    trainer.train()
    if trainer.is_world_process_zero():
        report(losses=[h["loss"] for h in trainer.state.log_history if "loss" in h])


if __name__ == "__main__":
    main()
