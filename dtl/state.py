"""What one rank holds of the model's state, counted from the live tensors: one counter, one record.

    held = live_state_bytes(model.parameters(), optimizer)  # after the step, before zero_grad
    held.params, held.grads, held.optim, held.total         # bytes on this rank, now
    dict(held)                                              # {"params": .., "grads": .., ...}

Every day that prints "per-rank state, measured vs formula" counts with this: day 18's trainers
(by hand, torch's DDP/FSDP2), day 22's stack, day 28's strategies; DeepSpeed's engines, whose
partitions live in its own attributes, fill the same record (day18_zero/ds_engine.py, day 23's
measure by location). A DTensor (FSDP2) counts only its local shard: what is in this rank's memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields

import torch

KINDS = ("params", "grads", "optim")


@dataclass(frozen=True)
class StateBytes(Mapping[str, int]):
    """A rank's bytes of parameters, gradients and optimizer state (masters + Adam's moments).
    Also a read-only mapping kind -> bytes, for tables and sums."""

    params: int = 0
    grads: int = 0
    optim: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim

    def __getitem__(self, kind: str) -> int:
        if kind not in KINDS:
            raise KeyError(kind)
        value: int = getattr(self, kind)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(f.name for f in fields(self))

    def __len__(self) -> int:
        return len(KINDS)

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(*(self[k] + other[k] for k in KINDS))


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor in this rank's memory: 0 for None, the local shard of a DTensor."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor (FSDP2): only this rank's shard is in memory
        t = t.to_local()
    return t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> int:
    """One number per block of memory: equal for a tensor and its views, different for two
    tensors that do not share memory. The storage object's identity, not its data pointer, so it
    works under fake tensors too (dtl.simulate), where there is no data to point to."""
    key: int = t.untyped_storage()._cdata
    return key


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, *, counters: bool = True) -> int:
    """Bytes of the optimizer's tensors (Adam's exp_avg and exp_avg_sq, ...). `counters=False`
    leaves out 0-dim tensors (Adam's per-parameter step count, 4 bytes each), which formulas in
    bytes per parameter do not count."""
    return sum(
        nbytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and (counters or v.dim() > 0)
    )


def live_state_bytes(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, *, counters: bool = True
) -> StateBytes:
    """Count, from the tensors themselves, what this rank holds right now."""
    params = list(params)
    return StateBytes(
        params=sum(nbytes(p) for p in params),
        grads=sum(nbytes(p.grad) for p in params),
        optim=optimizer_state_bytes(optimizer, counters=counters),
    )
