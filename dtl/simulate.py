"""Scale without the hardware: one rank of an N-rank job, run in this process.

    with fake_world(1024, rank=0):            # a process group of 1,024 ranks, and fake tensors
        trainer = build(...)                   # the course's own code, unchanged
        trainer.run_step(batches)              # collectives return at once; shapes flow through
        held = trainer.state_bytes()           # what rank 0 of 1,024 would hold

Two pieces of torch make it work:
- the "fake" backend (`torch.testing._internal.distributed.fake_pg`): a process group of any size
  whose collectives do nothing and return at once, so `get_world_size()` is N and every shape
  the code derives from it (a 1/N shard, a padded bucket) is the one an N-rank job has;
- `FakeTensorMode`: tensors with a shape, a dtype and a device but no data, so a 1.3 B model
  costs no memory and a step costs milliseconds.

What a simulation can see: every tensor the code allocates, by shape and dtype (parameters,
gradients, optimizer state, buffers it keeps), and every collective it calls, with the bytes it
would move (dtl.comm.CommCounter counts from shapes). What it cannot: values (no loss, no norm:
code that reports a loss reads it with `item`, which gives nan here), time, the allocator's
fragmentation and caching, NCCL's own buffers, kernel workspaces, and anything that depends on
data (a data_ptr comparison between two fake tensors means nothing: dtl.state.storage_key tells
tensors apart by their storage instead). The numbers it gives are what the code holds, not what
a GPU's memory counter would show on top.

Inside fake_world, two pieces of bookkeeping run on real tensors: a DeviceMesh's and our
ParallelGrid's rank tables, which they read back as numbers. DeepSpeed needs more:
deepspeed_under_fake_tensors. Used by day 18's, 22's, 23's and 28's scale.py.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from dtl.grid import ParallelGrid

CANNOT_SEE = (
    "values (loss, norms), time, allocator fragmentation and caching, NCCL buffers, "
    "kernel workspaces"
)


def item(t: torch.Tensor) -> float:
    """t.item(), or nan for a fake tensor: code that reports a loss runs under simulation too,
    where there is no value to read."""
    from torch._subclasses.fake_tensor import FakeTensor

    return float("nan") if isinstance(t, FakeTensor) else t.item()


M = TypeVar("M", bound=torch.nn.Module)


def to_device(module: M, device: torch.device | str) -> M:
    """module.to(device), not called when its parameters are there already: fake_world's fake
    parameters cannot be swapped, and a simulated rank builds its model where it runs."""
    if next(module.parameters()).device != torch.device(device):
        module = module.to(device)
    return module


class SimulateError(RuntimeError):
    """A simulation asked for where it cannot run (one line)."""


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank `rank` of a `world_size`-rank job in this process: the fake backend as the default
    process group, and fake tensors for everything created inside. Both undone on exit."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SimulateError("fake_world needs a process without a process group (run it alone)")
    if not 0 <= rank < world_size:
        raise SimulateError(f"rank {rank} is not in a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with ExitStack() as undo:
            for owner, names in _READS_NUMBERS_BACK:
                for name in names(owner()):
                    undo.enter_context(_with_real_tensors(owner(), name))
            undo.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            yield
    finally:
        dist.destroy_process_group()


def _device_mesh() -> type[DeviceMesh]:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


def _grid() -> type[ParallelGrid]:
    from dtl.grid import ParallelGrid

    return ParallelGrid


def _methods(cls: type) -> list[str]:
    """The functions defined on cls itself (plain and static methods; classmethods and
    properties are not callable in vars() and are left as they are)."""
    return [n for n, v in vars(cls).items() if callable(v) or isinstance(v, staticmethod)]


# Code that keeps a small tensor of rank numbers and reads them back (a device mesh's rank list,
# the grid's rank table, then .tolist()): under fake tensors the numbers are not there, so it runs
# with real ones. What it computes (which ranks, which groups) is bookkeeping, not model state.
_READS_NUMBERS_BACK: tuple[tuple[Callable[[], type], Callable[[type], Iterable[str]]], ...] = (
    (_device_mesh, lambda cls: ("__init__", "from_group")),
    (_grid, _methods),
)


@contextmanager
def _with_real_tensors(owner: type, name: str) -> Iterator[None]:
    """owner.name runs with fake tensors off while the context lasts; restored on exit."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = owner.__dict__[name]
    fn = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(fn)
    def real(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    setattr(owner, name, staticmethod(real) if isinstance(original, staticmethod) else real)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def deepspeed_under_fake_tensors(ds: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """DeepSpeed's ZeRO-3 (with or without CPU offload) as one rank of a fake_world: yields the
    ds_config to pass to deepspeed.initialize, and undoes its patches on exit. Six places in
    DeepSpeed 0.19 read values or data pointers, each replaced while the context lasts:
      - the engine asserts the launcher's LOCAL_RANK / RANK / WORLD_SIZE: set for this rank;
      - it moves the module to its device (`module.to`), which cannot swap fake parameters:
        built with dont_change_device (the module is on the simulated device already);
      - its fused and CPU Adam kernels read the tensors' memory: torch's AdamW instead
        (`torch_adam`: the same exp_avg and exp_avg_sq per element);
      - the overflow check (stage3's is_invalid_grad_norm) and the CPU-offload norm read a value:
        they answer "no overflow" and a zero norm (nothing is clipped: no values to clip);
      - from the second step, the module trace is checked equal on every rank by reading rank
        0's back (assert_ints_same_as_other_ranks): one simulated rank is its own rank 0.
    NVMe offload writes data to disk and reads it back: it cannot be simulated. On exit it also
    puts back torch.nn.functional.linear, which DeepSpeed's ZeRO-3 replaces for the rest of the
    process with its own autograd Function."""
    if not dist.is_initialized() or dist.get_backend() != "fake":
        raise SimulateError("deepspeed_under_fake_tensors runs inside fake_world only")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partitioned_param_coordinator, stage3

    zero = ds.get("zero_optimization", {})
    if any(
        (zero.get(s) or {}).get("device") == "nvme" for s in ("offload_param", "offload_optimizer")
    ):
        raise SimulateError("NVMe offload writes and reads data; a simulation has none")
    ds = {
        **ds,
        "optimizer": {
            **ds["optimizer"],
            "params": {**ds["optimizer"]["params"], "torch_adam": True},
        },
    }
    env = dict(
        RANK=str(dist.get_rank()),
        LOCAL_RANK="0",
        WORLD_SIZE=str(dist.get_world_size()),
        LOCAL_WORLD_SIZE="1",
    )
    saved_env = {k: os.environ.get(k) for k in env}
    build = DeepSpeedEngine.__init__
    optimizer = stage3.DeepSpeedZeroOptimizer_Stage3
    patches = [
        (
            DeepSpeedEngine,
            "__init__",
            lambda self, *a, **k: build(self, *a, **{**k, "dont_change_device": True}),
        ),
        (stage3, "is_invalid_grad_norm", lambda norm: False),
        (
            optimizer,
            "complete_grad_norm_calculation_for_cpu_offload",
            lambda self, params: torch.zeros(()),  # host: a norm nothing reads, in a fake world
        ),
        (partitioned_param_coordinator, "assert_ints_same_as_other_ranks", lambda ints: None),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    # ZeRO-3 replaces torch.nn.functional.linear with its own autograd Function for good ("This
    # will persist unless manually reset"): put torch's back, or every later nn.Linear in this
    # process runs DeepSpeed's (it saves its tensors after the matmul, not before)
    originals.append((torch.nn.functional, "linear", torch.nn.functional.linear))
    try:
        os.environ.update(env)
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        yield ds
    finally:
        from deepspeed.utils import groups

        groups._release_process_group_references()  # its cached groups die with the fake world
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
