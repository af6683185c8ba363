"""`zeroshard plan`: the recommended ZeRO configuration for a model, a cluster and a batch."""

from __future__ import annotations

import json

from rich.console import Console

from zeroshard.cli.estimate_cmd import (
    add_common_arguments, candidate_table, describe, gib, guarded, read_cluster, read_shape, read_workload,
)
from zeroshard.estimate import deepspeed_config, plan
from zeroshard.policies import ConfigError


@guarded
def run(args) -> int:
    shape, cluster, work = read_shape(args), read_cluster(args), read_workload(args)
    p = plan(shape, cluster, work)
    if p.winner is None:
        if p.smallest_fit is None:
            raise ConfigError("fits nowhere, on any number of these GPUs: the unsharded part alone (activations "
                              "and one gathered unit) exceeds a device; lower --micro-batch or --seq-len, or use "
                              "--activation-checkpointing on")
        cl, cand = p.smallest_fit
        if args.json:
            print(json.dumps(p.as_dict(), indent=2))
        raise ConfigError(
            f"fits nowhere on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu.name}; the smallest cluster "
            f"that fits is {cl.nodes} node(s) x {cl.gpus_per_node} GPUs (N = {cl.world_size}) with "
            f"{cand.label()}: {gib(cand.memory.device_total)} GiB per device, "
            f"{gib(cand.memory.host_per_node)} GiB host per node")
    cfg = deepspeed_config(p.winner.strategy, work, cluster, nvme_path=args.nvme_path)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps({**p.as_dict(), "deepspeed_config": cfg}, indent=2))
        return 0
    con = Console(width=200)
    con.print(describe(shape, cluster, work))
    con.print("[bold]decision route[/]")
    for line in p.route:
        con.print(f"  - {line}")
    con.print(candidate_table(p.candidates, "candidates evaluated"))
    w, t = p.winner, p.winner.time
    con.print(f"[bold]recommended:[/] {w.label()}: {gib(w.memory.device_total)} GiB per device "
              f"(model states {gib(w.memory.model_states)}, activations {gib(w.memory.activations)}), "
              f"host {gib(w.memory.host_per_node)} GiB/node; step {t.step:.2f} s = compute {t.compute:.2f} + "
              f"exposed comm {t.comm_exposed:.2f} (of {t.comm_total:.2f}: intra {t.comm_intra:.2f}, inter "
              f"{t.comm_inter:.2f}) + PCIe {t.pcie:.2f} + CPU optimizer {t.cpu_optimizer:.2f} + NVMe {t.nvme:.2f}"
              + (f" + quantization {t.quantization:.2f}" if t.quantization else "") + "; "
              + f"{t.tokens_per_second:,.0f} tokens/s")
    if args.out:
        con.print(f"DeepSpeed-style config written to {args.out}")
    else:
        con.print(json.dumps(cfg, indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="recommend a ZeRO configuration and write it as DeepSpeed JSON",
                              description=__doc__)
    add_common_arguments(p)
    p.add_argument("--out", help="write the recommended DeepSpeed-style JSON config here")
    p.add_argument("--nvme-path", default="/local_nvme", help="nvme_path written into offload blocks")
    p.set_defaults(func=run)
