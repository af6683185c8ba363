"""`zeroshard bench --systems`: what each system name runs.

One entry per system. A zeroshard mode is its ZeRO stage and the `zero_optimization`
keys it adds to the shared config, so a new mode (NVMe, ZeRO++) is one line in
`SYSTEMS`; `{dir}` in a value is replaced by a scratch folder made for that run, and a
value `"{unit}"` by the element count of the model's largest stage-3 unit (a Block).
Peers (DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed) and the compute floor (`floor`: each
rank's own forward and backward with no collective at all, the optimizer over 1/N of the
parameters: the step time no sharded data-parallel system can beat on the machine) are named by
family and stage and built by `bench.peers`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEEPSPEED_BUCKET", "DEFAULT_SYSTEMS", "SYSTEMS", "BenchSystem", "deepspeed_problem", "resolve_systems"]

# Stage 3 as the ZeRO paper describes it (and as FSDP2's reshard_after_forward=True does):
# each unit released right after its forward and gathered again for its backward.
_PAPER_STAGE3 = {"stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}
# Stage 3 on FSDP2's schedule (bench/bench_stage3.py): prefetch one unit ahead, keep a unit that is
# reused within one unit (the last Block, from forward into backward); persistence left at 1e5.
_FSDP2_STAGE3 = {"stage3_prefetch_bucket_size": "{unit}", "stage3_max_reuse_distance": "{unit}"}
DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's reduce/allgather_bucket_size default (elements)


@dataclass(frozen=True)
class BenchSystem:
    name: str
    family: str  # "zeroshard" | "floor" | "ddp" | "zero1_torch" | "fsdp2" | "deepspeed"
    stage: int  # ZeRO stage (DDP 0, ZeroRedundancyOptimizer 1, FSDP2 3)
    description: str
    zero: dict[str, Any] = field(default_factory=dict)  # keys added to zero_optimization
    default: bool = False  # run when --systems is not given

    @property
    def offload(self) -> str | None:
        """The tier the optimizer states live on, when not the device."""
        return (self.zero.get("offload_optimizer") or {}).get("device")

    def zero_config(self, scratch: str, unit: int = 0) -> dict[str, Any]:
        """`zero_optimization` for this system, `{dir}` placeholders filled with `scratch`, a
        value `"{unit}"` replaced by `unit` (elements of one stage-3 unit)."""
        def fill(v):
            if isinstance(v, dict):
                return {k: fill(x) for k, x in v.items()}
            if v == "{unit}":
                return unit
            return v.replace("{dir}", scratch) if isinstance(v, str) else v
        return {"stage": self.stage, **fill(self.zero)}

    @property
    def needs_scratch(self) -> bool:
        return "{dir}" in repr(self.zero)

    def config(self, micro_batch: int, scratch: str = "", unit: int = 0, **extra: Any) -> dict[str, Any]:
        """The DeepSpeed-style config this system runs (zeroshard's and DeepSpeed's): one micro-batch
        per step, no gradient clipping, no step log, `extra` keys, then `zero_optimization`."""
        return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
                "steps_per_print": 10**9, "gradient_clipping": 0.0, **extra,
                "zero_optimization": self.zero_config(scratch, unit)}


def _zs(name: str, stage: int, description: str, default: bool = True, **zero) -> BenchSystem:
    return BenchSystem(name, "zeroshard", stage, description, zero, default)


SYSTEMS: dict[str, BenchSystem] = {s.name: s for s in (
    BenchSystem("floor", "floor", 0, "the compute floor: forward and backward with no collectives, AdamW(fused) over "
                "this rank's 1/N of the parameters, gradients kept in place (no system that shards data can be faster)",
                default=True),
    BenchSystem("ddp", "ddp", 0, "torch DistributedDataParallel, AdamW(fused)", default=True),
    BenchSystem("zero1_torch", "zero1_torch", 1, "DDP + torch ZeroRedundancyOptimizer(AdamW(fused))"),
    BenchSystem("fsdp2", "fsdp2", 3, "torch FSDP2: fully_shard on each layer and the root, AdamW(fused)",
                default=True),
    _zs("zs0", 0, "zeroshard stage 0 (plain data parallel)"),
    _zs("zs1", 1, "zeroshard stage 1 (optimizer states sharded)"),
    _zs("zs2", 2, "zeroshard stage 2 (+ gradients sharded)"),
    _zs("zs3", 3, "zeroshard stage 3 (+ parameters sharded; units released after use)", **_PAPER_STAGE3),
    _zs("zs2_offload", 2, "zeroshard stage 2, optimizer states on the host (offload_optimizer: cpu)",
        offload_optimizer={"device": "cpu"}),
    _zs("zs3_offload", 3, "zeroshard stage 3, optimizer states on the host (offload_optimizer: cpu)",
        offload_optimizer={"device": "cpu"}, **_PAPER_STAGE3),
    _zs("zs2_no_overlap", 2, "zeroshard stage 2 with overlap_comm: false", overlap_comm=False),
    _zs("zs2_no_contiguous", 2, "zeroshard stage 2 with contiguous_gradients: false",
        contiguous_gradients=False),
    _zs("zs3_defaults", 3, "zeroshard stage 3 with its own defaults for reuse and persistence", default=False),
    _zs("zs2_ds", 2, "zeroshard stage 2 with DeepSpeed's default buckets (5e8 elements: one bucket here)",
        default=False, reduce_bucket_size=DEEPSPEED_BUCKET, allgather_bucket_size=DEEPSPEED_BUCKET),
    _zs("zs3_fsdp2", 3, "zeroshard stage 3 on FSDP2's schedule: prefetch one unit, keep a unit reused within one",
        default=False, **_FSDP2_STAGE3),
    BenchSystem("ds0", "deepspeed", 0, "DeepSpeed stage 0, client AdamW(fused)"),
    BenchSystem("ds1", "deepspeed", 1, "DeepSpeed stage 1, client AdamW(fused)"),
    BenchSystem("ds2", "deepspeed", 2, "DeepSpeed stage 2 (its defaults), client AdamW(fused)", default=True),
    BenchSystem("ds3", "deepspeed", 3, "DeepSpeed stage 3 (its defaults), client AdamW(fused)", default=True),
    BenchSystem("ds2_offload", "deepspeed", 2, "DeepSpeed stage 2 + offload_optimizer cpu (DeepSpeedCPUAdam)",
                {"offload_optimizer": {"device": "cpu", "pin_memory": False}}),
    BenchSystem("ds3_offload", "deepspeed", 3, "DeepSpeed stage 3 + offload_optimizer cpu (DeepSpeedCPUAdam)",
                {"offload_optimizer": {"device": "cpu", "pin_memory": False}}),
)}

DEFAULT_SYSTEMS = tuple(name for name, s in SYSTEMS.items() if s.default)

@functools.cache
def deepspeed_problem() -> str | None:
    """Why DeepSpeed cannot be imported here (with DS_ACCELERATOR=cpu), or None. Imported in a
    child process: importing it probes accelerators and must not touch this process."""
    if importlib.util.find_spec("deepspeed") is None:
        return "the 'deepspeed' package is not installed (pip install deepspeed; it is never a zeroshard dependency)"
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    try:
        p = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True,
                           timeout=300)
    except subprocess.TimeoutExpired:
        return "'import deepspeed' did not finish within 300 s"
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["exit code %d" % p.returncode])[-1]
        return f"'import deepspeed' fails here: {last}"
    return None


def resolve_systems(spec: str | None) -> tuple[list[BenchSystem], list[str], str | None]:
    """(systems to run, notes, problem). `spec` is the --systems value: comma-separated names,
    or None for the defaults (DeepSpeed's rows only when it imports, said in a note)."""
    notes: list[str] = []
    if spec is None:
        chosen = list(DEFAULT_SYSTEMS)
    else:
        chosen = [s.strip() for s in spec.split(",") if s.strip()]
        if not chosen:
            return [], notes, "--systems is empty; name at least one of " + ", ".join(SYSTEMS)
        unknown = [s for s in chosen if s not in SYSTEMS]
        if unknown:
            return [], notes, f"--systems: unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}"
        twice = sorted({s for s in chosen if chosen.count(s) > 1})
        if twice:
            return [], notes, f"--systems names {twice[0]!r} twice"
    wants_ds = [s for s in chosen if SYSTEMS[s].family == "deepspeed"]
    if wants_ds:
        problem = deepspeed_problem()
        if problem and spec is not None:
            return [], notes, f"--systems {','.join(wants_ds)}: DeepSpeed is not importable: {problem}"
        if problem:
            notes.append(f"DeepSpeed rows skipped ({', '.join(wants_ds)}): {problem}")
            chosen = [s for s in chosen if s not in wants_ds]
    return [SYSTEMS[s] for s in chosen], notes, None
