#!/usr/bin/env python
"""Every CUDA / NCCL path of zeroshard, checked in one run: one table, one JSON file (issue 25).

    python bench/gpu_check.py --device cuda            # the check (<= 8 min on one GPU)
    python bench/gpu_check.py --device cpu --quick     # the smoke form the default test suite runs

Two process forms, each spawned here with torchrun's variables and a timeout:
  * "1 rank": one process on the device; on CUDA its default group is NCCL (what zeroshard
    uses under torchrun on a GPU), on CPU gloo.
  * "2 ranks gloo": two processes on gloo. On a CUDA machine this form first probes gloo's
    collectives on CUDA tensors (which ones gloo supports, and whether their results are right),
    then runs the oracle on a small model where zeroshard's Topology puts gloo ranks: gloo ranks
    always get device cpu (comm/topology.py `_device_for`), so zeroshard itself never runs gloo
    over CUDA tensors. The row says which device each run used.

Rows (section / what is checked; the verdict is a real assertion, the exit code is 1 when any fails):
  oracle      stages 0-3 x {fp32 SGD (1e-5 of the largest entry), fp32 AdamW (2 % rule),
              bf16 SGD (drift <= 3 % of the distance fp32 moved, tests/test_precision.py's bound)}
              for a GPT (~100M on CUDA: 12 x 832) and a transformers Llama built from a config
              (~100M on CUDA), against one process with the N x b batch on the same device.
  gloo        (2 ranks) each torch.distributed collective zeroshard's Comm calls, on tensors of the
              device (CUDA tensors on a GPU): result right, or "unsupported by gloo" (not a failure).
  nccl        (CUDA) whether zeroshard's Handle.wait() blocks the host on NCCL (it passes a timeout to
              work.wait(), which makes torch's WorkNCCL::wait block the CPU thread): host time blocked
              behind ~0.2 s of queued GPU work, beside a plain wait(). On one GPU zeroshard issues no
              collective at all (world size 1 short-circuits in Comm._issue), so no other row reaches NCCL.
  offload     offload_optimizer cpu (stages 2, 3), offload_param cpu (stage 3): SGD oracle; the host
              tier is pinned on CUDA; on CUDA a torch.profiler (CUPTI) trace of two steps: host<->device
              copy time hidden behind kernels on another stream vs exposed, and whether the gradient
              copies to the host ran on a side stream (their verdict).
  nvme        offload_optimizer nvme + offload_param nvme at stage 3, files under --nvme-dir (the
              machine's disk): SGD oracle.
  actoffload  zeroshard.checkpoint_activations with activation_offload cpu: gradients equal torch's
              checkpoint (<= 1e-6 of the largest entry; CUDA: pinned copies on a side stream, reads ahead).
  memory      (1 rank, stages 0-3, fp32 AdamW) the ledger's model states at rest beside the estimator
              (zeroshard.estimate, with the engine's padding layout: within 5 %); on CUDA also
              torch.cuda.memory_allocated() at rest beside the ledger's device tier (within 10 % + 16 MiB),
              torch.cuda.max_memory_allocated() beside memory_stats()["allocated_bytes.all.peak"] (equal)
              and beside the ledger's peak (the ledger never claims more than the allocator saw), and the
              estimator's device_total beside both (shown, not judged).
  speed       step time and tokens/s of zeroshard stages 2 and 3 beside torch DDP (bf16 autocast on the
              device) and FSDP2 (bf16 MixedPrecisionPolicy), and DeepSpeed when it imports (CUDA only):
              verdict: every loss finite and each system's first loss within 2 % of DDP's.
  compile     (issue 44) the plain model with each Block compiled in place, and zeroshard stages 2 and 3
              through engine.compile(), each beside its eager run (bf16, the speed section's model): no
              graph break inside a region, no recompile after step 1, first loss within 1 % of eager's,
              and on CUDA (inductor) a median step below eager's; the quick form: stage 3, aot_eager.
  zeropp      qwZ (int8) / qgZ (int4) block quantize + dequantize throughput on the device (GB/s of
              input), verdict: every element within half a quantization step of its block; and a
              stage 3 run with zero_quantized_weights + zero_quantized_gradients: finite, and within
              10 % of the distance moved from the fp32 reference.

What has never run (no GPU was at hand when this was written, 2026-12-02): everything under
`--device cuda`: the NCCL 1-rank form, gloo on CUDA tensors, the pinned host tier, the gradient
staging side stream, CUPTI's copy events in the profiler trace, activation offload's side stream,
the CUDA memory columns, DDP / FSDP2 / DeepSpeed on CUDA, the quantizer on CUDA and the NCCL wait
probe; the compile section (2026-12-07) with inductor on CUDA. The "<= 8 minutes" is an estimate
(~100M models, 4 steps per oracle run; the compile section's six runs, three of them compiling,
perhaps 2 more; each process form is killed at --timeout, 470 s on CUDA: `--only compile` runs that
section alone). The CPU form (`--device cpu --quick`) runs in the default
test suite (tests/test_gpu_check.py) and shares every code path that does not need CUDA (the
profile's trace export and parsing included; the parser also reads a synthetic CUDA trace there).

One GPU holds one NCCL rank, and zeroshard's Comm issues nothing on a world of one: the NCCL rows
check the device paths (buckets, streams, copies, memory) and NCCL's start-up, not NCCL collectives
between peers; those need two GPUs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "src", ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIP", "info"

# --------------------------------------------------------------------------------------------------
# sizes


def sizes(device: str, quick: bool) -> dict:
    """Model shapes, batch and steps of one run. CUDA full: ~100M-parameter models."""
    if quick:
        return {"gpt": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
                "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=64, max_position_embeddings=32),
                "gpt2r": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
                "seq": 16, "micro": 2, "steps": 3, "bucket": 3000, "speed_steps": 3, "speed_warmup": 1,
                "quant_elems": 1 << 16, "models": ("gpt", "llama"), "models2": ("gpt",)}
    if device == "cuda":
        return {"gpt": dict(vocab_size=256, block_size=256, n_layer=12, n_head=13, n_embd=832),  # ~100M
                "llama": dict(hidden_size=896, intermediate_size=2432, num_hidden_layers=12, num_attention_heads=14,
                              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256),  # ~100M
                # the 2-rank gloo form runs on the CPU (zeroshard's gloo ranks are CPU ranks): 6 x 384
                "gpt2r": dict(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384),
                "seq": 256, "micro": 4, "steps": 4, "bucket": 5_000_000, "speed_steps": 20, "speed_warmup": 5,
                "quant_elems": 1 << 26, "models": ("gpt", "llama"), "models2": ("gpt",)}
    return {"gpt": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
            "llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=64),
            "gpt2r": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
            "seq": 64, "micro": 2, "steps": 4, "bucket": 100_000, "speed_steps": 5, "speed_warmup": 2,
            "quant_elems": 1 << 20, "models": ("gpt", "llama"), "models2": ("gpt", "llama")}


UNIT = {"gpt": "Block", "llama": "LlamaDecoderLayer"}
LR = {"sgd": 0.05, "adamw": 2e-3}


def row(section, name, form, verdict, value="", detail="", **data):
    return {"section": section, "name": name, "form": form, "verdict": verdict, "value": value,
            "detail": detail, "data": data}


# --------------------------------------------------------------------------------------------------
# models, data, the reference


def make_model(kind: str, sz: dict, key: str = ""):
    import torch

    torch.manual_seed(1234)
    if kind == "llama":
        import transformers as hf

        return hf.LlamaForCausalLM(hf.LlamaConfig(**sz["llama"], bos_token_id=0, eos_token_id=0,
                                                  tie_word_embeddings=False))
    from zeroshard.models import build_gpt
    from zeroshard.models.presets import GPTConfig

    return build_gpt(GPTConfig(**sz[key or "gpt"]))


def vocab(kind: str, sz: dict, key: str = "") -> int:
    return sz["llama"]["vocab_size"] if kind == "llama" else sz[key or "gpt"]["vocab_size"]


def loss_of(model, x, y):
    inner = getattr(model, "module", model)
    if type(inner).__module__.startswith("transformers"):
        return model(input_ids=x, labels=y).loss
    return model(x, y)[1]


def batches(kind: str, sz: dict, world: int, steps: int, key: str = ""):
    from zeroshard.models import global_batch, synthetic_tokens

    tokens = synthetic_tokens(max(8192, 4 * world * sz["micro"] * sz["seq"]), vocab(kind, sz, key), seed=7)
    return [global_batch(tokens, sz["micro"], sz["seq"], s, world, seed=3) for s in range(steps)]


def torch_opt(name: str, params):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR["adamw"], betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def opt_section(name: str) -> dict:
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": LR["sgd"], "momentum": 0.9}}
    return {"type": "AdamW", "params": {"lr": LR["adamw"], "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}}


def reference(kind, opt_name, sz, world, device, key=""):
    """One process, batch N x b, plain torch on `device`: (initial, final) fp32 state dicts on the CPU."""
    import torch

    model = make_model(kind, sz, key)
    init = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    model.to(device)
    opt = torch_opt(opt_name, model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for x, y in batches(kind, sz, world, sz["steps"], key):
        loss_of(model, x.to(device), y.to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    final = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    del model, opt
    return init, final


def zs_config(kind, stage, opt_name, precision, sz, zero_extra=None, extra=None):
    zero = {"stage": stage, "reduce_bucket_size": sz["bucket"], "allgather_bucket_size": sz["bucket"],
            **(zero_extra or {})}
    cfg = {"train_micro_batch_size_per_gpu": sz["micro"], "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "optimizer": opt_section(opt_name), "zero_optimization": zero}
    if stage == 3:
        cfg["zeroshard"] = {"stage3_unit_classes": [UNIT[kind]]}
        # every parameter gathered (none kept whole as "persistent"): the tiny models' are all small
        zero.setdefault("stage3_param_persistence_threshold", 0)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    for k, v in (extra or {}).items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def train_zs(kind, cfg, sz, rank, world, key="", probe=None):
    """zeroshard on this rank: (full fp32 state dict, losses, engine) - the engine still open."""
    import zeroshard

    engine = zeroshard.initialize(make_model(kind, sz, key), cfg)
    dev = engine.device
    losses = []
    lo, hi = rank * sz["micro"], (rank + 1) * sz["micro"]
    for s, (x, y) in enumerate(batches(kind, sz, world, sz["steps"], key)):
        if probe is not None and s == sz["steps"] - 2:
            probe(engine, "before")
        loss = loss_of(engine, x[lo:hi].to(dev), y[lo:hi].to(dev))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    if probe is not None:
        probe(engine, "after")
    engine.gpu_check_comm = engine.comm_stats()  # the training steps' collectives, before the state dict's
    return engine.full_state_dict(), losses, engine


def judge(got, init, ref, opt_name, precision):
    """(verdict, value, detail) of the oracle for one run."""
    from oracle import adam_fraction_off, sgd_close

    if any(not bool(v.isfinite().all()) for v in got.values() if v.is_floating_point()):
        return FAIL, "non-finite", "parameters went non-finite"
    if precision == "bf16":
        num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref)
        den = sum(float((ref[k] - init[k]).pow(2).sum()) for k in ref)
        ratio = math.sqrt(num) / max(math.sqrt(den), 1e-30)
        return (PASS if ratio <= 0.03 else FAIL), f"drift {ratio:.2%} of moved", "bound 3 %"
    if opt_name == "sgd":
        bad = sgd_close(got, ref)
        worst = max(float((got[k] - ref[k]).abs().max()) / (float(ref[k].abs().max()) or 1.0) for k in ref)
        return (PASS if not bad else FAIL), f"max {worst:.2e} x largest", "; ".join(bad[:3]) or "bound 1e-5"
    frac = adam_fraction_off(got, ref)
    return (PASS if frac <= 0.02 else FAIL), f"{frac:.3%} entries off", "bound 2 % off by > 1e-3 rel"


def the_device(ctx):
    """This rank's device: cuda:0 (one GPU; an index, as DDP's device_ids needs), or the CPU."""
    import torch

    return torch.device("cuda", 0) if ctx["device"] == "cuda" else torch.device("cpu")


def release(device_type):
    import torch

    gc.collect()
    if device_type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# sections (each returns rows; runs on every rank, rank 0's rows are kept)


def section_oracle(ctx):
    rows, sz, rank, world = [], ctx["sz"], ctx["rank"], ctx["world"]
    models = sz["models"] if world == 1 else sz["models2"]
    key = "" if world == 1 else "gpt2r"
    refs = {}
    runs = [(kind, opt_name, precision, stage) for kind in models
            for opt_name, precision in (("sgd", "fp32"), ("adamw", "fp32"), ("sgd", "bf16")) for stage in (0, 1, 2, 3)]
    if ctx["quick"]:  # the smoke form: every stage once in fp32 SGD, one run of each other kind
        keep = {("gpt", "sgd", "fp32", s) for s in (0, 1, 2, 3)}
        keep |= {("gpt", "adamw", "fp32", 2), ("gpt", "sgd", "bf16", 3), ("llama", "sgd", "fp32", 3)}
        if world > 1:
            keep = {("gpt", "sgd", "fp32", 2), ("gpt", "sgd", "fp32", 3)}
        runs = [r for r in runs if r in keep]
    for kind, opt_name, precision, stage in runs:
        name = f"{kind} z{stage} {precision} {opt_name}"
        t0 = time.perf_counter()
        try:
            cfg = zs_config(kind, stage, opt_name, precision, sz)
            got, losses, engine = train_zs(kind, cfg, sz, rank, world, key)
            dev = engine.device
            engine.close()
            del engine
            release(dev.type)
            if rank == 0:
                if (kind, opt_name) not in refs:
                    refs[(kind, opt_name)] = reference(kind, opt_name, sz, world, dev, key)
                    release(dev.type)
                init, ref = refs[(kind, opt_name)]
                verdict, value, detail = judge(got, init, ref, opt_name, precision)
                rows.append(row("oracle", name, f"{ctx['form']} on {dev}", verdict, value, detail,
                                losses=losses, run_s=round(time.perf_counter() - t0, 2)))
        except Exception as exc:  # a run that raises is a failed row; the others still run
            rows.append(row("oracle", name, ctx["form"], FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                            trace=traceback.format_exc()[-2000:]))
    return rows


def section_gloo(ctx):
    """Each collective zeroshard's Comm issues, on this device's tensors, under gloo (2 ranks)."""
    import torch
    import torch.distributed as dist

    rank, world, dev = ctx["rank"], ctx["world"], the_device(ctx)
    form = f"{ctx['form']}, {dev.type} tensors"
    n = 1024

    def base(r):
        return torch.arange(n * world, dtype=torch.float32, device=dev) + 1000.0 * r

    def all_reduce():
        t = base(rank)
        dist.all_reduce(t)
        return t, sum(base(r) for r in range(world))

    def broadcast():
        t = base(rank)
        dist.broadcast(t, src=world - 1)
        return t, base(world - 1)

    def all_gather_into_tensor():
        out = torch.empty(n * world * world, device=dev)
        dist.all_gather_into_tensor(out, base(rank))
        return out, torch.cat([base(r) for r in range(world)])

    def all_gather_list():
        outs = [torch.empty(n * world, device=dev) for _ in range(world)]
        dist.all_gather(outs, base(rank))
        return torch.cat(outs), torch.cat([base(r) for r in range(world)])

    def reduce_scatter_tensor():
        out = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(out, base(rank))
        return out, sum(base(r) for r in range(world))[rank * n:(rank + 1) * n]

    def all_to_all_single():
        out = torch.empty(n * world, device=dev)
        dist.all_to_all_single(out, base(rank))
        return out, torch.cat([base(r)[rank * n:(rank + 1) * n] for r in range(world)])

    def isend_irecv():
        peer = (rank + 1) % world
        src = (rank - 1) % world
        out = torch.empty(n * world, device=dev)
        works = [dist.irecv(out, src=src, tag=7), dist.isend(base(rank), dst=peer, tag=7)]
        for w in works:
            w.wait()
        return out, base(src)

    rows = []
    for fn in (all_reduce, broadcast, all_gather_into_tensor, all_gather_list, reduce_scatter_tensor,
               all_to_all_single, isend_irecv):
        try:
            got, want = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            err = float((got.float() - want.float()).abs().max())
            rows.append(row("gloo", fn.__name__, form, PASS if err == 0 else FAIL,
                            "supported" if err == 0 else f"wrong by {err:g}", ""))
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            text = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            # gloo declines some collectives on CUDA tensors: report which, not a failure of zeroshard's
            verdict = INFO if dev.type == "cuda" else FAIL
            rows.append(row("gloo", fn.__name__, form, verdict, "unsupported by gloo", text))
        dist.barrier()
    return rows


def section_offload(ctx):
    import torch

    rows, sz, rank, world = [], ctx["sz"], ctx["rank"], ctx["world"]
    runs = [("optimizer cpu", 2, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
            ("optimizer cpu", 3, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
            ("param cpu", 3, {"offload_param": {"device": "cpu", "pin_memory": True}}),
            ("optimizer+param cpu", 3, {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                        "offload_param": {"device": "cpu", "pin_memory": True}})]
    if ctx["quick"]:
        runs = runs[1:2] + runs[3:]
    refs = {}
    for what, stage, zero_extra in runs:
        name = f"gpt z{stage} {what}"
        trace = {}

        def probe(engine, when, trace=trace):
            if when == "before":
                trace.update(start_profile(engine.device))
            else:
                trace.update(stop_profile(trace, engine.device))

        try:
            cfg = zs_config("gpt", stage, "sgd", "fp32", sz, zero_extra)
            got, losses, engine = train_zs("gpt", cfg, sz, rank, world, probe=probe)
            dev, mem = engine.device, engine.memory_stats()
            engine.close()
            del engine
            release(dev.type)
            if rank != 0:
                continue
            if "sgd" not in refs:
                refs["sgd"] = reference("gpt", "sgd", sz, world, dev)
            init, ref = refs["sgd"]
            verdict, value, detail = judge(got, init, ref, "sgd", "fp32")
            rows.append(row("offload", name + " oracle", f"{ctx['form']} on {dev}", verdict, value, detail))
            host = mem.get("tier_host", 0)
            rows.append(row("offload", name + " host tier", f"{ctx['form']} on {dev}",
                            PASS if host > 0 else FAIL, f"{host / 2**20:.1f} MiB on host",
                            "ledger tier_host > 0 (the states live on the host tier)"))
            rows.append(profile_row(name, ctx, dev, trace, "optimizer" in what))
        except Exception as exc:
            rows.append(row("offload", name, ctx["form"], FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                            trace=traceback.format_exc()[-2000:]))
    return rows


def start_profile(dev):
    """A torch.profiler session over the steps that follow (on CUDA CUPTI sees the copies; on the
    CPU the same trace export and parsing run, and must find no copies)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.__enter__()
    return {"prof": prof}


