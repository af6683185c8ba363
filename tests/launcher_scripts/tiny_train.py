"""A tiny stage-2 training run for the launcher tests: started by hand with torchrun's,
OpenMPI's or Slurm's variables (tests/test_launchers_real.py) or by `zeroshard launch`.

Each rank trains on its slice of the same global batches; rank 0 prints one JSON line:
the world it joined (size, rank, local rank per rank) and the loss of every step (averaged
over the ranks), which must not depend on the launcher that started the ranks.

ZS_TEST_HOSTS="node03,node04" maps those host names to 127.0.0.1 in this process's resolver,
so a Slurm node list of made-up nodes can be joined on loopback. ZS_TEST_UNSET="A,B" removes
those variables first (a launcher that does not say how many ranks share a host).
"""

import json
import os
import socket
import sys

for name in filter(None, os.environ.pop("ZS_TEST_UNSET", "").split(",")):
    os.environ.pop(name, None)

hosts = os.environ.get("ZS_TEST_HOSTS")
if hosts:
    names, real = set(hosts.split(",")), socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real("127.0.0.1" if host in names else host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zeroshard  # noqa: E402

if len(sys.argv) > 1 and sys.argv[1] == "--deepspeed":  # the drop-in's way in: init_distributed first
    import zeroshard.deepspeed as deepspeed  # noqa: E402

    deepspeed.init_distributed()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine = zeroshard.initialize(model, config)
gen = torch.Generator().manual_seed(1)
losses = []
for step in range(3):
    x = torch.randn(2 * engine.world_size, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    mine = slice(2 * engine.rank, 2 * engine.rank + 2)
    loss = torch.nn.functional.mse_loss(engine(x[mine]), y[mine])
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / engine.world_size)
who = torch.tensor([engine.rank, int(os.environ.get("LOCAL_RANK", "0"))])
every = [torch.zeros_like(who) for _ in range(engine.world_size)]
dist.all_gather(every, who)
if engine.rank == 0:
    print(json.dumps({"world": engine.world_size, "ranks": [t.tolist() for t in every], "losses": losses}), flush=True)
engine.close()
