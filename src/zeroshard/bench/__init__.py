"""The benchmark harness (`zeroshard bench`; bench/bench_stages.py and bench/bench_stage3.py are
presets of it through `command.run_preset`): `systems` names what runs; `peers` builds DDP,
ZeroRedundancyOptimizer, FSDP2 and DeepSpeed (`fsdp2_peak` samples FSDP2's transient memory),
`engine` zeroshard; `worker` measures one rank, `launch` runs one torchrun job per system (and
round), `ranks` spawns ranks in-process (the tests' spawner); `results`, `answers`, `report` and
`plot` turn the rows into the table, report, JSON and PNG; `command` is the CLI entry.
Importing the package imports nothing else (`--help` stays fast)."""