def stop_profile(trace, dev):
    import torch

    prof = trace.get("prof")
    if prof is None:
        return {}
    if dev.type == "cuda":
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return {"prof": None, "summary": copy_overlap(events)}


def copy_overlap(events):
    """From a chrome trace: copies (cat gpu_memcpy) and kernels (cat kernel), with their streams.
    hidden: copy time during which a kernel of another stream ran; exposed: the rest."""
    kernels, copies, seen = [], [], 0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        seen += 1
        cat = str(e.get("cat", "")).lower()
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), stream, str(e.get("name", "")))
        if cat == "kernel":
            kernels.append(span)
        elif cat == "gpu_memcpy":
            copies.append(span)
    compute = max({s for _, _, s, _ in kernels}, key=lambda s: sum(b - a for a, b, t, _ in kernels if t == s),
                  default=None)
    hidden = exposed = 0.0
    by_kind = {}
    for a, b, s, name in copies:
        busy = sorted((max(a, ka), min(b, kb)) for ka, kb, ks, _ in kernels if ks != s and ka < b and kb > a)
        covered, end = 0.0, a
        for lo, hi in busy:  # union of the overlapping kernel intervals
            lo = max(lo, end)
            if hi > lo:
                covered += hi - lo
                end = hi
        hidden += covered
        exposed += (b - a) - covered
        kind = "DtoH" if "dtoh" in name.lower() else "HtoD" if "htod" in name.lower() else "other"
        k = by_kind.setdefault(kind, {"count": 0, "us": 0.0, "streams": set(), "pageable": 0})
        k["count"] += 1
        k["us"] += b - a
        k["streams"].add(s)
        k["pageable"] += "pageable" in name.lower()  # CUPTI names the host side: "(Device -> Pinned)"
    return {"events": seen, "copies": len(copies), "hidden_us": hidden, "exposed_us": exposed, "compute_stream": compute,
            "by_kind": {k: {**v, "streams": sorted(map(str, v["streams"]))} for k, v in by_kind.items()}}


