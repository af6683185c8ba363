"""Benchmark: ZeRO++ (qwZ, hpZ, qgZ) beside plain stage 3 (issue 12).

    python bench/bench_zeropp.py            # "mini" GPT, 4 gloo ranks as 2 nodes x 2, 8 measured steps
    python bench/bench_zeropp.py --quick    # "tiny" GPT, 3 measured steps

Four parts:
1. bytes per step: each rank's comm_stats(by_scope=True) over one optimizer step (after warm-up
   steps), sent bytes inside the node and across nodes, for stage 3, hpZ, qwZ, qgZ and all three
   (fp32 and bf16). Rank 0's figures; the ranks are symmetric. stage3_max_reuse_distance = 0 and
   persistence 0: every unit is gathered again in backward (the 3 x Phi of a model that does not
   fit gathered; with DeepSpeed's default reuse distance this small model stays gathered between
   forward and backward and there is no backward gather for hpZ to serve).
2. quantize / dequantize throughput (comm.quantization, torch ops, one thread) beside a torch
   copy of the same tensor (this machine's memory bandwidth as torch sees it): GB/s of the
   16/32-bit input read (quantize) or output written (dequantize), 16M elements. The fuller
   comparison (sizes, threads, rounds, spread) is bench/bench_quantize.py.
3. step time here: median wall clock of rank 0's forward + backward + step, 4 processes on this
   machine's cores (gloo over loopback; shared machine: noisy, not a network measurement).
4. the estimator's step time for 2 nodes x 8 A100-80GB on one 100 Gb/s link per node (roce-100g),
   bf16, for GPT-sized models, plain stage 3 beside ZeRO++ (hpZ = 8), with the quantization time
   it charges (timing.QUANTIZE_BW).
5. the estimator's prediction for this run (2 nodes x 2 CPU ranks, the same model, batch and
   configs) beside the measured step and the ledger's comm seconds (comm_stats, rank 0: each
   call from issue to wait, summed, so calls in flight together each count their time). The
   estimator gets this machine as a Cluster of rates each rank measured at the start of the run,
   all four at once (so with the same sharing of the cores): matmul FLOP/s at the model's
   shapes, gloo all-gather bytes/s, and quantize + dequantize bytes/s of a unit-sized tensor
   (comm.quantization, i.e. the fused kernel where it builds); medians over the ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

CONFIGS = {
    "stage 3": {},
    "hpZ": {"zero_hpz_partition_size": 2},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "all three": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}
PER_NODE = 2


def _rank(rank, world, preset, steps, precisions):
    os.environ.update(LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(rank // PER_NODE))
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models import build_gpt, global_batch, synthetic_tokens

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {"rates": _rates(preset, world)}
    for precision in precisions:
        for name, zpp in CONFIGS.items():
            torch.manual_seed(0)
            model = build_gpt(preset)
            cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                         "stage3_max_reuse_distance": 0, **zpp},
                   "zeroshard": {"stage3_unit_classes": ["Block"]}}
            if precision == "bf16":
                cfg["bf16"] = {"enabled": True}
            engine = zeroshard.initialize(model, cfg)
            seq = model.config.block_size
            tokens = synthetic_tokens(1 << 16, model.config.vocab_size, seed=1)
            times, losses = [], []
            for step in range(steps + 2):
                x, y = global_batch(tokens, 2, seq, step, world, seed=2)
                x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
                if step == steps + 1:
                    engine.reset_comm_stats()
                t0 = time.perf_counter()
                loss = engine(x, y)[1]
                engine.backward(loss)
                engine.step()
                if step >= 2:
                    times.append(time.perf_counter() - t0)
                losses.append(loss.item())
            scoped = engine.comm_stats(by_scope=True)
            comm_s = sum(v["seconds"] for v in engine.comm_stats().values())
            out[(precision, name)] = {
                "intra": sum(v["sent_bytes"] for v in scoped["intra_node"].values()),
                "inter": sum(v["sent_bytes"] for v in scoped["inter_node"].values()),
                "step_s": statistics.median(times), "loss": losses[-1], "comm_s": comm_s,
                "params": sum(p.numel() for p in engine.module.parameters())}
            engine.close()
    return out


def _fastest(fn, reps: int) -> float:
    """Seconds of the fastest of `reps` calls of `fn`, after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _best_rate(fn, work: float, reps: int = 7) -> float:
    """`work` (FLOPs or bytes) over the fastest of `reps` calls of `fn`."""
    return work / _fastest(fn, reps)


