"""Day 20: what one pipeline step held in flight, counted from the tensors alive.

A schedule promises how many micro-batches keep activations at once (1F1B: at most p - r on
rank r); LiveActivations counts what autograd really holds while the runtime runs the list, so a
runtime that keeps a graph longer than its schedule says shows in StepRecord.peak_in_flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from day20_pp.schedules import Action
from dtl.state import storage_key


@dataclass
class StepRecord:
    """What one step did on this rank: the actions' host times and the in-flight high-water:
    the most micro-batches whose activations autograd held at once, counted from the tensors
    alive (LiveActivations), not from the action list."""

    spans: list[tuple[float, float, Action]] = field(default_factory=list)
    peak_in_flight: int = 0


class LiveActivations:
    """Which (micro-batch, chunk) pairs have activations alive right now. Every tensor autograd
    saves for backward during a forward passes through `pack` (torch's saved_tensors_hooks) and
    is wrapped in a _Held tagged with the action running; the wrapper dies when autograd frees
    its graph (after B, or after W for zero-bubble's kept graph), and its count with it. A
    runtime that kept a graph longer than its schedule says shows here; parameters are skipped
    (autograd saves the weights too, and they are alive all the time)."""

    def __init__(self, params):
        self.params = {storage_key(p) for p in params}
        self.count: dict[tuple[int, int], int] = {}
        self.key: tuple[int, int] | None = None  # the action running: (mb, chunk)

    def pack(self, t: torch.Tensor):
        if self.key is None or storage_key(t) in self.params:
            return t
        return _Held(t, self)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def in_flight(self) -> int:
        return sum(1 for n in self.count.values() if n > 0)


class _Held:
    __slots__ = ("tensor", "live", "key")

    def __init__(self, tensor: torch.Tensor, live: LiveActivations):
        self.tensor, self.live, self.key = tensor, live, live.key
        live.count[self.key] = live.count.get(self.key, 0) + 1

    def __del__(self):
        self.live.count[self.key] -= 1