def profile_row(name, ctx, dev, trace, grads_to_host):
    form = f"{ctx['form']} on {dev}"
    s = trace.get("summary") or {}
    if not s.get("events"):
        return row("offload", name + " copy profile", form, FAIL, "no trace", "the profiler recorded nothing")
    if dev.type != "cuda":  # host and device are one memory: the trace must show no copies at all
        return row("offload", name + " copy profile", form, PASS if s["copies"] == 0 else FAIL,
                   f"{s['copies']} copies", "host and device are the same memory here: none expected", summary=s)
    total = s["hidden_us"] + s["exposed_us"]
    value = (f"{s['copies']} copies {total / 1e3:.1f} ms: hidden {s['hidden_us'] / 1e3:.1f} ms, "
             f"exposed {s['exposed_us'] / 1e3:.1f} ms")
    dtoh = s["by_kind"].get("DtoH", {})
    side = [st for st in dtoh.get("streams", []) if st != str(s["compute_stream"])]
    htod = s["by_kind"].get("HtoD", {})
    if grads_to_host:  # the gradient shards go to the pinned host buffers on the side stream
        ok = dtoh.get("count", 0) > 0 and bool(side) and dtoh.get("pageable", 0) == 0
        detail = (f"DtoH on streams {dtoh.get('streams')} (compute stream {s['compute_stream']}), "
                  f"{dtoh.get('pageable', 0)} to pageable memory; a side stream and pinned memory required")
    else:  # parameters fetched host -> device ahead of their gather, from pinned memory
        ok = htod.get("count", 0) > 0 and htod.get("pageable", 0) == 0
        detail = f"HtoD fetches of offloaded shards: {htod}; pinned memory required"
    return row("offload", name + " copy profile", form, PASS if ok else FAIL, value, detail, summary=s)


