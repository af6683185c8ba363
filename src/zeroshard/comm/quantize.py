"""The old path of comm.quantization, kept for bench/gpu_check.py until it imports from
`zeroshard.comm`. Importing it makes the package attribute `zeroshard.comm.quantize` this
module, not the function: import the functions from `zeroshard.comm` or comm.quantization."""

from zeroshard.comm.blocks import QUANT_BLOCK_SIZE, Blocks, plan_blocks  # noqa: F401
from zeroshard.comm.quantization import dequantize, quantize  # noqa: F401
