"""A DeepSpeedExamples-style script (after training/cifar/cifar10_deepspeed.py), unchanged.

`import deepspeed`, `from deepspeed.accelerator import get_accelerator`,
`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`,
`deepspeed.add_config_arguments`, `deepspeed.init_distributed`, `deepspeed.initialize(...,
training_data=...)` and the engine loop, on a small CNN and generated 3x16x16 images (no
download). Rank 0 prints one `RESULT {json}` line with the losses.
"""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR-style")
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--stage", default=2, type=int)
    parser.add_argument("--moe-param-group", default=True, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def trainset(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 16, 16, generator=g) * 0.5 + labels.view(-1, 1, 1, 1) * 0.1
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 3)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    return {
        "train_batch_size": 8,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def main(args):
    deepspeed.init_distributed()
    get_accelerator().manual_seed(0)
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset(), config=get_ds_config(args))
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            get_accelerator().synchronize()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / torch.distributed.get_world_size())
    if local_rank == 0 and torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({"losses": losses, "device": local_device,
                                      "backend": get_accelerator().communication_backend_name()}), flush=True)


if __name__ == "__main__":
    main(add_argument())
