"""dtl: the distributed-training-lessons kit that every day imports.

dist (init, cleanup, ParallelGrid, run_device), config (dataclass -> TOML -> --key=value, --help,
checks), model (the small GPT, its TP plan and per-parameter init), data (batches for dp and cp
ranks), flat (FlatBuffer), metrics (StepLogger, MFU), profile (timers, StepTimes, traces), comm
(CommCounter), compat (the collectives torch 2.13 renamed), nccl_rules (NCCL's device and p2p
rules checked on gloo), testing (run_distributed, reference_train, params_gap, replica_gap),
megatron (megatron-core's parallel_state from a grid, the CPU shim), registry and tour
(lessons.toml). Never imports a day.
"""

# Both switches are read from the environment in every process (tests/conftest.py sets them):
# DTL_HIDE_NEW_COLLECTIVES=1 hides the torch 2.13-only collective names from the course's code;
# DTL_P2P_IGNORE_TAGS=1 makes gloo match sends and receives in posting order, as NCCL does.
from dtl import compat as _compat  # noqa: F401
from dtl import nccl_rules as _nccl_rules  # noqa: F401
