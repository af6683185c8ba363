"""What `zeroshard train` checks in the launcher, once, before any rank starts.

Each check returns one line naming the problem and the fix, or None; the launcher prints it
and exits 2. The ranks check the same things again (a user's own torchrun skips this
file), so these checks only move errors earlier, never change what is accepted:

- the optimizer's hyper-parameters, by building it over one element (torch's own checks), when
  the user wrote them (the embedded config's are known to build; building a torch optimizer
  imports torch._dynamo, about 1.5 s of the launcher's start);
- NVMe paths: a directory this user can write, on a real filesystem, with room for what the
  local ranks will write there (a lower bound: the model's transformer weights, 12 L h^2 + V h
  elements, without biases, norms or positions, 4 bytes each of fp32 master on the optimizer's
  path, the compute dtype's on the parameters'; the ranks check the exact figure again);
- the batch against the host's memory: the estimator's activation peak for one micro-batch
  of the model (no weights built), times the local ranks, against the memory available.
"""

from __future__ import annotations

from zeroshard.cli.train.model import model_shape
from zeroshard.policies import ZeroShardError

__all__ = ["check_settings", "available_memory"]


def check_settings(settings, spec: str, seq_len: int, local_ranks: int, world_size: int | None = None,
                   user_optimizer: bool = True) -> str | None:
    return ((_check_optimizer(settings) if user_optimizer else None) or _check_nvme(settings)
            or _check_nvme_space(settings, spec, local_ranks, world_size or local_ranks)
            or _check_batch_memory(settings, spec, seq_len, local_ranks))


def _check_optimizer(settings) -> str | None:
    if settings.optimizer is None:
        return None
    import torch

    from zeroshard.optim.factory import build_optimizer

    probe = torch.zeros(1, requires_grad=True)
    probe.use_muon = False  # Muon needs every parameter tagged (optim/muon_groups.py); others ignore it
    try:
        build_optimizer(settings.optimizer, [probe])
    except ZeroShardError as exc:
        return str(exc)
    return None


def _check_nvme(settings) -> str | None:
    paths = [p.nvme_path for p in (settings.zero.offload_optimizer, settings.zero.offload_param) if p.device == "nvme"]
    if not paths:
        return None
    from zeroshard.offload.nvme import check_path  # imports torch: only for a job that uses NVMe

    for path in paths:
        try:
            check_path(path)
        except ZeroShardError as exc:
            return str(exc)
    return None


def _check_nvme_space(settings, spec: str, local_ranks: int, world_size: int) -> str | None:
    shape = model_shape(spec)
    if shape is None:
        return None
    phi = lower_bound_params(shape)
    per_rank = -(-phi // world_size)
    need: dict[str, int] = {}
    offload = ((settings.zero.offload_optimizer, 4),  # the fp32 master (Adam's moments not counted)
               (settings.zero.offload_param, settings.precision.compute.itemsize))
    for policy, nbytes in offload:
        if policy.device == "nvme":
            # one path for both: the larger alone (an fp32 run's parameter shard is its master)
            need[policy.nvme_path] = max(need.get(policy.nvme_path, 0), nbytes * per_rank)
    if not need:
        return None
    from zeroshard.offload.nvme import check_space

    for path, nbytes in need.items():
        try:
            check_space(path, nbytes, local_ranks)  # _check_nvme has made sure it is a directory
        except ZeroShardError as exc:
            return str(exc)
        except OSError:  # unreadable: the ranks check it again
            continue
    return None


def lower_bound_params(shape: dict[str, int]) -> int:
    """Fewer elements than the model has: its blocks' weight matrices and the embedding."""
    return 12 * shape["layers"] * shape["hidden"] ** 2 + shape["vocab"] * shape["hidden"]


def available_memory() -> int | None:
    """Bytes the kernel says a new allocation can use (MemAvailable), or None off Linux."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_batch_memory(settings, spec: str, seq_len: int, local_ranks: int) -> str | None:
    shape = model_shape(spec)
    free = available_memory()
    if shape is None or free is None:
        return None
    from zeroshard.estimate.activations import activation_bytes

    micro = settings.batch.micro_batch_size
    act_bytes = settings.precision.compute.itemsize
    need = activation_bytes(seq_len, micro, shape["hidden"], shape["heads"], shape["layers"], shape["vocab"],
                            flash_attention=False, act_bytes=act_bytes).total * local_ranks
    if need > free:
        fits = max(1, int(micro * free / need))
        return (f"train_micro_batch_size_per_gpu {micro:,} needs about {need / 2**30:,.1f} GiB of activations on "
                f"this host ({local_ranks} local rank(s)), more than the {free / 2**30:.1f} GiB available; use a "
                f"micro-batch of at most {fits:,} (--micro-batch), a shorter --seq-len, or more ranks")
    return None
