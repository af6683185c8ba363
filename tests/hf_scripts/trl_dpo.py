"""TRL's DPOTrainer, unchanged, with a reference model (TRL prepares it with `prepare_deepspeed`: an
engine without optimizer); `--sync` adds `sync_ref_model=True` (every 2 steps, alpha 0.5: TRL's
GatheredParameters over policy + reference, modifier_rank=0); `--batch` the per-device batch (4; one
process with 8 sees the global batch of 2 ranks x 4). With `--zero3` a ZeRO-3 DeepSpeed
config, else plain DDP. Rank 0 prints `RESULT {json}`: the losses and the chosen rewards."""

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
    p.add_argument("--sync", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)  # per device; 8 in one process = 2 ranks x 4
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = [sentence(i, 10).split() for i in range(64)]
    data = Dataset.from_dict({"prompt": [" ".join(r[:4]) for r in rows],
                              "chosen": [" " + " ".join(r[4:]) for r in rows],
                              "rejected": [" " + " ".join(reversed(r[4:])) for r in rows]})
    config = DPOConfig(**common_args(args), max_length=32, beta=0.1, sync_ref_model=args.sync,
                       ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    trainer = DPOTrainer(model=llama(), ref_model=llama(), args=config, train_dataset=data,
                         processing_class=tokenizer())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        report(losses=[h["loss"] for h in logs], rewards=[h.get("rewards/chosen") for h in logs])


if __name__ == "__main__":
    main()
