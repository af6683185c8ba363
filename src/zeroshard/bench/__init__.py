"""The benchmark harness: `zeroshard bench` and the scripts in the repository's bench/ run
zeroshard beside its peers through it.

    systems   what each system name runs (zeroshard modes, DDP, FSDP2, DeepSpeed)
    peers     the peers' runners: DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed
    engine    zeroshard's runner (an Engine from the DeepSpeed-style config a user writes)
    worker    one rank of one system: build, warm up, time the steps, write its figures
    launch    one torchrun job per (model, system), the ranks' files merged into rows
    results   pure functions over those rows: merge, ratios, the ZeRO formula
    answers   the ZeRO explainer's questions answered from the rows
    report    the table, bench.json; plot: bench.png
    command   `zeroshard bench`'s options (registered by zeroshard.cli.main)

Importing the package imports nothing else (`zeroshard --help` stays fast).
"""
