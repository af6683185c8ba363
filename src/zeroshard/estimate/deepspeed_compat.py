"""DeepSpeed's published model-state estimators, reproduced for comparison.

Source: deepspeed/runtime/zero/stage_1_and_2.py `estimate_zero2_model_states_mem_needs`
and deepspeed/runtime/zero/stage3.py `estimate_zero3_model_states_mem_needs`
(the functions behind `..._all_cold` / `..._all_live`). Returned as (cpu bytes per
node, gpu bytes per device[, largest layer bytes]), as DeepSpeed returns them.

How they differ from `estimate_memory` (see docs/estimate.md):
* zero2 without offload gives 4Φ + 16Φ/N on the GPU: fp16 params and a *full* fp16
  gradient (2Φ + 2Φ) plus fp32 master and Adam states (16Φ/N, i.e. K = 12 and the
  fp32 gradient partition of 4Φ/N). The paper's stage 2 (and ours) shards the gradient:
  2Φ + 14Φ/N. DeepSpeed counts its full-size gradient buffers, not the partition.
* zero3 adds 4 bytes per element of the largest layer (its gathered 16-bit parameters
  and gradients) and 18Φ/N (2 + 16: the fp32 gradient partition is counted even
  without offload); we count the unit in flight plus the prefetched one, and the fp32
  gradient partition only where the CPU optimizer needs it (offload).
* cpu figures multiply by `additional_buffer_factor` = 1.5; ours has no such factor and
  reports the exact partition bytes plus named buffers.
* none of them counts activations, buckets or prefetch (pain point 8).
"""

from __future__ import annotations

__all__ = ["ds_estimate_zero2", "ds_estimate_zero3", "DS_ADDITIONAL_BUFFER_FACTOR"]

DS_ADDITIONAL_BUFFER_FACTOR = 1.5


def ds_estimate_zero2(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                      cpu_offload: bool = True,
                      additional_buffer_factor: float = DS_ADDITIONAL_BUFFER_FACTOR) -> tuple[int, int]:
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_estimate_zero3(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                      num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                      zero_init: bool = True,
                      additional_buffer_factor: float = DS_ADDITIONAL_BUFFER_FACTOR) -> tuple[int, int, int]:
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        per_param = 18 if cpu_offload_params else 16
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        if zero_init:
            cpu_mem = total_params * per_param * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = total_params * max(4 * num_gpus_per_node, per_param * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory
