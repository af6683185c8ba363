"""Pure estimates: memory, communication, step time and the advisor. No process group needed."""

from zeroshard.policies import OffloadDevice, Precision, Stage

from zeroshard.estimate.activations import ActivationEstimate, activation_bytes
from zeroshard.estimate.comm import Collective, CommEstimate, estimate_comm, ring_split
from zeroshard.estimate.deepspeed_compat import ds_estimate_zero2, ds_estimate_zero3
from zeroshard.estimate.hardware import GPUS, INTER_NODE_LINKS, Cluster, GpuSpec, gpu_spec, inter_node_link
from zeroshard.estimate.memory import (
    MemoryEstimate, device_budget, estimate_memory, host_budget, model_states_per_device,
)
from zeroshard.estimate.padding import BucketPlan, plan_layout
from zeroshard.estimate.model_size import ModelShape, shape_from_callable, shape_from_hf_config, shape_from_params
from zeroshard.estimate.candidate import Candidate, Workload, evaluate
from zeroshard.estimate.planner import Plan, deepspeed_config, plan, smallest_cluster
from zeroshard.estimate.strategy import Strategy, optimizer_bytes_per_param
from zeroshard.estimate.timing import TimeEstimate, estimate_time, flops_per_token
from zeroshard.estimate.byte_units import GB, GIB, parse_bytes, parse_count

__all__ = [
    "ActivationEstimate", "BucketPlan", "Candidate", "Cluster", "Collective", "CommEstimate", "GB", "GIB", "GPUS", "GpuSpec",
    "INTER_NODE_LINKS", "MemoryEstimate", "ModelShape", "OffloadDevice", "Plan", "Precision", "Stage", "Strategy",
    "TimeEstimate", "Workload", "activation_bytes", "deepspeed_config", "device_budget", "ds_estimate_zero2",
    "ds_estimate_zero3", "estimate_comm", "estimate_memory", "estimate_time", "evaluate", "flops_per_token",
    "gpu_spec", "host_budget", "inter_node_link", "model_states_per_device", "optimizer_bytes_per_param",
    "parse_bytes", "parse_count", "plan", "plan_layout", "ring_split", "shape_from_callable", "shape_from_hf_config",
    "shape_from_params", "smallest_cluster",
]
