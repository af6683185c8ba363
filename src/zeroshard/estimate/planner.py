"""The advisor: which stage, which offload, which ZeRO++ knobs, and why.

Decision route: tiers of candidates, cheapest knobs first; a tier is tried only when
nothing in the tiers before it fits with margin (a fit above 1 - TIGHT_MARGIN of usable
memory is taken only when nothing fits with margin anywhere), and in the first tier that
fits the fastest predicted candidate wins, unless a lower stage is within SPEED_TRADE of it
(then the lowest such stage; ties within TIE_SECONDS: the earlier one):
1. no offload, no activation checkpointing (stages 0-3; stages 1 and 2 cost no more
   communication than stage 0, stage 3 costs 1.5x);
2. the same with activation checkpointing (a third more compute, no traffic);
3. optimizer offload to host (stages 1, 2, 3), then 4. the same with checkpointing;
5. optimizer and parameter offload (stage 3), then 6. with checkpointing: parameter offload
   pays PCIe for every unit in forward and backward, so it comes only when the cheaper
   knobs (a lower stage, checkpointing) fit nowhere ("use ZeRO-2 where it serves; offload
   only when nothing else fits");
7. NVMe offload (ZeRO-Infinity), optimizer then parameters;
8. fits nowhere: the smallest cluster of the same GPUs that fits.
Candidates of later tiers that also fit are listed in the route with their predicted step
time, so the choice is explained (a later one predicted faster is said so, and why the
route still prefers the cheaper knob). When the winner is stage 3 on several nodes and
inter-node traffic takes at least INTER_NODE_BOTTLENECK_FRACTION of the step, ZeRO++
variants are tried and the fastest one that fits wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zeroshard.policies import HIDDEN_SIZE_AUTO, AioPolicy, LossScalePolicy, OffloadDevice, Precision, Stage

from zeroshard.estimate.byte_units import GIB
from zeroshard.estimate.candidate import Candidate, Workload, evaluate
from zeroshard.estimate.hardware import Cluster
from zeroshard.estimate.model_size import ModelShape
from zeroshard.estimate.strategy import Strategy

__all__ = ["Workload", "Candidate", "Plan", "evaluate", "plan", "candidate_strategies", "smallest_cluster",
           "deepspeed_config", "bucket_sizes", "strategy_for", "INTER_NODE_BOTTLENECK_FRACTION", "ZEROPP_MIN_GAIN",
           "MAX_NODES"]

INTER_NODE_BOTTLENECK_FRACTION = 0.25  # inter-node comm time / step time that calls for ZeRO++
ZEROPP_MIN_GAIN = 0.02  # ZeRO++ must shorten the step by this fraction to be worth its quantization noise
MAX_NODES = 65_536  # where the search for a cluster that fits gives up
MAX_GPUS_PER_NODE = 8
TIE_SECONDS = 0.0005  # step times closer than this are a tie: the earlier candidate of the route wins
# A lower stage is kept unless a higher one is predicted more than this much faster (the time
# model's terms are not validated to a few per cent on GPUs): less state moved for a small cost.
SPEED_TRADE = 0.05
TIGHT_MARGIN = 0.05  # a fit above 95 % of usable device memory is tight: taken only when nothing fits with margin
# Optimizer sub-group for NVMe offload: 1e8 fp32 elements = 400 MB per swap buffer; DeepSpeed's
# 1e9 default would pin 16 GB of host memory in its 4 buffers.
NVME_SUB_GROUP_SIZE = 100_000_000


N, C, V = OffloadDevice.NONE, OffloadDevice.CPU, OffloadDevice.NVME
_ROUTE = (  # (stage, offload_optimizer, offload_param), grouped into tiers; each tier without then with AC
    ((0, N, N), (1, N, N), (2, N, N), (3, N, N)),
    ((1, C, N), (2, C, N), (3, C, N)),
    ((3, C, C),),  # parameter offload: only when a lower stage and checkpointing fit nowhere
    ((3, V, N), (3, V, C), (3, V, V)),
)


# With a frozen base (LoRA) the optimizer states are a few MB: offloading them buys almost
# nothing, while the base's parameters (2 bytes each) are what must leave the device. So the
# host tier adds stage 3 with only the parameters offloaded, and the NVMe tier offloads
# the parameters (the optimizer stays on the device or goes to the host).
_LORA_ROUTE = (
    ((0, N, N), (1, N, N), (2, N, N), (3, N, N)),
    ((1, C, N), (2, C, N), (3, C, N), (3, N, C), (3, C, C)),
    ((3, N, V), (3, C, V), (3, V, V)),
)


def _tier_name(tier: list[Strategy]) -> str:
    s = tier[0]
    if any(V in (t.offload_optimizer, t.offload_param) for t in tier):
        what = "NVMe offload"
    elif any(t.offload_param == C for t in tier) and all(t.offload_optimizer == C for t in tier):
        what = "optimizer and parameter offload to host"
    elif any(t.offload_param == C for t in tier):
        what = "offload to host (optimizer or frozen-base parameters)"
    elif s.offload_optimizer == C:
        what = "optimizer offload to host"
    else:
        what = "no offload"
    return what + (", activation checkpointing" if s.activation_checkpointing else "")


def candidate_strategies(work: Workload, hidden: int | None = None, frozen_base: bool = False) -> list[list[Strategy]]:
    """The route as tiers of strategies, each tier without then with checkpointing
    (`frozen_base`: the LoRA route, `_LORA_ROUTE`)."""
    ac_options = [work.activation_checkpointing] if work.activation_checkpointing is not None else [False, True]
    return [[strategy_for(work, hidden, st, oo, op, activation_checkpointing=ac) for st, oo, op in tier]
            for tier in (_LORA_ROUTE if frozen_base else _ROUTE) for ac in ac_options]


def strategy_for(work: Workload, hidden: int | None, stage: int, offload_optimizer, offload_param, **kw) -> Strategy:
    """A strategy for `work`: its precision and optimizer, the "auto" bucket sizes of `hidden`
    (`bucket_sizes`), and NVME_SUB_GROUP_SIZE when anything goes to NVMe."""
    nvme = {"sub_group_size": NVME_SUB_GROUP_SIZE} if V in (offload_optimizer, offload_param) else {}
    return Strategy(stage=Stage(stage), precision=work.precision, optimizer=work.optimizer,
                    optimizer_bytes=work.optimizer_bytes, host_is_device=work.host_is_device,
                    grads_to_host=work.grads_to_host, offload_optimizer=offload_optimizer,
                    offload_param=offload_param, **bucket_sizes(hidden), **nvme, **kw)


def bucket_sizes(hidden: int | None) -> dict:
    """The bucket sizes Hugging Face's "auto" gives a model of hidden size `hidden` (h^2, 0.9 h^2:
    `policies.HIDDEN_SIZE_AUTO`, which the config loader fills "auto" with too)."""
    if not hidden:
        return {}
    return {key: HIDDEN_SIZE_AUTO[key](hidden) for key in ("reduce_bucket_size", "prefetch_bucket_size")}


@dataclass
class Plan:
    shape: ModelShape
    cluster: Cluster
    work: Workload
    candidates: list[Candidate] = field(default_factory=list)
    winner: Candidate | None = None
    route: list[str] = field(default_factory=list)
    smallest_fit: tuple[Cluster, Candidate] | None = None  # when nothing fits as given

    def as_dict(self) -> dict:
        d = {"model": {"params": self.shape.params, "largest_unit": self.shape.largest_unit,
                       "layers": self.shape.layers, "hidden": self.shape.hidden, "source": self.shape.source},
             "cluster": {"nodes": self.cluster.nodes, "gpus_per_node": self.cluster.gpus_per_node,
                         "gpu": self.cluster.gpu.name, "gpu_memory": self.cluster.gpu.memory},
             "route": self.route, "candidates": [c.as_dict() for c in self.candidates],
             "winner": self.winner.as_dict() if self.winner else None, "smallest_cluster": None}
        if self.smallest_fit:
            cl, cand = self.smallest_fit
            d["smallest_cluster"] = {"nodes": cl.nodes, "gpus_per_node": cl.gpus_per_node,
                                     "candidate": cand.as_dict()}
        if self.winner:
            d["deepspeed_config"] = deepspeed_config(self.winner.strategy, self.work, self.cluster)
        return d


def _tight(c: Candidate) -> bool:
    """A fit that uses more than 1 - TIGHT_MARGIN of the usable device memory: it rests on the
    transient-buffer figures, which docs/estimate.md calls not validated at stage 3."""
    return c.memory.device_total > (1 - TIGHT_MARGIN) * c.device_budget


def _pick(fits: list[Candidate], lora: bool) -> Candidate:
    """The choice among fits of one tier: the fastest predicted; without a frozen base, the
    lowest stage (first in the route) whose step is within SPEED_TRADE of the fastest."""
    fastest = min(fits, key=lambda c: c.time.step)
    if lora:
        return next(c for c in fits if c.time.step <= fastest.time.step + TIE_SECONDS)
    return next(c for c in fits if c.time.step <= fastest.time.step * (1 + SPEED_TRADE) + TIE_SECONDS)


def _first_fit_tier(shape, cluster, work, record: list | None = None) -> tuple[Candidate | None, int]:
    """(winner, index of its tier): the first tier of the route with a fit that has margin
    (not _tight), else the first with any fit; within it, _pick. The whole tier is evaluated
    (and recorded)."""
    lora = shape.frozen_params > 0
    tiers = [[evaluate(shape, s, cluster, work) for s in tier]
             for tier in candidate_strategies(work, shape.hidden, frozen_base=lora)]
    for roomy_only in (True, False):
        for i, tier in enumerate(tiers):
            fits = [c for c in tier if c.fits and not (roomy_only and _tight(c))]
            if fits:
                if record is not None:
                    for t in tiers[: i + 1]:
                        record.extend(t)
                return _pick(fits, lora), i
    if record is not None:
        for t in tiers:
            record.extend(t)
    return None, -1


def _knobs(s: Strategy) -> set[str]:
    out = set()
    if s.activation_checkpointing:
        out.add("activation checkpointing")
    if s.offload_optimizer != N:
        out.add("optimizer offload")
    if s.offload_param != N:
        out.add("parameter offload")
    if V in (s.offload_optimizer, s.offload_param):
        out.add("NVMe")
    return out


def _compare(c: Candidate, winner: Candidate) -> str:
    d = c.time.step - winner.time.step
    if abs(d) < TIE_SECONDS:
        return "same step time (within 1 ms)"
    if d > 0:
        return f"slower by {d * 1000:.0f} ms per step" if d < 0.1 else \
            f"slower: {c.time.step:.2f} s per step vs {winner.time.step:.2f} s"
    return f"predicted faster: {c.time.step:.2f} s per step vs {winner.time.step:.2f} s"


def plan(shape: ModelShape, cluster: Cluster, work: Workload) -> Plan:
    p = Plan(shape, cluster, work)
    winner, tier_index = _first_fit_tier(shape, cluster, work, p.candidates)
    if winner is None:
        p.route += [f"{c.label()}: rejected, {c.why_not()}" for c in p.candidates]
        p.route.append("nothing fits this cluster")
        p.smallest_fit = smallest_cluster(shape, cluster, work)
        return p
    lora = shape.frozen_params > 0
    tiers = candidate_strategies(work, shape.hidden, frozen_base=lora)
    tier_fits = [c for c in p.candidates if c.fits and c.strategy in tiers[tier_index]]
    fastest = min((c for c in tier_fits if not _tight(c)), key=lambda c: c.time.step, default=winner)
    if len(tier_fits) == 1:
        why = "the only fit"
    elif lora:
        why = "the fastest that fits"
    elif fastest is winner:
        why = "the fastest predicted step" + ("" if winner is tier_fits[0] else " among the fits")
    else:
        why = (f"the lowest stage within {SPEED_TRADE:.0%} of the fastest predicted step "
               f"({fastest.label()}, {fastest.time.step:.2f} s)")
    why += f" in the first tier of the route with a fit ({_tier_name(tiers[tier_index])})"
    if tier_index > 0:
        why += "; nothing fits with margin in the cheaper tiers before it" if any(
            c.fits for c in p.candidates if c.strategy not in tiers[tier_index]) else \
            "; nothing fits in the cheaper tiers before it"
    for c in p.candidates:
        if c is winner:
            tight = (f", tight: above {1 - TIGHT_MARGIN:.0%} of usable memory, resting on stage-3 transient "
                     "figures docs/estimate.md calls not validated; nothing fits with more margin"
                     if _tight(c) else "")
            p.route.append(f"{c.label()}: fits ({c.memory.device_total / GIB:.1f} of "
                           f"{c.device_budget / GIB:.1f} GiB usable per device{tight}); {why}")
        elif c.fits and _tight(c) and not _tight(winner):
            p.route.append(f"{c.label()}: fits only tightly ({c.memory.device_total / GIB:.1f} of "
                           f"{c.device_budget / GIB:.1f} GiB usable, above {1 - TIGHT_MARGIN:.0%}), and the "
                           "stage-3 transient figures it rests on are not validated: a fit with margin is preferred")
        elif c.fits and c.strategy in tiers[tier_index]:  # another fit in the winner's tier
            d = c.time.step - winner.time.step
            if abs(d) < TIE_SECONDS:
                verdict = "same step time (within 1 ms), the earlier in the route wins"
            elif lora or d > 0:
                verdict = _compare(c, winner)
                if not lora and c.strategy.stage < winner.strategy.stage:  # the lower stage it traded
                    verdict += (f" (+{d / winner.time.step:.0%}, more than the {SPEED_TRADE:.0%} a lower stage "
                                "may cost)")
            else:  # a higher stage predicted faster, by at most SPEED_TRADE
                traffic = (f"; ZeRO-{int(winner.strategy.stage)} also sends less ({winner.comm.paper_units:.1f} Φ "
                           f"vs {c.comm.paper_units:.1f} Φ)" if winner.comm.paper_units < c.comm.paper_units else "")
                verdict = (f"{_compare(c, winner)} ({-d / winner.time.step:.0%}), within {SPEED_TRADE:.0%}: the "
                           f"lower stage is kept{traffic}")
            p.route.append(f"{c.label()}: fits ({c.memory.device_total / GIB:.1f} GiB per device), {verdict}")
        elif c.fits:  # an earlier tier's tight fit (the winner has margin)
            p.route.append(f"{c.label()}: fits ({c.memory.device_total / GIB:.1f} GiB per device)")
        else:
            p.route.append(f"{c.label()}: rejected, {c.why_not()}")
    # When the winner needed a knob (checkpointing, offload): the fastest fit of each later tier,
    # and why the route does not take it. (A winner of the first tier needs nothing.)
    seen = {c.label() for c in p.candidates}
    later = []
    for tier in (tiers[tier_index + 1:] if tier_index > 0 else ()):
        fits = [c for c in (evaluate(shape, st, cluster, work) for st in tier) if c.fits and c.label() not in seen]
        if fits:
            best = min(fits, key=lambda c: c.time.step)
            later.append(best)
            seen.add(best.label())
    for c in later:
        extra = sorted(_knobs(c.strategy) - _knobs(winner.strategy)) or ["a later tier"]
        p.route.append(f"{c.label()}: also fits ({c.memory.device_total / GIB:.1f} GiB per device), "
                       f"{_compare(c, winner)}; it adds {' and '.join(extra)}, a later tier of the route, "
                       f"tried only when nothing fits in the earlier ones")
    s = winner.strategy
    if s.stage == Stage.PARAMETERS and not s.zeropp and cluster.nodes > 1:
        share = winner.time.comm_inter / winner.time.step
        if share >= INTER_NODE_BOTTLENECK_FRACTION:
            p.route.append(f"inter-node traffic takes {share:.0%} of the step (>= "
                           f"{INTER_NODE_BOTTLENECK_FRACTION:.0%}): trying ZeRO++")
            best, qwz_qgz = winner, replace(s, quantized_weights=True, quantized_gradients=True)
            hpz = [replace(qwz_qgz, hpz_partition_size=cluster.gpus_per_node)] if cluster.gpus_per_node > 1 else []
            for v in [qwz_qgz, *hpz]:
                c = evaluate(shape, v, cluster, work)
                p.candidates.append(c)
                verdict = f"step {c.time.step:.2f} s vs {best.time.step:.2f} s" if c.fits else c.why_not()
                p.route.append(f"{c.label()}: {verdict}")
                if c.fits and c.time.step < best.time.step * (1 - ZEROPP_MIN_GAIN):
                    best = c
            winner = best
        else:
            p.route.append(f"inter-node traffic is {share:.0%} of the step: ZeRO++ not needed")
    p.winner = winner
    p.route.append(f"winner: {winner.label()}, {winner.memory.device_total / GIB:.1f} GiB per device, "
                   f"{winner.time.step:.2f} s per step")
    p.candidates += later  # for comparison in the table
    # The other fitting candidates of the route, for the table.
    for tier in tiers:
        for st in tier:
            c = evaluate(shape, st, cluster, work)
            if c.label() not in seen and c.fits:
                p.candidates.append(c)
                seen.add(c.label())
    return p


def smallest_cluster(shape: ModelShape, cluster: Cluster, work: Workload) -> tuple[Cluster, Candidate] | None:
    """The fewest GPUs of the same kind on which some route candidate fits: more GPUs
    on the node first (up to MAX_GPUS_PER_NODE), then more nodes (binary search; the
    per-device need only falls as N grows)."""
    def fit(cl: Cluster) -> Candidate | None:  # the winner of the first tier with a fit
        return _first_fit_tier(shape, cl, work)[0]

    if cluster.nodes == 1:
        for g in range(cluster.gpus_per_node + 1, MAX_GPUS_PER_NODE + 1):
            cl = cluster.with_size(1, g)
            c = fit(cl)
            if c:
                return cl, c
    g = max(cluster.gpus_per_node, MAX_GPUS_PER_NODE if cluster.nodes == 1 else cluster.gpus_per_node)
    lo, hi = cluster.nodes, cluster.nodes * 2  # Cluster checks nodes >= 1
    while hi <= MAX_NODES and not fit(cluster.with_size(hi, g)):
        lo, hi = hi, hi * 2
    if hi > MAX_NODES:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fit(cluster.with_size(mid, g)):
            hi = mid
        else:
            lo = mid
    cl = cluster.with_size(hi, g)
    return cl, fit(cl)


def deepspeed_config(s: Strategy, work: Workload, cluster: Cluster, nvme_path: str = "/local_nvme") -> dict:
    """A DeepSpeed-style config dict (key names as in DeepSpeed 0.19) for the strategy."""
    zero: dict = {"stage": int(s.stage), "overlap_comm": s.overlap_comm, "contiguous_gradients": True,
                  "reduce_bucket_size": s.reduce_bucket_size}
    if s.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS):
        zero["allgather_bucket_size"] = s.reduce_bucket_size
    if s.stage == Stage.PARAMETERS:
        zero.update({"stage3_prefetch_bucket_size": s.prefetch_bucket_size,
                     "stage3_max_live_parameters": s.max_live_parameters,
                     "sub_group_size": s.sub_group_size})
    for key, dev in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
        if dev != OffloadDevice.NONE:
            block = {"device": dev.value, "pin_memory": True}
            if key == "offload_optimizer" and s.offload_ratio < 1.0:
                block["ratio"] = s.offload_ratio
            if dev == OffloadDevice.NVME:
                block["nvme_path"] = nvme_path
            zero[key] = block
    if s.quantized_weights:
        zero["zero_quantized_weights"] = True
    if s.hpz_partition_size > 1:
        zero["zero_hpz_partition_size"] = s.hpz_partition_size
    if s.quantized_gradients:
        zero["zero_quantized_gradients"] = True
    cfg: dict = {
        "train_batch_size": work.micro_batch * work.gradient_accumulation_steps * cluster.world_size,
        "train_micro_batch_size_per_gpu": work.micro_batch,
        "gradient_accumulation_steps": work.gradient_accumulation_steps,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    if s.precision == Precision.BF16:
        cfg["bf16"] = {"enabled": True}
    elif s.precision == Precision.FP16:
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": LossScalePolicy.initial_scale_power}
    if OffloadDevice.NVME in (s.offload_optimizer, s.offload_param):
        cfg["aio"] = {key: getattr(AioPolicy, key) for key in
                      ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")}
    if s.activation_checkpointing:
        # DeepSpeed's own block; the model must still wrap its layers in checkpoint().
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return cfg
