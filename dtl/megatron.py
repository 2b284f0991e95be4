"""megatron-core's `parallel_state` built from our grid, and the narrow shim that runs it on a CPU.

The lesson: a parallel layout is a rank table and nothing more. `dtl.grid.ParallelGrid` lays ranks
out in Megatron's order (tp-cp-dp-pp: TP innermost, PP outermost), so the groups the course builds
by hand and the groups megatron-core builds must be the *same lists of ranks*.
`init_parallel_state(grid)` builds megatron's groups and then proves it, group by group, for this
rank: TP, PP, DP, CP, DP x CP, the model-parallel group TP x PP and the embedding group. A layout
that disagrees (another `order`, a transposed table) stops the run at start-up with both lists in
the message, instead of training on the wrong shards.

    grid = ParallelGrid(tp=2, pp=2)              # 4 ranks
    init_parallel_state(grid)                    # raises ParallelStateMismatch on any difference
    with cpu_shim():                             # a no-op when the run is on CUDA (NCCL)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        layer = ColumnParallelLinear(..., config=model_parallel_config(grid), ...)
        ...                                      # forward *and* backward inside the shim
    destroy_parallel_state()

megatron-core has no CPU mode. Its layers and schedules allocate on `torch.cuda.current_device()`,
write `device="cuda"`, call `.cuda()`, and keep their RNG streams in the CUDA generator.
`cpu_shim()` patches exactly those places (its body lists the four patches and why), only when
the run's device is the CPU, only for the megatron-core minor version whose source it was read
against, and undoes every patch on exit, even on an exception. "The run's device" is the one its
tensors must be on to enter a collective (`dtl.dist.run_device`): the CPU under gloo, a GPU
machine's gloo run included (DTL_BACKEND=gloo, or more ranks than GPUs), where megatron unpatched
would put its buffers on cuda:0 beside the run's CPU tensors; cuda:<local rank> under NCCL, where
the shims do nothing. `shim_state()` says which, and why, in one printable phrase.

megatron's own optimizers (`megatron.core.optimizer`: the DistributedOptimizer,
Float16OptimizerWithFloat16Params, `clip_grads`) accept a parameter only if `param.type()` is
one of the "torch.cuda.*Tensor" names, and reject CPU parameters. That one
is a separate, narrower shim, `optimizer_shim()`: `Tensor.type()` with no argument answers with
the CUDA name of a CPU tensor's type, which lies to every other caller, so wrap only the
optimizer's construction and its `step()` in it. Nothing else in those classes needs CUDA: with
both shims, megatron's DDP (grad buffers, bucketed all-reduce or reduce-scatter), the
DistributedOptimizer and grad clipping train on a CPU exactly as one process does (day 22).

megatron-core is imported lazily, inside the functions: this module imports without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from dtl.dist import run_device, timeout_s

if TYPE_CHECKING:
    from dtl.grid import ParallelGrid

# The rank order of dtl.grid.ParallelGrid in megatron's spelling. Megatron's default is the same
# string; ep folds inside dp (day 22's EP_AXES is the same order, outermost first).
ORDER = "tp-cp-ep-dp-pp"

SHIM_WRITTEN_FOR = "0.16"  # megatron-core major.minor whose source the shim's patches were read in
ANY_VERSION_ENV = "DTL_MEGATRON_SHIM_ANY_VERSION"

# The groups init_parallel_state checks, in the order it checks them.
CHECKED_GROUPS = ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "embedding")


class ParallelStateMismatch(RuntimeError):
    """megatron-core's groups for this rank differ from the grid's."""


def _megatron(module: str) -> Any:
    """Import `megatron.core.<module>`, with an install hint when megatron-core is missing."""
    try:
        return importlib.import_module(f"megatron.core.{module}")
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("megatron"):
            raise
        raise ModuleNotFoundError(
            "dtl.megatron needs megatron-core: pip install -e '.[megatron]'"
        ) from err


# ---------------------------------------------------------------------------------------------
# parallel_state from a ParallelGrid
# ---------------------------------------------------------------------------------------------


def init_parallel_state(grid: ParallelGrid, *, virtual_pipeline_size: int | None = None) -> None:
    """Build megatron-core's parallel_state with the grid's sizes, then check it equals the grid.

    Needs the default process group (`dtl.dist.init()`). Collective: every rank calls it. On a
    mismatch megatron's state is destroyed again and `ParallelStateMismatch` is raised.
    """
    ps = _megatron("parallel_state")
    if not dist.is_initialized():
        raise RuntimeError("init_parallel_state: no default process group; call dtl.dist.init()")
    if (grid.world_size, grid.rank) != (dist.get_world_size(), dist.get_rank()):
        raise ValueError(
            f"init_parallel_state: the grid is for rank {grid.rank} of {grid.world_size}, but "
            f"this process is rank {dist.get_rank()} of {dist.get_world_size()}"
        )
    if ps.model_parallel_is_initialized():
        raise RuntimeError(
            "init_parallel_state: megatron parallel_state is already initialized; "
            "call destroy_parallel_state() first"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=grid.tp_size,
        pipeline_model_parallel_size=grid.pp_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size,
        context_parallel_size=grid.cp_size,
        order=ORDER,
        # megatron's default is 30 minutes; use the course's short timeout so a desync fails fast
        distributed_timeout_minutes=timeout_s() / 60,
    )
    try:
        check_parallel_state(grid)
    except ParallelStateMismatch:
        ps.destroy_model_parallel()
        raise


def destroy_parallel_state() -> None:
    """Forget megatron-core's groups (`parallel_state.destroy_model_parallel()`), so a new grid
    can be built in the same process. The default process group stays."""
    _megatron("parallel_state").destroy_model_parallel()


def megatron_group_ranks() -> dict[str, list[int]]:
    """This rank's megatron-core groups as lists of global ranks, keyed as in CHECKED_GROUPS.

    "embedding" is [] on a rank that holds no embedding (a middle pipeline stage): megatron gives
    such a rank no embedding group at all.
    """
    ps = _megatron("parallel_state")

    def ranks(group: Any) -> list[int]:
        return [] if group is None else dist.get_process_group_ranks(group)

    return {
        "tp": ranks(ps.get_tensor_model_parallel_group()),
        "pp": ranks(ps.get_pipeline_model_parallel_group()),
        "dp": ranks(ps.get_data_parallel_group()),
        "cp": ranks(ps.get_context_parallel_group()),
        "dp-cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "tp-pp": ranks(ps.get_model_parallel_group()),
        "embedding": ranks(ps.get_embedding_group(check_initialized=False)),
    }


def grid_group_ranks(grid: ParallelGrid) -> dict[str, list[int]]:
    """The same table as `megatron_group_ranks()`, read off the grid (no communication)."""
    embedding = grid.embedding_ranks()
    return {
        "tp": grid.ranks_along("tp"),
        "pp": grid.ranks_along("pp"),
        "dp": grid.ranks_along("dp"),
        "cp": grid.ranks_along("cp"),
        "dp-cp": grid.ranks_along("dp", "cp"),
        "tp-pp": grid.ranks_along("tp", "pp"),
        "embedding": embedding if grid.rank in embedding else [],
    }


def check_parallel_state(grid: ParallelGrid) -> dict[str, list[int]]:
    """Raise `ParallelStateMismatch` (one line: the group, both lists) unless megatron's groups for
    this rank equal the grid's; return megatron's table."""
    ours = grid_group_ranks(grid)
    theirs = megatron_group_ranks()
    for name in CHECKED_GROUPS:
        if theirs[name] != ours[name]:
            raise ParallelStateMismatch(
                f"rank {grid.rank}: megatron-core's {name} group is {theirs[name]} but the grid's "
                f"is {ours[name]} (the grid's order is tp-cp-dp-pp, TP innermost)"
            )
    return theirs


# megatron's kernel fusions, every one off (TransformerConfig fields): on a CPU they have no
# kernels, and off they compute the same thing
FUSIONS_OFF: Mapping[str, bool] = MappingProxyType(
    {
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
    }
)


def model_parallel_config(
    grid: ParallelGrid, *, config_class: type | None = None, **overrides: Any
) -> Any:  # a megatron config (untyped)
    """A megatron `ModelParallelConfig` (or `config_class`, e.g. `TransformerConfig`, whose extra
    required fields go in `overrides`) sized from the grid, with the settings a CPU run needs.

    - use_cpu_initialization=True: build each layer's full master weight on the CPU from the
      default generator and keep this rank's slice, so the shards are the same numbers a dense
      model would hold whatever the TP size (and no CUDA RNG is touched).
    - pipeline_dtype = params_dtype (fp32): required by megatron whenever pp > 1.
    - batch_p2p_comm=False: with batched p2p on gloo, interleaved PP=2 ran but did not learn.
    - sequence_parallel=False: its torch LayerNorm path needs apex or Transformer Engine.
    They are valid on a GPU too. The parallel sizes come from the grid and cannot be overridden.
    """
    from_grid = {
        "tensor_model_parallel_size": grid.tp_size,
        "pipeline_model_parallel_size": grid.pp_size,
        "context_parallel_size": grid.cp_size,
    }
    clash = sorted(set(from_grid) & set(overrides))
    if clash:
        raise ValueError(f"model_parallel_config: {', '.join(clash)} comes from the grid")
    dtype = overrides.get("params_dtype", torch.float32)
    fields = {
        **from_grid,
        "use_cpu_initialization": True,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "batch_p2p_comm": False,
        "sequence_parallel": False,
        **overrides,
    }
    if config_class is None:
        config_class = _megatron("model_parallel_config").ModelParallelConfig
    return config_class(**fields)


# ---------------------------------------------------------------------------------------------
# The CPU shim
# ---------------------------------------------------------------------------------------------


def run_on_cpu() -> bool:
    """Does this run compute on the CPU? With a process group: its backend's device (gloo: the
    CPU, even where GPUs exist; NCCL: a GPU). Before one exists (a test, a one-process tool):
    the CPU unless CUDA is available, the device `dtl.dist.init()` would give a single rank."""
    if dist.is_initialized():
        return run_device().type == "cpu"
    return not torch.cuda.is_available()


def shim_state() -> str:
    """The shims' state and its reason, for a run's log: "active: the run's device is the CPU
    (gloo)" or "inactive: the run's device is cuda:0 (nccl)"."""
    backend = dist.get_backend() if dist.is_initialized() else "no process group"
    if run_on_cpu():
        return f"active: the run's device is the CPU ({backend})"
    device = run_device() if dist.is_initialized() else torch.device("cuda")
    return f"inactive: the run's device is {device} ({backend})"


