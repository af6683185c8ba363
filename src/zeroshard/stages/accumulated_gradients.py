"""Stage 1 with `data_types.grad_accum_dtype` "fp32" for a 16-bit model: DeepSpeed's
BF16_Optimizer (bf16) and its ZeRO-1 optimizer's `grad_accum` attribute (fp16 / offload).

Autograd still accumulates each micro-step into the 16-bit full buffer (`param.grad` views,
as in `ScatteredGradients`); when the micro-step's backward ends, that buffer is added into a
full fp32 accumulator of the bucket (4 bytes per element, not sharded, as DeepSpeed's fp32
gradient buffer) and zeroed. So the window's gradient is the fp32 sum of the 16-bit
micro-gradients, not a 16-bit running sum. At the accumulation boundary the fp32 accumulator is
what is reduced, in the reduce dtype (DeepSpeed's `communication_data_type`: the model's
16-bit type unless the config says otherwise; DeepSpeed casts its fp32 buffer to it for the
all-reduce too), and the optimizer reads this rank's fp32 slice of it.
"""

from __future__ import annotations

import torch

from zeroshard.stages.gradients import ScatteredGradients


class AccumulatedScatteredGradients(ScatteredGradients):
    def __init__(self, *args, accum_dtype: torch.dtype = torch.float32, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.accums = [torch.zeros(b.layout.padded_numel, dtype=accum_dtype, device=b.device) for b in self.buckets]
        for acc, bucket in zip(self.accums, self.buckets):
            self.memory.hold("grads", f"{bucket.key}.accum", acc.nbytes)
        self._folded: set[int] = set()

    def begin_backward(self, boundary: bool, first_micro: bool, *early) -> None:
        self._folded = set()
        super().begin_backward(boundary, first_micro, *early)

    def _fold(self, b: int) -> torch.Tensor:
        """Add this micro-step's 16-bit gradient of bucket b into its fp32 accumulator, once."""
        if b not in self._folded:
            self._folded.add(b)
            self.accums[b].add_(self.grads[b])
            self.grads[b].zero_()
        return self.accums[b]

    def end_backward(self) -> None:
        if not self._state.reduce:  # between boundaries nothing launches: fold every bucket here
            for b in range(len(self.buckets)):
                self._fold(b)
        super().end_backward()

    def _full_grad(self, b: int) -> torch.Tensor:
        return self._fold(b)

    def grad_shard(self, b: int) -> torch.Tensor:
        lo, hi = self.buckets[b].shard_range
        return self.accums[b][lo:hi]

    def zero_grads(self) -> None:
        for acc in self.accums:
            acc.zero_()
        super().zero_grads()