def section_nvme(ctx):
    rows, sz, rank, world = [], ctx["sz"], ctx["rank"], ctx["world"]
    base = ctx["nvme_dir"]
    os.makedirs(base, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix=f"gpu_check_r{rank}_") as path:
        nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": path},
                "offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": 4,
                                  "buffer_size": max(4096, sz["bucket"])}}
        for opt_name in ("sgd",) if ctx["quick"] else ("sgd", "adamw"):
            name = f"gpt z3 nvme optimizer+param {opt_name}"
            try:
                got, losses, engine = train_zs("gpt", zs_config("gpt", 3, opt_name, "fp32", sz, nvme), sz, rank, world)
                dev, mem = engine.device, engine.memory_stats()
                engine.close()
                del engine
                release(dev.type)
                if rank == 0:
                    init, ref = reference("gpt", opt_name, sz, world, dev)
                    verdict, value, detail = judge(got, init, ref, opt_name, "fp32")
                    ok = verdict == PASS and mem.get("tier_nvme", 0) > 0
                    rows.append(row("nvme", name, f"{ctx['form']} on {dev}", PASS if ok else FAIL, value,
                                    f"{detail}; tier_nvme {mem.get('tier_nvme', 0) / 2**20:.1f} MiB under {base}"))
            except Exception as exc:
                rows.append(row("nvme", name, ctx["form"], FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                                trace=traceback.format_exc()[-2000:]))
    return rows


def section_actoffload(ctx):
    """zeroshard.checkpoint_activations over every block, inputs offloaded to the host."""
    import copy

    import torch
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    import zeroshard
    from zeroshard.offload import activations
    from zeroshard.partition import MemoryLedger
    from zeroshard.policies import ActivationOffloadPolicy, OffloadDevice

    sz, dev = ctx["sz"], the_device(ctx)
    form = f"{ctx['form']} on {dev}"
    ref = make_model("gpt", sz).to(dev)
    model = copy.deepcopy(ref)

    def forward(m, impl, x, y):
        pos = torch.arange(x.size(1), device=x.device)
        h = m.wte(x) + m.wpe(pos)
        for block in m.h:
            h = torch_checkpoint(block, h, use_reentrant=False) if impl == "torch" else \
                zeroshard.checkpoint_activations(block, h, use_reentrant=False)
        logits = m.lm_head(m.ln_f(h))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    def grads(m, impl, x, y):
        m.zero_grad(set_to_none=True)
        forward(m, impl, x, y).backward()
        return {n: p.grad.detach().float().clone() for n, p in m.named_parameters()}

    try:
        policy = ActivationOffloadPolicy(device=OffloadDevice("cpu"), nvme_path="", buffer_count=2)
        store = activations.configure(activations.ActivationOffload(policy, ledger=MemoryLedger()))
        worst = 0.0
        for x, y in batches("gpt", sz, 1, 2):
            x, y = x.to(dev), y.to(dev)
            want, got = grads(ref, "torch", x, y), grads(model, "zeroshard", x, y)
            worst = max(worst, max(float((want[n] - got[n]).abs().max()) / (float(want[n].abs().max()) or 1.0)
                                   for n in want))
        n_layer = sz["gpt"]["n_layer"]
        ok = worst <= 1e-6 and store.packed == 2 * n_layer
        detail = f"packed {store.packed} (want {2 * n_layer})"
        if dev.type == "cuda":  # read ahead of backward on the side stream: all but the first of each pass
            ok = ok and store.hits == 2 * (n_layer - 1)
            detail += f", read-ahead hits {store.hits} misses {store.misses} (want {2 * (n_layer - 1)} hits)"
        return [row("actoffload", "gpt checkpoint_activations, offload cpu", form, PASS if ok else FAIL,
                    f"max {worst:.1e} x largest", detail + "; bound 1e-6")]
    except Exception as exc:
        return [row("actoffload", "gpt checkpoint_activations, offload cpu", form, FAIL, "raised",
                    f"{type(exc).__name__}: {exc}"[:300], trace=traceback.format_exc()[-2000:])]
    finally:
        activations.reset()


