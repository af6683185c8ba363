"""Train a small GPT with zeroshard's public API and a DeepSpeed config, on 1 or N ranks.

    python examples/train_plain.py                                 # one process
    zeroshard launch --nproc 2 examples/train_plain.py --steps 50  # two ranks (torchrun)
    torchrun --nproc-per-node 2 examples/train_plain.py            # the same, by hand

The data are the bytes of this machine's Python standard library; each rank reads its own
rows of every global batch, so N ranks train like one process with N times the batch.
"""

from __future__ import annotations

import argparse
import os

import torch

import zeroshard
from zeroshard.models import batch_iterator, build_gpt
from zeroshard.models.corpus import stdlib_corpus

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(HERE, "ds_config_zero3.json"))
    parser.add_argument("--model", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)  # every rank builds the same initial weights
    model = build_gpt(args.model)
    engine = zeroshard.initialize(model, args.config)  # joins torchrun's process group, if any
    micro = engine.train_micro_batch_size_per_gpu()
    tokens = stdlib_corpus() % model.config.vocab_size
    batches = batch_iterator(tokens, micro, min(args.seq_len, model.config.block_size), engine.rank,
                             engine.world_size)

    losses = []
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(batches)
            _, loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()  # steps the optimizer at the accumulation boundary only
        losses.append(loss.item())
        if engine.rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.3f}, lr {engine.get_lr()[0]:.2e}", flush=True)

    mem, comm = engine.memory_stats(), engine.comm_stats()
    if engine.rank == 0:
        print(f"held per rank (MiB): params {mem['params'] / 2**20:.2f}, grads {mem['grads'] / 2**20:.2f}, "
              f"optimizer states {mem['optimizer_states'] / 2**20:.2f}")
        sent = sum(s["sent_bytes"] for s in comm.values()) / 2**20
        print(f"sent by rank 0 in {args.steps} steps: {sent:.1f} MiB")
        k = max(1, min(10, len(losses) // 2))
        print(f"loss {sum(losses[:k]) / k:.3f} -> {sum(losses[-k:]) / k:.3f}")
    engine.close()


if __name__ == "__main__":
    main()
