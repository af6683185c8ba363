"""The optimizer and scheduler names DeepSpeed 0.19 knows, and those zeroshard has built.

The schema refuses a name outside these lists (with a did-you-mean); `support.py` refuses a
known but unbuilt one as not supported yet. When one lands, move it to the BUILT tuple.
"""

from __future__ import annotations

BUILT_OPTIMIZERS = ("adam", "adamw", "sgd", "adagrad", "lion", "lamb", "muon", "onebitadam", "zerooneadam",
                    "onebitlamb")
UNBUILT_OPTIMIZERS = (
    "muadam", "muadamw", "musgd",
    "rmsprop", "adamax", "adadelta", "nadam", "radam", "asgd", "rprop",
    "lbfgs", "sparseadam", "adafactor",
)
KNOWN_OPTIMIZERS = BUILT_OPTIMIZERS + UNBUILT_OPTIMIZERS  # compared lower-cased, as DeepSpeed does

BUILT_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
UNBUILT_SCHEDULERS = (
    "StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts", "LambdaLR", "LinearLR", "ConstantLR", "PolynomialLR",
    "CyclicLR", "OneCycleLR", "ReduceLROnPlateau",
)
KNOWN_SCHEDULERS = BUILT_SCHEDULERS + UNBUILT_SCHEDULERS  # exact spelling, as DeepSpeed does