def section_memory(ctx):
    import torch

    from zeroshard.estimate import Strategy, estimate_memory, shape_from_params
    from zeroshard.estimate.padding import plan_layout

    rows, sz = [], ctx["sz"]
    cuda = ctx["device"] == "cuda"
    for stage in (0, 1, 2, 3):
        name = f"gpt z{stage} fp32 adamw"
        try:
            release(ctx["device"])
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            cfg = zs_config("gpt", stage, "adamw", "fp32", sz)
            _, _, engine = train_zs("gpt", cfg, sz, 0, 1)
            dev, mem = engine.device, engine.memory_stats()
            trainable = [b.layout.numel for b in engine.buckets]
            model = engine.module
            numels = [p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values()]
            at_rest = torch.cuda.memory_allocated() - before if cuda else None
            peak = torch.cuda.max_memory_allocated() - before if cuda else None
            stats_peak = torch.cuda.memory_stats().get("allocated_bytes.all.peak", 0) - before if cuda else None
            engine.close()
            del engine, model
            strategy = Strategy(stage=stage, precision="fp32", optimizer="adamw",
                                reduce_bucket_size=sz["bucket"], allgather_bucket_size=sz["bucket"])
            if stage == 3:  # units: the layout follows the engine's buckets, not a size rule
                shape = shape_from_params(sum(trainable))
                est = estimate_memory(shape, strategy, 1)
            else:
                est = estimate_memory(shape_from_params(sum(numels)), strategy, 1,
                                      layout=plan_layout(numels, stage, "fp32", 1, sz["bucket"]))
            ledger_rest = mem["tier_device"]
            err = abs(est.device_at_rest - ledger_rest) / max(ledger_rest, 1)
            ok = err <= 0.05
            value = f"ledger {ledger_rest / 2**20:.1f} MiB, estimator {est.device_at_rest / 2**20:.1f} MiB"
            detail = f"estimator at rest within {err:.1%} of the ledger (bound 5 %)"
            data = {"ledger": mem, "estimate_at_rest": est.device_at_rest, "estimate_total": est.device_total}
            if cuda:
                gap = abs(at_rest - ledger_rest)
                ok_rest = gap <= 0.10 * ledger_rest + 16 * 2**20
                ok_peak = stats_peak == peak and peak >= mem["peak_model_states"]
                ok = ok and ok_rest and ok_peak
                value += (f"; cuda at rest {at_rest / 2**20:.1f} MiB, max_memory_allocated {peak / 2**20:.1f} MiB, "
                          f"memory_stats peak {stats_peak / 2**20:.1f} MiB, "
                          f"estimator total {est.device_total / 2**20:.1f} MiB")
                detail += (f"; cuda at rest vs ledger {gap / 2**20:.1f} MiB apart (bound 10 % + 16 MiB); "
                           f"max_memory_allocated == memory_stats peak >= ledger peak model states")
                data.update(cuda_at_rest=at_rest, cuda_peak=peak, cuda_stats_peak=stats_peak)
            rows.append(row("memory", name, f"{ctx['form']} on {dev}", PASS if ok else FAIL, value, detail, **data))
        except Exception as exc:
            rows.append(row("memory", name, ctx["form"], FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                            trace=traceback.format_exc()[-2000:]))
    return rows


def section_speed(ctx):
    rows, sz, dev = [], ctx["sz"], the_device(ctx)
    form = f"{ctx['form']} on {dev}"
    n_steps, warm = sz["speed_steps"], sz["speed_warmup"]
    data = batches("gpt", sz, 1, n_steps + warm)
    results = {}
    for system in ("ddp", "fsdp2", "zs2", "zs3", "deepspeed"):
        try:
            if system == "deepspeed" and dev.type != "cuda":
                rows.append(row("speed", system, form, SKIP, "", "DeepSpeed is compared on CUDA only"))
                continue
            runner = build_system(system, sz, dev)
            if runner is None:
                rows.append(row("speed", system, form, SKIP, "", "deepspeed does not import"))
                continue
            losses, times = timed_steps(runner, data, dev)
            times = times[warm:]
            if getattr(runner, "engine", None) is not None:
                runner.engine.close()
            del runner
            release(dev.type)
            times.sort()
            med = times[len(times) // 2]
            results[system] = (losses, med)
        except Exception as exc:  # DeepSpeed is a guest here: its failure to start is reported, not judged
            rows.append(row("speed", system, form, INFO if system == "deepspeed" else FAIL, "raised",
                            f"{type(exc).__name__}: {exc}"[:300], trace=traceback.format_exc()[-2000:]))
    base = results.get("ddp", ([float("nan")], 0))[0][0]
    tokens = sz["micro"] * sz["seq"]
    for system, (losses, med) in results.items():
        finite = all(math.isfinite(v) for v in losses)
        rel = abs(losses[0] - base) / abs(base) if math.isfinite(base) and base else float("nan")
        ok = finite and rel <= 0.02
        rows.append(row("speed", system, form, PASS if ok else FAIL,
                        f"{med * 1e3:.1f} ms/step, {tokens / med:,.0f} tokens/s",
                        f"bf16; first loss {losses[0]:.4f} vs DDP {base:.4f} ({rel:.2%}, bound 2 %); "
                        f"median of {len(losses) - warm} steps", step_s=med, tokens_per_s=tokens / med, losses=losses))
    return rows


def timed_steps(step, data, dev, on_first=None) -> tuple[list[float], list[float]]:
    """(losses, seconds) of `step(x, y)` over the (x, y) batches of `data`, each step timed alone
    (the CUDA stream synchronized before and after it); `on_first()` runs after the first."""
    import torch

    losses, times = [], []
    for i, (x, y) in enumerate(data):
        x, y = x.to(dev), y.to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step(x, y))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if i == 0 and on_first is not None:
            on_first()
    return losses, times


