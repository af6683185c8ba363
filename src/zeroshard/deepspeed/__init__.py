"""Drop-in for DeepSpeed training scripts: change one line,

    import deepspeed                           # before
    import zeroshard.deepspeed as deepspeed    # after

and keep the config, the arguments (`add_config_arguments`) and the launch command
(`zeroshard launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json`).
A thin layer over zeroshard's own API: `initialize` returns DeepSpeed's 4-tuple around a
`zeroshard.Engine`. What differs on purpose, and what is not supported (pipeline engine,
MoE, model parallelism), is in docs/deepspeed-migration.md.
"""

from zeroshard.deepspeed import checkpointing, comm, moe, pipe, zero
from zeroshard.deepspeed.args import add_config_arguments
from zeroshard.deepspeed.comm import init_distributed
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.initialize import initialize

__all__ = ["DeepSpeedEngine", "add_config_arguments", "checkpointing", "comm", "init_distributed", "initialize", "moe", "pipe", "zero"]
