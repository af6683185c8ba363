"""`deepspeed.runtime.fp16`: only the 1-bit optimizers (`onebit`) are served from it."""