def _rates(preset: str, world: int) -> dict[str, float]:
    """This rank's measured rates (all ranks at once): matmul FLOP/s at the model's shapes,
    gloo all-gather bytes/s received, fp32 and bf16 quantize + dequantize bytes/s (int8)."""
    import torch.distributed as dist

    from zeroshard.comm import dequantize, plan_blocks, quantize
    from zeroshard.models import build_gpt

    cfg = build_gpt(preset).config
    tokens, h = 2 * cfg.block_size, cfg.n_embd
    a, w = torch.randn(tokens, h), torch.randn(h, 4 * h)
    flops = _best_rate(lambda: [a @ w for _ in range(20)], 20 * 2 * tokens * h * 4 * h)
    unit = 12 * h * h  # one Block's parameters
    shard = torch.randn(unit // world)
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.barrier()
    link = _best_rate(lambda: dist.all_gather(parts, shard), 4 * unit * (world - 1) / world)
    out = {"flops": flops, "link": link}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, unit).to(dtype)
        blocks = plan_blocks(unit, 8)
        y = torch.empty_like(x)
        out[f"q+dq {str(dtype)[6:]}"] = _best_rate(
            lambda: dequantize(*quantize(x, blocks), blocks, dtype, out=y), unit * x.element_size())
    return out


def _predictions(preset: str, rates: dict[str, float], configs) -> dict[tuple[str, str], object]:
    """The estimator's Candidate for each (precision, config) of this run on a Cluster of the
    measured rates (links and FLOP/s as achieved: ACHIEVED_*_FRACTION divided out)."""
    from zeroshard.estimate import Cluster, GpuSpec, ModelShape, Strategy, Workload, evaluate
    from zeroshard.estimate.hardware import ACHIEVED_LINK_FRACTION
    from zeroshard.models import build_gpt
    from zeroshard.policies import Precision, Stage

    model = build_gpt(preset)
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    unit = max(sum(p.numel() for p in b.parameters()) for b in model.h)
    shape = ModelShape(params=params, largest_unit=unit, largest_layer=unit, layers=c.n_layer, hidden=c.n_embd,
                       heads=c.n_head, vocab=c.vocab_size, source=f"GPT {preset}")
    link = rates["link"] / ACHIEVED_LINK_FRACTION
    out = {}
    for precision in ("fp32", "bf16"):
        cpu = GpuSpec("this machine's rank (measured)", 24 << 30, rates["flops"], link, 1e12, "bench_zeropp part 5")
        cluster = Cluster(nodes=2, gpus_per_node=PER_NODE, gpu=cpu, inter_node_bw=link * PER_NODE, host_mem=24 << 30,
                          achieved_flops=rates["flops"], quantize_bw=rates[f"q+dq {'float32' if precision == 'fp32' else 'bfloat16'}"])
        p = Precision.FP32 if precision == "fp32" else Precision.BF16
        work = Workload(seq=c.block_size, micro_batch=2, precision=p, optimizer="adamw", host_is_device=True,
                        activation_checkpointing=False)
        for name, zpp in configs.items():
            s = Strategy(stage=Stage.PARAMETERS, precision=p, optimizer="adamw", host_is_device=True,
                         quantized_weights=bool(zpp.get("zero_quantized_weights")),
                         hpz_partition_size=zpp.get("zero_hpz_partition_size", 1),
                         quantized_gradients=bool(zpp.get("zero_quantized_gradients")))
            out[(precision, name)] = evaluate(shape, s, cluster, work)
    return out


def _throughput(numel: int) -> list[tuple[str, float]]:
    from zeroshard.comm import dequantize, plan_blocks, quantize

    torch.set_num_threads(1)

    def best(fn):
        return _fastest(fn, 5)

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(numel).to(dtype)
        nbytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        rows.append((f"torch copy {str(dtype)[6:]} (read+write {nbytes / 1e6:.0f} MB each)",
                     nbytes / best(lambda: dst.copy_(x)) / 1e9))
        for bits in (8, 4):
            blocks = plan_blocks(numel, bits)
            q, s = quantize(x.view(1, -1), blocks)
            rows.append((f"quantize {str(dtype)[6:]} -> int{bits}", nbytes / best(lambda: quantize(x.view(1, -1), blocks)) / 1e9))
            out = torch.empty(1, numel, dtype=dtype)
            rows.append((f"dequantize int{bits} -> {str(dtype)[6:]}",
                         nbytes / best(lambda: dequantize(q, s, blocks, dtype, out=out)) / 1e9))
    return rows