def check_shim_version() -> str:
    """Return megatron-core's version; raise unless it is the one the shim's patches were
    checked against (or DTL_MEGATRON_SHIM_ANY_VERSION=1)."""
    version: str = _megatron("package_info").__version__
    if version.split(".")[:2] == SHIM_WRITTEN_FOR.split("."):
        return version
    if os.environ.get(ANY_VERSION_ENV) == "1":
        return version
    raise RuntimeError(
        f"dtl.megatron.cpu_shim patches megatron-core {SHIM_WRITTEN_FOR}.x, found "
        f"{version}; re-check its patches against that source, or set {ANY_VERSION_ENV}=1"
    )


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Let megatron-core's layers, RNG tracker and schedules run on a CPU while active.

    A no-op when the run computes on a GPU (`run_on_cpu()` is False: NCCL). Otherwise, a gloo
    run with or without GPUs in the machine, it checks the megatron-core version, applies the
    patches below and undoes each on exit. Run forward and backward inside it: megatron's
    backward passes allocate and re-seed too. Seed with
    `tensor_parallel.model_parallel_cuda_manual_seed(seed)` inside the shim, after
    `torch.manual_seed(seed)` (on a CPU the CPU generator is megatron's "default" stream). The
    tracker is built by the first seeding call (or one with `force_reset_rng=True`): make that
    call inside the shim. It keeps working after the shim exits.
    """
    if not run_on_cpu():
        yield
        return
    check_shim_version()
    rng = _megatron("tensor_parallel.random")
    with contextlib.ExitStack() as patches:
        # 1. Megatron allocates with `device=torch.cuda.current_device()` (schedules, p2p buffers,
        #    layers built without use_cpu_initialization). Without CUDA that call raises "Torch not
        #    compiled with CUDA enabled"; on a GPU machine's gloo run it would answer 0 and put
        #    megatron's buffers on cuda:0 beside the run's CPU tensors. "cpu" is a valid
        #    `device=` everywhere it is used.
        patches.enter_context(_patched(torch.cuda, "current_device", _cpu_current_device))
        # 2. model_parallel_cuda_manual_seed builds its tracker from the module-level name
        #    CudaRNGStatesTracker, whose add() seeds and reads the CUDA generator. The stand-in
        #    keeps the same per-name streams (a different one per TP rank, as on a GPU) in CPU
        #    generator states, so dropout inside `tracker.fork()` still differs across TP ranks.
        patches.enter_context(_patched(rng, "CudaRNGStatesTracker", _cpu_rng_tracker_class()))
        # 3. Activation recompute (tensor_parallel.checkpoint) saves "the CUDA RNG state" in
        #    forward and restores it before recomputing, so the dropout masks replay; it goes
        #    through these two functions, which raise without CUDA. On a CPU dropout draws from
        #    the CPU generator (which checkpoint also saves itself), so they read and write that.
        patches.enter_context(_patched(rng, "_get_cuda_rng_state", _get_cpu_rng_state))
        patches.enter_context(_patched(rng, "_set_cuda_rng_state", _set_cpu_rng_state))
        # 4. The pipeline schedules write `torch.zeros(..., device="cuda")` and call `.cuda()`
        #    on tensors; a TorchFunctionMode sees those calls and keeps them on the CPU.
        patches.enter_context(_CudaToCpuMode())
        yield


@contextlib.contextmanager
def optimizer_shim() -> Iterator[None]:
    """While active (and only when the run computes on the CPU, as for cpu_shim), `tensor.type()`
    of a CPU tensor says "torch.cuda.FloatTensor" (and so on) instead of "torch.FloatTensor": the
    one check that stops megatron's optimizers on a CPU. Calls with a dtype argument are
    untouched."""
    if not run_on_cpu():
        yield
        return
    check_shim_version()
    original = torch.Tensor.type

    def cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # str, or a cast
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu" or ".cuda." in name:
            return name  # a cast, a real device tensor, or already answered (nested modes)
        return name.replace("torch.", "torch.cuda.", 1)

    with _patched(torch.Tensor, "type", cuda_type_name):
        yield


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _cpu_current_device() -> str:
    return "cpu"


def _get_cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    # megatron passes (device, clone, graph_safe); only the CPU generator exists here
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Every torch call made while active: a CUDA `device` becomes "cpu"; `Tensor.cuda()` returns
    the tensor itself (it already lives on the CPU)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])  # tensor.to("cuda", ...)
        return func(*args, **kwargs)


@functools.cache
def _cpu_rng_tracker_class() -> type:
    """megatron's CudaRNGStatesTracker with CPU generator states standing in for CUDA ones.

    Built on first use (it subclasses a megatron class), so that `isinstance` checks against
    megatron's tracker still hold and the tracker keeps working after the shim exits.
    """
    rng = _megatron("tensor_parallel.random")

    # a base class imported by name at run time: Any to mypy, which cannot check it
    class CpuRNGStatesTracker(rng.CudaRNGStatesTracker):  # type: ignore[misc,name-defined]
        _current_state_name: str  # megatron's: set by its __init__ and by fork()

        def add(self, name: str, seed: int) -> None:
            """Register a named stream seeded with `seed` (megatron: one per TP rank)."""
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            # a private generator: registering a stream leaves the default stream untouched
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = rng._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            """Draw from stream `name` inside the block; the outer stream resumes afterwards."""
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer_name, outer_state = self._current_state_name, torch.get_rng_state()
            if outer_name != "default-rng":  # nested fork: the outer stream lives in states_
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker
