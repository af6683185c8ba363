"""The benchmark harness (`zeroshard bench`; the scripts in the repository's bench/ use its
runners): `systems` names what runs; `peers` builds DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed, `engine` zeroshard; `worker` measures one rank, `launch` runs one torchrun job per
system, `ranks` spawns ranks in-process (the tests' and bench/ scripts' spawner); `results`,
`answers`, `report` and `plot` turn the rows into the table, report, JSON and PNG; `command` is
the CLI entry. Importing the package imports nothing else (`--help` stays fast)."""