def _estimates() -> list[tuple[str, str, float, float, float, float]]:
    from zeroshard.estimate import Strategy, shape_from_params
    from zeroshard.estimate.hardware import Cluster, gpu_spec, inter_node_link
    from zeroshard.estimate.planner import Workload, evaluate
    from zeroshard.policies import Precision, Stage

    cluster = Cluster(nodes=2, gpus_per_node=8, gpu=gpu_spec("a100-80gb"),
                      inter_node_bw=inter_node_link("roce-100g").bw_per_node, host_mem=1 << 40)
    work = Workload(seq=2048, micro_batch=1, precision=Precision.BF16)
    rows = []
    for count in ("1.3B", "7B"):
        shape = shape_from_params(count)
        for label, kw in (("stage 3", {}), ("qwZ+hpZ+qgZ", dict(quantized_weights=True, hpz_partition_size=8,
                                                                 quantized_gradients=True))):
            c = evaluate(shape, Strategy(stage=Stage.PARAMETERS, precision=Precision.BF16, **kw), cluster, work)
            scope = c.comm.sent_by_scope()
            rows.append((count, label, sum(scope["inter_node"].values()) / 1e9, c.time.comm_inter,
                         c.time.quantization, c.time.step))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from zeroshard.bench.ranks import run_ranks

    preset, steps = ("tiny", 3) if args.quick else ("mini", 8)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; model GPT '{preset}', 4 gloo ranks as 2 nodes x 2")
    every = run_ranks(_rank, 4, preset, steps, ("fp32", "bf16"), timeout=1800)
    rates = {k: statistics.median(r["rates"][k] for r in every) for k in every[0]["rates"]}
    results = {k: v for k, v in every[0].items() if k != "rates"}
    print("\n1./3. per step, rank 0 (sent bytes by scope; step time median of", steps, "steps)")
    print(f"{'precision':9} {'config':10} {'intra-node B':>13} {'inter-node B':>13} {'inter vs stage 3':>17} "
          f"{'step ms':>8} {'last loss':>9}")
    for (precision, name), r in results.items():
        base = results[(precision, "stage 3")]["inter"]
        print(f"{precision:9} {name:10} {r['intra']:>13,} {r['inter']:>13,} {r['inter'] / base:>16.3f}x "
              f"{r['step_s'] * 1e3:>8.1f} {r['loss']:>9.4f}")
    print(f"(model parameters: {next(iter(results.values()))['params']:,})")
    print("\n2. quantize / dequantize, 16M elements, 1 thread (GB/s of the 16/32-bit side)")
    for label, gbs in _throughput(1 << 24):
        print(f"  {label:44} {gbs:7.2f} GB/s")
    print("\n4. estimator: 2 nodes x 8 A100-80GB, 100 Gb/s (roce-100g) per node, bf16, seq 2048, micro-batch 1")
    print(f"  {'model':5} {'config':12} {'inter-node GB/step/rank':>24} {'inter comm s':>13} {'quantize s':>11} "
          f"{'step s':>8}")
    for count, label, inter, t_inter, t_quant, step in _estimates():
        print(f"  {count:5} {label:12} {inter:>24.3f} {t_inter:>13.3f} {t_quant:>11.3f} {step:>8.3f}")
    print(f"\n5. estimator vs this run (2 nodes x 2 ranks, GPT '{preset}', micro-batch 2): rates measured by each rank "
          f"at the start, medians: matmul {rates['flops'] / 1e9:.2f} GFLOP/s, gloo all-gather "
          f"{rates['link'] / 1e9:.3f} GB/s, quantize + dequantize {rates['q+dq float32'] / 1e9:.2f} GB/s fp32, "
          f"{rates['q+dq bfloat16'] / 1e9:.2f} GB/s bf16")
    print(f"  {'precision':9} {'config':10} {'compute ms':>10} {'comm ms':>8} {'quant ms':>9} {'predicted':>9} "
          f"{'measured':>9} {'ledger comm ms':>14} {'measured / predicted':>20}")
    for (precision, name), cand in _predictions(preset, rates, CONFIGS).items():
        t, r = cand.time, results[(precision, name)]
        print(f"  {precision:9} {name:10} {t.compute * 1e3:>10.1f} {t.comm_exposed * 1e3:>8.1f} "
              f"{t.quantization * 1e3:>9.2f} {t.step * 1e3:>9.1f} {r['step_s'] * 1e3:>9.1f} {r['comm_s'] * 1e3:>14.1f} "
              f"{r['step_s'] / t.step:>19.1f}x")


if __name__ == "__main__":
    main()