def build_system(system, sz, dev):
    """A callable (x, y) -> loss float doing one bf16 training step of `system` on the 1-rank group
    (DDP and FSDP2: zeroshard.bench.peers' runner)."""
    model = make_model("gpt", sz)
    if system in ("zs2", "zs3"):
        import zeroshard

        engine = zeroshard.initialize(model, zs_config("gpt", int(system[-1]), "sgd", "bf16", sz))

        def step(x, y):
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            return float(loss.item())

        step.engine = engine
        return step
    if system == "ddp":
        from zeroshard.bench import peers

        model.to(dev)
        wrapped = peers.ddp(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        return peers.PeerRunner(model, wrapped, torch_opt("sgd", wrapped.parameters()), autocast=True).step
    if system == "fsdp2":
        from zeroshard.bench import peers

        model.to(dev)
        peers.fsdp2(model, [UNIT["gpt"]], bf16=True)  # param bf16, reduce fp32: no autocast
        return peers.PeerRunner(model, model, torch_opt("sgd", model.parameters()), autocast=False).step
    if system == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
        try:
            import deepspeed  # noqa: F401
        except Exception:
            return None
        from zeroshard.bench import peers

        cfg = {"train_micro_batch_size_per_gpu": sz["micro"], "gradient_accumulation_steps": 1,
               "gradient_clipping": 0.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 2, "reduce_bucket_size": sz["bucket"]},
               "zero_allow_untested_optimizer": True}  # a client torch optimizer under ZeRO
        engine, opt = peers.deepspeed_engine(model, cfg, torch_opt("sgd", model.parameters()))
        return peers.DeepSpeedRunner(model, engine, opt, autocast=False).step
    raise ValueError(system)


def section_compile(ctx):
    """Issue 44 on the device: each system eager, then compiled: the plain model with every Block
    compiled in place (what inductor gives without zeroshard), zeroshard stages 2 and 3 through
    `engine.compile()` (each unit compiled in place, the hooks eager around it). bf16, SGD, the
    speed section's model and steps. Verdict of a compiled row: finite losses, its first loss
    within 1 % of the eager run's (same weights, same batch), no graph break inside a region, no
    graph compiled after the first step, and on CUDA a median step below the eager run's (issue
    44's "faster than eager"; on a CPU inductor is not faster even on the plain model: shown, not
    judged). The quick form compiles with aot_eager (no code generation) and runs stage 3 only."""
    import torch
    from torch._dynamo.utils import counters

    rows, sz, dev = [], ctx["sz"], the_device(ctx)
    form = f"{ctx['form']} on {dev}"
    backend = "aot_eager" if ctx["quick"] else "inductor"
    n_steps, warm = sz["speed_steps"], sz["speed_warmup"]
    data = batches("gpt", sz, 1, n_steps + warm)
    results = {}
    for system in (("zs3",) if ctx["quick"] else ("plain", "zs2", "zs3")):
        for compiled in (False, True):
            name = system + (f" + compile ({backend})" if compiled else " eager")
            try:
                torch._dynamo.reset()
                counters.clear()
                step, engine = compile_runner(system, compiled, backend, sz, dev)
                graphs = []  # unique graphs after the first step
                losses, times = timed_steps(step, data, dev,
                                            on_first=lambda: graphs.append(counters["stats"]["unique_graphs"]))
                graphs_first = graphs[0]
                report = getattr(engine, "compiled", None) if engine is not None else None
                results[(system, compiled)] = {
                    "losses": losses, "median": sorted(times[warm:])[len(times[warm:]) // 2], "first_s": times[0],
                    "graphs_first": graphs_first, "graphs_end": counters["stats"]["unique_graphs"],
                    "breaks": sum(counters["graph_break"].values()), "noted": dict(report.breaks) if report else {}}
                if engine is not None:
                    engine.close()
                del step, engine
                release(dev.type)
            except Exception as exc:
                rows.append(row("compile", name, form, FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                                trace=traceback.format_exc()[-2000:]))
    for (system, compiled), r in results.items():
        name = system + (f" + compile ({backend})" if compiled else " eager")
        value = f"{r['median'] * 1e3:.1f} ms/step, first step {r['first_s']:.2f} s"
        eager = results.get((system, False))
        if not compiled or eager is None:
            rows.append(row("compile", name, form, INFO, value, f"median of {n_steps} steps", **r))
            continue
        verdict, detail, ratio = compile_verdict(r, eager, system != "plain",
                                                 judged_speed=dev.type == "cuda" and backend == "inductor")
        rows.append(row("compile", name, form, verdict, value, detail, ratio_to_eager=ratio, **r))
    return rows


def compile_verdict(r: dict, eager: dict, regions_whole: bool, judged_speed: bool) -> tuple[str, str, float]:
    """(verdict, detail, compiled / eager median) of one compiled run of section_compile against its
    eager run; `regions_whole`: zeroshard's regions, where a graph break is a failure."""
    first_rel = abs(r["losses"][0] - eager["losses"][0]) / max(abs(eager["losses"][0]), 1e-12)
    problems = []
    if not all(math.isfinite(v) for v in r["losses"]):
        problems.append("non-finite loss")
    if first_rel > 0.01:
        problems.append(f"first loss {first_rel:.2%} off the eager run's (bound 1 %)")
    if r["graphs_first"] == 0:
        problems.append("nothing was compiled")
    if r["graphs_end"] != r["graphs_first"]:
        problems.append(f"recompiled after step 1: {r['graphs_first']} -> {r['graphs_end']} graphs")
    if regions_whole and (r["breaks"] or r["noted"]):
        problems.append(f"graph breaks: {r['breaks']} {r['noted']}")
    ratio = r["median"] / eager["median"]
    if judged_speed and ratio >= 1.0:
        problems.append(f"not faster than eager ({ratio:.3f}x)")
    detail = (f"{ratio:.3f}x the eager step ({'judged' if judged_speed else 'shown, not judged, on this device'}); "
              f"{r['graphs_first']} graphs after step 1, {r['graphs_end']} at the end; first loss {first_rel:.2e} "
              "off eager")
    return (FAIL if problems else PASS), "; ".join(problems) or detail, ratio


def compile_runner(system, compiled, backend, sz, dev):
    """(step (x, y) -> loss float, the engine or None) for one bf16 SGD system of section_compile."""
    model = make_model("gpt", sz)
    if system == "plain":
        from zeroshard.bench import peers

        model.to(dev)
        if compiled:
            for m in model.modules():
                if type(m).__name__ == UNIT["gpt"]:
                    m.compile(backend=backend)
        return peers.PeerRunner(model, model, torch_opt("sgd", model.parameters()), autocast=True).step, None
    import zeroshard

    engine = zeroshard.initialize(model, zs_config("gpt", int(system[-1]), "sgd", "bf16", sz))
    if compiled:
        engine.compile(backend=backend)

    def step(x, y):
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.item())

    return step, engine


