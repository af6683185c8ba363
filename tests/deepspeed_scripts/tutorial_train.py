"""A training script written the way DeepSpeed's getting-started tutorial writes one.

The tests run a copy of it in which only the `import deepspeed` line is changed (to
`import zeroshard.deepspeed as deepspeed`), on 2 ranks with `zeroshard launch`:

    zeroshard launch --nproc 2 tutorial_train.py --deepspeed --deepspeed_config ds_config.json

Each rank prints one line `RESULT {json}` with what the engine reported.
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="tiny regression, DeepSpeed tutorial style")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=6, help="micro-batches to train on in all")
    parser.add_argument("--save_dir", default="checkpoints")
    parser.add_argument("--save_interval", type=int, default=3, help="save a checkpoint every this many steps")
    parser.add_argument("--load_dir", default=None, help="resume from this checkpoint directory")
    parser.add_argument("--ckpt_id", default=None, help="the tag to resume from (default: latest)")
    parser.add_argument("--out", default=None, help="save the final weights here (save_16bit_model)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_trainset():
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))


def main():
    args = add_argument()
    deepspeed.init_distributed()

    torch.manual_seed(0)
    net = Net()
    trainset = make_trainset()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    start = 0
    if args.load_dir:
        _, client_sd = model_engine.load_checkpoint(args.load_dir, args.ckpt_id)
        start = client_sd["step"]

    step = start
    for i, (inputs, labels) in enumerate(trainloader):
        if i < start:
            continue  # trained on before the checkpoint
        if step == args.steps:
            break
        inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
        outputs = model_engine(inputs)
        loss = F.mse_loss(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        step += 1
        if step % args.save_interval == 0 and step < args.steps:
            model_engine.save_checkpoint(args.save_dir, f"step{step}", client_state={"step": step})

    applied = model_engine.was_step_applied()
    client_sd = {"step": step, "note": "tutorial"}
    ckpt_id = f"step{step}"
    model_engine.save_checkpoint(args.save_dir, ckpt_id, client_state=client_sd)
    load_path, loaded_sd = model_engine.load_checkpoint(args.save_dir, ckpt_id)
    if args.out:
        model_engine.save_16bit_model(args.out)

    print("RESULT " + json.dumps({
        "rank": model_engine.global_rank, "local_rank": model_engine.local_rank,
        "world_size": model_engine.world_size, "stage": model_engine.zero_optimization_stage(),
        "micro": model_engine.train_micro_batch_size_per_gpu(), "batch": model_engine.train_batch_size(),
        "gas": model_engine.gradient_accumulation_steps(), "lr": model_engine.get_lr(), "applied": applied,
        "steps": model_engine.global_steps, "fp16": model_engine.fp16_enabled(),
        "bf16": model_engine.bfloat16_enabled(), "load_path": load_path, "client_sd": loaded_sd,
        "optimizer": type(optimizer).__name__, "loader_batches": len(trainloader),
        "rank_world": [deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()],
    }), flush=True)


if __name__ == "__main__":
    main()
