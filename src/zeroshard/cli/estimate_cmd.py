"""`zeroshard estimate`: memory, communication and step time of every stage and offload.

Also home of the arguments `plan` shares (model source, cluster, workload).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zeroshard.estimate import (
    GPUS, INTER_NODE_LINKS, Cluster, ModelShape, Strategy, Workload, evaluate, gpu_spec, inter_node_link, parse_bytes,
    shape_from_callable, shape_from_hf_config, shape_from_params,
)
from zeroshard.estimate.lora import (
    add_adapters, lora_from_hf_config, lora_from_module, lora_from_shape, parse_targets,
)
from zeroshard.estimate.model_size import build_on_meta, load_config
from zeroshard.estimate.planner import strategy_for
from zeroshard.estimate.byte_units import GIB, parse_count
from zeroshard.policies import ConfigError, Precision, ZeroShardError

DEFAULT_GPU = "a100-80gb"
DEFAULT_INTER_NODE = "ib-hdr-8x"
DEFAULT_CPU_MEM = "512GiB"
# the workload's defaults are the estimator's own (estimate.Workload), declared there once
_WORKLOAD = {f.name: f.default for f in dataclasses.fields(Workload)}


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (one of)")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count, e.g. 7B, 350M, 1.3e9")
    src.add_argument("--hf-config", metavar="CONFIG_JSON", help="a Hugging Face config.json (no weights read)")
    src.add_argument("--model", metavar="MODULE:CALLABLE", help="builds an nn.Module; run on the meta device")
    m.add_argument("--layers", type=int, help="decoder layers (activations); inferred from --params if absent")
    m.add_argument("--hidden", type=int, help="hidden size (activations, bucket sizes)")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--vocab", type=int, help="vocabulary size (logits)")
    a = p.add_argument_group("adapters (frozen base + trainable adapters; see docs/lora.md)")
    ad = a.add_mutually_exclusive_group()
    ad.add_argument("--lora", type=int, metavar="R", help="LoRA adapters of rank R on a frozen base")
    ad.add_argument("--trainable-params", metavar="N",
                    help="N trainable adapter parameters (e.g. 20M) on a frozen base, for other adapter kinds")
    a.add_argument("--lora-targets", metavar="M1,M2",
                   help="modules LoRA adapts, e.g. q_proj,v_proj or all-linear (default: peft's for the model type)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=1)
    c.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU type ({', '.join(GPUS)}); default {DEFAULT_GPU}")
    c.add_argument("--gpu-mem", help="override the GPU's memory, e.g. 24GiB")
    c.add_argument("--cpu-mem", default=DEFAULT_CPU_MEM, help=f"host memory per node (default {DEFAULT_CPU_MEM})")
    c.add_argument("--nvme", default="0", help="NVMe capacity per node for ZeRO-Infinity, e.g. 3.84TB (default none)")
    c.add_argument("--inter-node", default=DEFAULT_INTER_NODE,
                   help=f"inter-node link ({', '.join(INTER_NODE_LINKS)}); default {DEFAULT_INTER_NODE}")
    c.add_argument("--inter-node-bw", type=float, help="override: inter-node GB/s per node, one direction")
    c.add_argument("--flops", type=float, help="achievable TFLOP/s per GPU (default: 40%% of the GPU's peak)")
    w = p.add_argument_group("workload")
    w.add_argument("--seq-len", type=int, default=_WORKLOAD["seq"])
    w.add_argument("--micro-batch", type=int, default=_WORKLOAD["micro_batch"], help="sequences per GPU per micro-step")
    w.add_argument("--grad-accum", type=int, default=_WORKLOAD["gradient_accumulation_steps"],
                   help="gradient accumulation steps")
    w.add_argument("--precision", choices=sorted(p.value for p in Precision),
                   default=Precision(_WORKLOAD["precision"]).value)
    w.add_argument("--optimizer", default=_WORKLOAD["optimizer"], help="adam, adamw, sgd, sgd-momentum, lion, adagrad")
    w.add_argument("--optimizer-bytes", type=int, help="K: optimizer bytes per parameter incl. fp32 master")
    w.add_argument("--activation-checkpointing", choices=["auto", "on", "off"], default="auto",
                   help="plan: auto tries off then on; estimate: auto means off")
    w.add_argument("--no-flash-attention", action="store_true", help="count stored attention scores")
    o = p.add_argument_group("offload model")
    o.add_argument("--cpu-only", action="store_true",
                   help="host and device are the same memory (zeroshard on gloo, CPU): in fp32 the parameter "
                        "shard stays its own master (no separate fp32 host master), no pinned staging")
    o.add_argument("--grads-to-host", action="store_true",
                   help="DeepSpeed's ZeRO-Offload gradient model: an fp32 gradient partition streamed to the host, "
                        "no device gradient from stage 2 (zeroshard's engine keeps the 16-bit shard on the device)")

    p.add_argument("--json", action="store_true", help="print the figures as JSON (bytes as integers)")


def read_shape(args) -> ModelShape:
    kw = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab)
    for k, v in kw.items():
        if v is not None and v <= 0:
            raise ConfigError(f"--{k} must be positive, got {v}")
    if args.params is not None:
        shape = shape_from_params(args.params, **kw)
    elif args.hf_config is not None:
        shape = replace(shape_from_hf_config(args.hf_config), **{k: v for k, v in kw.items() if v})
    else:
        shape = shape_from_callable(args.model, **kw)
    return with_adapters(shape, args)


def with_adapters(shape: ModelShape, args) -> ModelShape:
    """--lora R / --trainable-params N: adapters added to the frozen base."""
    lora, extra, targets = args.lora, args.trainable_params, args.lora_targets
    if targets is not None and lora is None:
        raise ConfigError("--lora-targets needs --lora R (the adapter rank)")
    if extra is not None:
        n = parse_count(extra)
        if n <= 0:
            raise ConfigError(f"--trainable-params must be positive, got {extra!r}")
        return add_adapters(shape, n, f"+{n:,} trainable adapter params (--trainable-params), base frozen")
    if lora is None:
        return shape
    if lora < 1:
        raise ConfigError(f"--lora {lora}: the adapter rank must be at least 1")
    wanted = parse_targets(targets)
    if args.hf_config is not None:
        count = lora_from_hf_config(load_config(args.hf_config), lora, wanted)
    elif args.model is not None:
        count = lora_from_module(build_on_meta(args.model), lora, wanted)
    else:
        count = lora_from_shape(shape, lora, wanted)
    return add_adapters(shape, count.params, f"+{count.params:,} trainable: {count.describe()}, base frozen")


def read_cluster(args) -> Cluster:
    gpu = gpu_spec(args.gpu)
    if args.gpu_mem:
        gpu = replace(gpu, memory=parse_bytes(args.gpu_mem, "--gpu-mem"))
        if gpu.memory <= 0:
            raise ConfigError("--gpu-mem must be positive")
    for flag, value in (("--inter-node-bw", args.inter_node_bw), ("--flops", args.flops)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    inter = inter_node_link(args.inter_node).bw_per_node if args.inter_node_bw is None else args.inter_node_bw * 1e9
    return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=gpu, inter_node_bw=inter,
                   host_mem=parse_bytes(args.cpu_mem, "--cpu-mem"), nvme=parse_bytes(args.nvme, "--nvme"),
                   achieved_flops=args.flops * 1e12 if args.flops else None)


def read_workload(args) -> Workload:
    ac = {"auto": None, "on": True, "off": False}[args.activation_checkpointing]
    if args.optimizer_bytes is not None and args.optimizer_bytes < 0:
        raise ConfigError(f"--optimizer-bytes must not be negative, got {args.optimizer_bytes}")
    return Workload(seq=args.seq_len, micro_batch=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
                    precision=args.precision, optimizer=args.optimizer, optimizer_bytes=args.optimizer_bytes,
                    activation_checkpointing=ac, flash_attention=not args.no_flash_attention,
                    host_is_device=args.cpu_only, grads_to_host=args.grads_to_host)


def guarded(fn):
    """Known errors print one line and exit 2; no tracebacks for bad input."""
    def run(args) -> int:
        try:
            return fn(args)
        except (ZeroShardError, ValueError) as e:
            print(f"zeroshard {args.command or ''}: error: {e}".replace("  ", " "), file=sys.stderr)
            return 2
    return run


def gib(n: float) -> str:
    return f"{n / GIB:,.1f}"


ALL_COMBINATIONS = (  # (stage, offload_optimizer, offload_param, zero++)
    (0, "none", "none", False), (1, "none", "none", False), (2, "none", "none", False), (3, "none", "none", False),
    (3, "none", "none", True),
    (1, "cpu", "none", False), (2, "cpu", "none", False), (3, "cpu", "none", False), (3, "cpu", "cpu", False),
    (3, "nvme", "none", False), (3, "nvme", "cpu", False), (3, "nvme", "nvme", False),
)


def all_candidates(shape, cluster, work, ratio: float | None = None):
    ac = bool(work.activation_checkpointing)
    out = []
    combos = ALL_COMBINATIONS + (((3, "cpu", "none", False),) if ratio is not None else ())
    for i, (st, oo, op, zpp) in enumerate(combos):
        if zpp and cluster.world_size == 1:
            continue
        kw = dict(quantized_weights=True, quantized_gradients=True,
                  hpz_partition_size=cluster.gpus_per_node if cluster.nodes > 1 else 1) if zpp else {}
        if i >= len(ALL_COMBINATIONS):
            kw["offload_ratio"] = ratio
        s = strategy_for(work, shape.hidden, st, oo, op, activation_checkpointing=ac, **kw)
        out.append(evaluate(shape, s, cluster, work))
    return out


def describe(shape: ModelShape, cluster: Cluster, work: Workload) -> str:
    guess = " (layers/hidden inferred from the count)" if shape.shape_inferred else ""
    frozen = (f" ({shape.frozen_params:,} frozen in {work.precision.value}, {shape.trainable_params:,} trainable)"
              if shape.frozen_params else "")
    return (f"model {shape.params:,} params{frozen}, largest unit {shape.largest_unit:,}, {shape.layers} layers x "
            f"hidden {shape.hidden}{guess} {escape('[' + shape.source + ']')}\n"
            f"cluster {cluster.nodes} node(s) x {cluster.gpus_per_node} {cluster.gpu.name} "
            f"({gib(cluster.gpu.memory)} GiB), N = {cluster.world_size}, host {gib(cluster.host_mem)} GiB/node, "
            f"NVMe {gib(cluster.nvme)} GiB/node\n"
            f"workload {work.precision.value}, {work.optimizer} (K = "
            f"{Strategy(precision=work.precision, optimizer=work.optimizer, optimizer_bytes=work.optimizer_bytes).k}"
            f" bytes/param), seq {work.seq}, micro-batch {work.micro_batch}, grad-accum "
            f"{work.gradient_accumulation_steps}")


def candidate_table(cands, title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("config", "params", "grads", "optim", "hpZ+live+buf", "activ.", "device", "host/node",
                "nvme/node", "comm (Φ)", "sent intra/inter GiB", "step s", "fits"):
        t.add_column(col, justify="left" if col in ("config", "fits") else "right")
    for c in cands:
        m, tm = c.memory, c.time
        t.add_row(c.label(), gib(m.params), gib(m.grads), gib(m.optimizer_states),
                  gib(m.hpz_secondary + m.live_params + m.buffers), gib(m.activations), gib(m.device_total),
                  gib(m.host_per_node), gib(m.nvme_per_node), f"{c.comm.paper_units:.2f}",
                  f"{gib(c.comm.total('intra_bytes'))} / {gib(c.comm.total('inter_bytes'))}", f"{tm.step:.2f}",
                  "[green]yes[/]" if c.fits else f"[red]no[/] {c.why_not()}")
    return t


def comm_table(cands) -> Table:
    t = Table(title="communication per step per rank (paper units: AG/RS = elements, AR = 2 x elements; "
                    "sent = ring bytes, (n-1)/n)", title_justify="left")
    for col in ("config", "phase", "collective", "dtype", "calls", "elements", "paper units", "payload GiB",
                "sent GiB", "intra GiB", "inter GiB"):
        t.add_column(col, justify="left" if col in ("config", "phase", "collective", "dtype") else "right")
    first = {}
    for c in cands:
        first.setdefault((c.strategy.stage, c.strategy.zeropp), c)
    for c in first.values():
        for col in c.comm.collectives:
            t.add_row(c.label(), col.phase, f"{col.op} {col.what}", col.dtype, str(col.calls), f"{col.elements:,}",
                      f"{col.paper_elements / c.comm.params:.2f} Φ", gib(col.bytes), gib(col.sent_bytes),
                      gib(col.intra_bytes), gib(col.inter_bytes))
        tot = c.comm.total
        t.add_row(c.label(), "", "[bold]total per step[/]", "", "", f"{tot('elements'):,}",
                  f"[bold]{c.comm.paper_units:.2f} Φ[/]", gib(tot("bytes")), gib(tot("sent_bytes")),
                  gib(tot("intra_bytes")), gib(tot("inter_bytes")), end_section=True)
    return t


@guarded
def run(args) -> int:
    shape, cluster, work = read_shape(args), read_cluster(args), read_workload(args)
    if args.offload_ratio is not None and not 0.0 <= args.offload_ratio <= 1.0:
        raise ConfigError(f"--offload-ratio must be in [0, 1], got {args.offload_ratio}")
    cands = all_candidates(shape, cluster, work, args.offload_ratio)
    if args.json:
        print(json.dumps({"model": {"params": shape.params, "trainable": shape.trainable_params,
                                    "frozen": shape.frozen_params, "largest_unit": shape.largest_unit,
                                    "largest_layer": shape.largest_layer, "layers": shape.layers,
                                    "hidden": shape.hidden, "heads": shape.heads, "vocab": shape.vocab,
                                    "source": shape.source, "shape_inferred": shape.shape_inferred},
                          "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                                      "gpu": cluster.gpu.name, "gpu_memory": cluster.gpu.memory,
                                      "host_memory_per_node": cluster.host_mem, "nvme_per_node": cluster.nvme},
                          "candidates": [c.as_dict() for c in cands]}, indent=2))
        return 0
    con = Console(width=200)
    con.print(describe(shape, cluster, work))
    con.print(candidate_table(cands, "memory (GiB per device unless marked), communication and step time"))
    con.print(comm_table(cands))
    con.print("Activations are not sharded by any ZeRO stage; activation checkpointing (--activation-checkpointing on)"
              " shrinks them.")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="memory, communication and step time for every ZeRO stage",
                              description=__doc__.splitlines()[0])
    add_common_arguments(p)
    p.add_argument("--offload-ratio", type=float, metavar="R",
                   help="also estimate stage 3 with offload_optimizer.ratio R (the first R of the optimizer "
                        "shards on the host, the rest on the device)")
    p.set_defaults(func=run)