def section_zeropp(ctx):
    import torch

    from zeroshard.comm import dequantize, plan_blocks, quantize

    rows, sz, dev = [], ctx["sz"], the_device(ctx)
    form = f"{ctx['form']} on {dev}"
    n = sz["quant_elems"]
    g = torch.Generator(device="cpu").manual_seed(5)
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)]).to(dev)
    for label, bits, dtype in (("qwZ int8 bf16", 8, torch.bfloat16), ("qwZ int8 fp32", 8, torch.float32),
                               ("qgZ int4 fp32", 4, torch.float32)):
        try:
            v = x.to(dtype)
            blocks = plan_blocks(n, bits)
            reps = 3 if ctx["quick"] else 20
            out = dequantize(*quantize(v, blocks), blocks)  # warm-up, and the values judged
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                payload, scales = quantize(v, blocks)
                dequantize(payload, scales, blocks)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / reps
            ref = v.float().view(-1)
            pad = blocks.padded - n
            full = torch.cat([ref, ref.new_zeros(pad)]).view(blocks.count, blocks.size)
            half_step = (full.abs().amax(dim=1) / {8: 127, 4: 7}[bits] / 2).repeat_interleave(blocks.size)[:n]
            # half a step, plus the fp32 rounding of scale x q (a few ulps of the value)
            over = float(((out.view(-1) - ref).abs() - half_step * (1 + 1e-6) - 2.0**-21 * ref.abs()).max())
            ok = over <= 0
            gbs = n * v.element_size() / dt / 1e9
            rows.append(row("zeropp", f"{label} quantize+dequantize", form, PASS if ok else FAIL,
                            f"{gbs:.2f} GB/s of input ({n:,} elements, {dt * 1e3:.2f} ms)",
                            "every element within half a step of its block" if ok else f"over the bound by {over:.3g}",
                            gb_per_s=gbs))
        except Exception as exc:
            rows.append(row("zeropp", label, form, FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                            trace=traceback.format_exc()[-2000:]))
    return rows


def section_zeropp_engine(ctx):
    """qwZ + qgZ at stage 3 on 2 ranks: quantization needs peers (one rank sends nothing, and one
    GPU holds one NCCL rank), so this runs in the 2-rank gloo form, on the device zeroshard gives it."""
    import torch

    rows, sz, rank, world = [], ctx["sz"], ctx["rank"], ctx["world"]
    name = "gpt z3 qwZ+qgZ sgd"
    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    try:
        # each rank a node of its own (torchrun's variables say so): qwZ quantizes the inter-node gather
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
        zero = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
        got, losses, engine = train_zs("gpt", zs_config("gpt", 3, "sgd", "fp32", sz, zero), sz, rank, world, "gpt2r")
        devz = engine.device
        comm = engine.gpu_check_comm
        engine.close()
        del engine
        release(devz.type)
        if rank == 0:
            init, ref = reference("gpt", "sgd", sz, world, devz, "gpt2r")
            # tests/test_zeropp.py's measure: SGD's update is linear in the gradient, so the least-squares
            # scale of the update against one process's shows a wrong sum or mean (2 on 2 ranks) and
            # rounding is noise around 1 (int4 gradients: drift up to 50 % of the distance moved)
            want = torch.cat([(ref[k] - init[k]).flatten() for k in ref])
            moved = torch.cat([(got[k] - init[k]).flatten() for k in ref])
            scale = float(moved @ want / (want @ want))
            drift = float((moved - want).norm() / want.norm())
            ag = comm["all_gather"]
            wire = ag["bytes"] / max(4 * ag["elements"], 1)  # qwZ: int8 payload + scales of fp32 values
            a2a = comm["all_to_all"]["calls"]  # qgZ: the quantized gradient all-to-all
            ok = (all(math.isfinite(v) for v in losses) and abs(scale - 1) <= 0.1 and drift <= 0.5
                  and wire <= 0.35 and a2a > 0)
            rows.append(row("zeropp", name, f"{ctx['form']} on {devz}", PASS if ok else FAIL,
                            f"update scale {scale:.3f}, drift {drift:.0%}; gather {wire:.2f} x fp32 bytes; "
                            f"{a2a} all-to-alls", "bounds: |scale - 1| <= 0.1, drift <= 50 %, <= 0.35 x, > 0",
                            comm=comm))
    except Exception as exc:
        rows.append(row("zeropp", name, ctx["form"], FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                        trace=traceback.format_exc()[-2000:]))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def section_nccl(ctx):
    """Does zeroshard's Handle.wait() block the host on NCCL? It passes a timeout to work.wait(), and
    torch's WorkNCCL::wait blocks the CPU thread until the collective completes whenever a timeout
    is given (ProcessGroupNCCL.cpp: `if (blockingWait_ || timeout != kNoTimeout)`), where a plain
    wait() only makes the current stream wait. zeroshard issues no collective on one rank, so the
    probe wraps a 1-rank NCCL all-reduce queued behind ~0.2 s of matmuls in zeroshard's Handle."""
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.comm import Handle

    dev = the_device(ctx)
    form = f"{ctx['form']} on {dev}"
    name = "Handle.wait does not block the host"
    cuda = dev.type == "cuda"
    try:
        cfg = zs_config("gpt", 0, "sgd", "fp32", ctx["sz"])
        engine = zeroshard.initialize(make_model("gpt", ctx["sz"], "gpt2r"), cfg)
        comm = engine.comm
        side = 4096 if cuda else 128  # on the CPU the same calls run, on a token backlog
        a = torch.randn(side, side, device=dev)
        b = torch.empty_like(a)
        t = torch.ones(1 << 20 if cuda else 1 << 10, device=dev)

        def probe(wait):
            if cuda:
                torch.cuda.synchronize()
            for _ in range(100 if cuda else 2):  # ~0.2 s of GPU work queued ahead of the collective
                torch.mm(a, a, out=b)
            work = dist.all_reduce(t, async_op=True)
            t0 = time.perf_counter()
            wait(work)
            host = time.perf_counter() - t0
            if cuda:
                torch.cuda.synchronize()
            return host, time.perf_counter() - t0

        def zeroshard_wait(work):
            totals = comm.ledger.record("all_reduce", t.dtype, t.numel(), 1, comm.scope, None)
            Handle(comm, work, "gpu_check probe", totals, time.perf_counter()).wait()

        probe(lambda w: w.wait())  # warm-up: cuBLAS and NCCL kernels loaded
        plain_host, plain_total = probe(lambda w: w.wait())
        zs_host, zs_total = probe(zeroshard_wait)
        engine.close()
        ok = zs_host <= 0.2 * zs_total
        if not cuda:  # on gloo the host does the collective: its wait is the work
            return [row("nccl", name, form, SKIP, f"host {zs_host * 1e3:.1f} ms",
                        "CUDA only (the probe's calls ran: Handle over a gloo work)")]
        return [row("nccl", name, form, PASS if ok else FAIL,
                    f"host blocked {zs_host * 1e3:.0f} of {zs_total * 1e3:.0f} ms (plain wait(): "
                    f"{plain_host * 1e3:.1f} of {plain_total * 1e3:.0f} ms)",
                    "bound: <= 20 % of the GPU backlog; a blocked host cannot queue the next kernels "
                    "(fix: no timeout to work.wait() on NCCL, whose watchdog enforces the group's timeout)")]
    except Exception as exc:
        return [row("nccl", name, form, FAIL, "raised", f"{type(exc).__name__}: {exc}"[:300],
                    trace=traceback.format_exc()[-2000:])]


