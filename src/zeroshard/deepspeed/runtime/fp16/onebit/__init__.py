"""`deepspeed.runtime.fp16.onebit`: DeepSpeed's 1-bit optimizer classes (DeepSpeed <= 0.18 kept
them here; 0.19 removed them) over zeroshard's (optim/onebit.py, zeroone.py, onebit_lamb.py). Each takes
DeepSpeed's arguments and defaults; `deepspeed` (DeepSpeed's engine, which the optimizer drove)
is not needed: zeroshard's engine hands the optimizer its group and asks it, step by step,
whether stage 0 all-reduces the gradients. `cuda_aware` / `comm_backend_name` (DeepSpeed's
backend choice) and `max_grad_norm` (never read by DeepSpeed) are accepted and ignored. Stage 0
only: at stages 1-3 the engine refuses them in one line, as DeepSpeed does."""

from zeroshard.deepspeed.runtime.fp16.onebit.adam import OnebitAdam
from zeroshard.deepspeed.runtime.fp16.onebit.lamb import OnebitLamb
from zeroshard.deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
