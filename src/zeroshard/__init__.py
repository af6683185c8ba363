"""zeroshard: ZeRO stages for PyTorch."""