SECTIONS_1 = {"oracle": section_oracle, "nccl": section_nccl, "offload": section_offload, "nvme": section_nvme,
              "actoffload": section_actoffload, "memory": section_memory, "speed": section_speed,
              "compile": section_compile, "zeropp": section_zeropp}
SECTIONS_2 = {"gloo": section_gloo, "oracle": section_oracle, "zeropp": section_zeropp_engine}
ALL_SECTIONS = ("oracle", "gloo", "nccl", "offload", "nvme", "actoffload", "memory", "speed", "compile", "zeropp")


# --------------------------------------------------------------------------------------------------
# the ranks


def _ranks_main(rank, world, spec):
    """One rank: its default group (NCCL for the CUDA 1-rank form, else gloo), then each section."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's 1e-5 needs fp32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if (device == "cuda" and world == 1) else "gloo"
    kw = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec["timeout"]), **kw)
    form = f"{world} rank{'s' if world > 1 else ''} {backend}"
    ctx = {**spec, "rank": rank, "world": world, "form": form}
    table = SECTIONS_1 if world == 1 else SECTIONS_2
    rows = []
    for name in spec["sections"]:
        if name in table:
            t0 = time.perf_counter()
            got = table[name](ctx)
            for r in got:
                r["data"]["section_s"] = round(time.perf_counter() - t0, 2)
            rows.extend(got)
    return rows if rank == 0 else []


def run_form(world, spec, out, key):
    from zeroshard.bench.ranks import run_ranks

    t0 = time.perf_counter()
    try:
        out[key] = run_ranks(_ranks_main, world, spec, timeout=spec["timeout"])[0]
    except Exception as exc:  # a hang (timeout) or a crashed rank: one failed row for the whole form
        out[key] = [row("run", f"{world}-rank form", f"{world} rank(s)", FAIL, "did not finish",
                        str(exc)[-1500:])]
    out[key + "_s"] = time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# the table


def render(rows) -> str:
    cols = ("section", "name", "form", "verdict", "value")
    width = {c: min(max([len(c)] + [len(str(r[c])) for r in rows]), 90) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    for r in rows:
        lines.append("  ".join(str(r[c])[:90].ljust(width[c]) for c in cols))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps (the test suite's smoke form)")
    ap.add_argument("--only", default=",".join(ALL_SECTIONS),
                    help=f"comma-separated sections (default all: {','.join(ALL_SECTIONS)})")
    ap.add_argument("--json", default=None, help="where the JSON goes (default bench/gpu_check-<device>.json)")
    ap.add_argument("--nvme-dir", default=None, help="a folder on the disk for the NVMe files (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per process form (default 470 on cuda, 600 on a shared CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    ap.add_argument("--verbose", action="store_true", help="print each failed row's detail and traceback")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in ALL_SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {','.join(ALL_SECTIONS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: --device cuda but torch.cuda.is_available() is False here; "
                  "run with --device cpu for the smoke form", file=sys.stderr)
            return 2
    started = time.perf_counter()
    sz = sizes(args.device, args.quick)
    cores = os.cpu_count() or 2
    timeout = args.timeout or (470 if args.device == "cuda" else 600)
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="zeroshard_gpu_check_")
    spec = {"device": args.device, "quick": args.quick, "sz": sz, "timeout": timeout, "nvme_dir": nvme_dir,
            "sections": sections}
    out: dict = {}
    forms = []
    if any(s in SECTIONS_1 for s in sections):
        forms.append((1, {**spec, "threads": args.threads or max(1, min(8, cores - 2))}, "one"))
    if any(s in SECTIONS_2 for s in sections):
        two_threads = max(1, min(4, (cores - 10) // 2)) if args.device == "cuda" else 1
        forms.append((2, {**spec, "threads": args.threads or two_threads}, "two"))
    # the two forms at once: the 1-rank form holds the GPU, the 2-rank gloo form mostly the CPU
    threads = [threading.Thread(target=run_form, args=(w, s, out, k)) for w, s, k in forms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import torch  # here, not before: on CPU the parent's import would compete with the ranks' own

    rows = [r for _, _, k in forms for r in out[k]]
    order = {s: i for i, s in enumerate(("run",) + ALL_SECTIONS)}
    rows.sort(key=lambda r: order.get(r["section"], 99))
    wall = time.perf_counter() - started
    failed = [r for r in rows if r["verdict"] == FAIL]
    if not args.nvme_dir:
        import shutil

        shutil.rmtree(nvme_dir, ignore_errors=True)
    env = {"torch": torch.__version__, "device": args.device, "quick": args.quick,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "wall_s": round(wall, 1), "forms_s": {k: round(out.get(k + "_s", 0), 1) for _, _, k in forms}}
    print(f"zeroshard gpu_check: device {args.device}{' (quick)' if args.quick else ''}, torch {torch.__version__}"
          + (f", {env['gpu']}, CUDA {env['cuda']}" if env["gpu"] else ""))
    print(render(rows))
    counts = {v: sum(r["verdict"] == v for r in rows) for v in (PASS, FAIL, SKIP, INFO)}
    print(f"{counts[PASS]} pass, {counts[FAIL]} fail, {counts[SKIP]} skipped, {counts[INFO]} info "
          f"in {wall:.0f} s ({', '.join(f'{k}-rank form {v} s' for k, v in env['forms_s'].items())})")
    for r in failed:
        print(f"FAIL {r['section']} / {r['name']} ({r['form']}): {r['value']}; {r['detail']}")
        if args.verbose and r["data"].get("trace"):
            print(r["data"]["trace"])
    path = args.json or str(ROOT / "bench" / f"gpu_check-{args.device}.json")
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
    print(f"json: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
