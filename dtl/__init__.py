"""dtl: the distributed-training-lessons kit that every day imports.

dist (init, cleanup, ParallelGrid), config (dataclass -> TOML -> --key=value, --help, checks),
model (the small GPT, its TP plan and per-parameter init), data (batches for dp and cp ranks),
flat (FlatBuffer), metrics (StepLogger, MFU), profile (timers, StepTimes, traces), comm
(CommCounter), testing (run_distributed, reference_train, params_gap, replica_gap), megatron
(megatron-core's parallel_state from a grid, the CPU shim), registry and tour (lessons.toml).
Never imports a day.
"""
