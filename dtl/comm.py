"""Count what crosses the wire: calls and bytes per collective, so lessons print measured volume
beside the formula.

    with CommCounter() as comm:             # or CommCounter(group=tp_group)
        dist.all_reduce(t)
    comm.calls["all_reduce"], comm.bytes["all_reduce"], comm.ring_bytes_per_rank()

It wraps the `torch.distributed` Python functions while active, so it sees every call made through
`dist.<op>` from Python: hand-written lessons, FSDP2/DTensor Python paths. It does not see
collectives issued from C++ (DDP's Reducer): day 17 counts those through a comm hook instead.
"""

from __future__ import annotations

import inspect
from collections import Counter

import torch
import torch.distributed as dist

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md): busbw = algbw x factor(n). For a ring
# (or any bandwidth-optimal point-to-point algorithm) factor x S is what each rank sends.
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # counted on the sender
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)  # a list of tensors


# op name -> (kind it is reported under, argument whose size is "S" per nccl-tests)
_OPS = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),  # S = the gathered output
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),  # S = the full input
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
}


class CommCounter:
    """Counts calls and bytes (S, the collective's data size) per kind of collective."""

    def __init__(self, group=None):
        self.group = group
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.world: dict[str, int] = {}  # group size seen for each kind
        self._saved: dict[str, object] = {}

    def _matches(self, group) -> bool:
        if self.group is None:
            return True
        if group is None or group is dist.group.WORLD:
            return self.group is dist.group.WORLD
        return group is self.group

    def _wrap(self, name: str, fn):
        kind, data_arg = _OPS[name]
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            if self._matches(group):
                self.calls[kind] += 1
                self.bytes[kind] += _nbytes(bound.arguments[data_arg])
                self.world[kind] = dist.get_world_size(group)
            return fn(*args, **kwargs)

        return counted

    def __enter__(self) -> CommCounter:
        for name in _OPS:
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def ring_bytes_per_rank(self, kind: str | None = None) -> float:
        """Bytes each rank sends if every counted collective runs a bandwidth-optimal ring."""
        kinds = [kind] if kind else list(self.bytes)
        return sum(self.bytes[k] * BUSBW_FACTOR[k](self.world.get(k, 1)) for k in kinds)

    def table(self) -> str:
        rows = [f"{'collective':<16}{'calls':>7}{'bytes (S)':>14}{'ring bytes/rank':>17}"]
        for k in sorted(self.calls):
            rows.append(
                f"{k:<16}{self.calls[k]:>7}{self.bytes[k]:>14,}"
                f"{self.ring_bytes_per_rank(k):>17,.0f}"
            )
        return "\n".join(rows)
