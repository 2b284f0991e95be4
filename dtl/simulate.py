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
code that reads a number back with .item() must not run), time, the allocator's fragmentation
and caching, NCCL's own buffers, kernel workspaces, and anything that depends on data (a data_ptr
comparison between two fake tensors means nothing). The numbers it gives are what the code
holds, not what a GPU's memory counter would show on top.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist

CANNOT_SEE = (
    "values (loss, norms), time, allocator fragmentation and caching, NCCL buffers, "
    "kernel workspaces"
)


def item(t: torch.Tensor) -> float:
    """t.item(), or nan for a fake tensor: code that reports a loss runs under simulation too,
    where there is no value to read."""
    from torch._subclasses.fake_tensor import FakeTensor

    return float("nan") if isinstance(t, FakeTensor) else t.item()


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


def _device_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


def _grid():
    from dtl.grid import ParallelGrid

    return ParallelGrid


def _methods(cls) -> list[str]:
    return [n for n, v in vars(cls).items() if callable(v) or isinstance(v, staticmethod)]


# Code that keeps a small tensor of rank numbers and reads them back (a device mesh's rank list,
# the grid's rank table, then .tolist()): under fake tensors the numbers are not there, so it runs
# with real ones. What it computes (which ranks, which groups) is bookkeeping, not model state.
_READS_NUMBERS_BACK = (
    (_device_mesh, lambda cls: ("__init__", "from_group")),
    (_grid, _methods),
)


@contextmanager
def _with_real_tensors(owner, name: str) -> Iterator[None]:
    """owner.name runs with fake tensors off while the context lasts; restored on exit."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = owner.__dict__[name]
    fn = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(fn)
    def real(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    setattr(owner, name, staticmethod(real) if isinstance(original, staticmethod) else real)
    try:
        yield
    finally:
        setattr(owner, name, original)
