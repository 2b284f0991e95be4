"""Many tensors in one flat buffer: a view per tensor, padding to a multiple of the world size.

The data structure under most of data parallelism:
- DDP's buckets (day 17): the gradients of a few parameters laid end to end, so one all-reduce
  moves them all (torch's Reducer::initialize_buckets);
- ZeRO's partitions (day 18): rank r owns the contiguous slice [r·P/n, (r+1)·P/n) of the padded
  flat parameters, gradients and optimizer state (DeepSpeed pads to a multiple of the world size
  so every rank's slice has the same length, which reduce_scatter / all_gather require);
- FSDP's flat parameters (FSDP1) and their per-rank shards.

    buf = FlatBuffer([p.shape for p in params], pad_to=world_size)
    buf.views[i]            # shaped like params[i], a view into buf.data
    buf.shard(rank, world)  # (padded / world,) view: what this rank owns
    buf.shard_ranges(rank, world)  # which tensors (and which of their elements) fall in it

A tensor may straddle two ranks' slices; `shard_ranges` says which part each rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


def padded_size(numel: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= numel."""
    if multiple < 1:
        raise ValueError(f"pad multiple must be >= 1, got {multiple}")
    return -(-numel // multiple) * multiple


@dataclass(frozen=True)
class ShardRange:
    """Elements [start, end) of tensor `index` (flattened) sit at [offset, offset + end - start)
    of the rank's shard."""

    index: int
    start: int
    end: int
    offset: int


class FlatBuffer:
    """One 1-D tensor holding several tensors end to end, then zero padding."""

    def __init__(
        self,
        shapes: Iterable[torch.Size | Sequence[int] | torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pad_to: int = 1,
    ):
        self.shapes = [tuple(s.shape if isinstance(s, torch.Tensor) else s) for s in shapes]
        if not self.shapes:
            raise ValueError("FlatBuffer needs at least one tensor")
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)  # real elements; the padding follows them
        self.pad_to = pad_to
        self.data = torch.zeros(padded_size(self.numel, pad_to), dtype=dtype, device=device)
        self.views = [
            self.data[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)
        ]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], pad_to: int = 1) -> FlatBuffer:
        """A buffer shaped after `tensors` (their dtype and device), holding a copy of them."""
        buf = cls(tensors, dtype=tensors[0].dtype, device=tensors[0].device, pad_to=pad_to)
        buf.copy_from(tensors)
        return buf

    @property
    def padding(self) -> int:
        return self.data.numel() - self.numel

    def copy_from(self, tensors: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for view, t in zip(self.views, tensors, strict=True):
                view.copy_(t)

    def copy_to(self, tensors: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for view, t in zip(self.views, tensors, strict=True):
                t.copy_(view)

    def _shard_bounds(self, rank: int, world_size: int) -> tuple[int, int]:
        if self.data.numel() % world_size:
            raise ValueError(
                f"FlatBuffer of {self.data.numel()} elements (pad_to={self.pad_to}) "
                f"cannot be split evenly over {world_size} ranks: build it with pad_to={world_size}"
            )
        size = self.data.numel() // world_size
        return rank * size, (rank + 1) * size

    def shard(self, rank: int, world_size: int) -> torch.Tensor:
        """Rank `rank`'s equal, contiguous slice: a view, so writes land in the buffer."""
        lo, hi = self._shard_bounds(rank, world_size)
        return self.data[lo:hi]

    def shard_ranges(self, rank: int, world_size: int) -> list[ShardRange]:
        """The pieces of each tensor inside rank `rank`'s slice (padding is not listed)."""
        lo, hi = self._shard_bounds(rank, world_size)
        pieces = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(lo, o), min(hi, o + n)
            if start < end:
                pieces.append(ShardRange(i, start - o, end - o, start - lo))
        return pieces
