"""How many CUDA devices the ranks of this host will see, asked of torch only where a GPU driver
is present: importing torch costs a launcher about 1.5 s of its start (the ranks and torchrun
import it anyway), and a host without a driver's device nodes has no CUDA device to count.

The nodes looked for: NVIDIA's (/dev/nvidiactl, /proc/driver/nvidia), WSL2's GPU paravirtual
device (/dev/dxg, where CUDA runs without /dev/nvidia*), and ROCm's (/dev/kfd, which
torch.cuda serves through HIP). Where any exists, torch answers, as it always did.
"""

from __future__ import annotations

import os

__all__ = ["DRIVER_NODES", "cuda_device_count"]

DRIVER_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def cuda_device_count() -> int:
    """torch.cuda.device_count() where CUDA is available, else 0; torch is not imported on a host
    with none of DRIVER_NODES."""
    if not any(os.path.exists(node) for node in DRIVER_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
