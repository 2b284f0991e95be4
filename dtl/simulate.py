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

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

CANNOT_SEE = (
    "values (loss, norms), time, allocator fragmentation and caching, NCCL buffers, "
    "kernel workspaces"
)


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
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        dist.destroy_process_group()
