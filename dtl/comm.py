"""Count what crosses the wire: calls and bytes per collective, so lessons print measured volume
beside the formula.

    with CommCounter() as comm:             # or CommCounter(group=tp_group)
        dist.all_reduce(t)
    comm.calls["all_reduce"], comm.bytes["all_reduce"], comm.ring_bytes_per_rank()

It wraps the `torch.distributed` Python functions while active, so it sees every call made through
`dist.<op>` from Python: the hand-written lessons, `batch_isend_irecv` lists, and libraries that
call `dist.*` (FSDP2's all_gather_single / reduce_scatter_single; on torch < 2.13, which lacks
those names, all_gather_into_tensor / reduce_scatter_tensor). It wraps only the names this torch
has. It does not see collectives
issued from C++ (DDP's Reducer: day 17 counts those with a comm hook) nor the functional
collectives DTensor uses (`torch.distributed._functional_collectives`).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md): busbw = algbw x factor(n), the traffic
# per link relative to S. For ring all-reduce / all-gather / reduce-scatter that is also what each
# rank sends; for broadcast and reduce (a pipelined chain) each link carries S once.
BUSBW_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # counted on the sender
}


def _nbytes(x: torch.Tensor | Iterable[torch.Tensor]) -> int:
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
    "all_gather_single": ("all_gather", "output_tensor"),  # torch 2.13's name, used by FSDP2
    "reduce_scatter": ("reduce_scatter", "input_list"),  # S = the full input
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
}


def _group_key(group: dist.ProcessGroup | None) -> int:
    return id(dist.group.WORLD if group is None else group)


class CommCounter:
    """Counts calls and bytes (S, the collective's data size) per kind of collective."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        # bytes x factor(size of the call's group), per call: Counters of floats, typed as the
        # dicts they are (typeshed's Counter holds ints)
        self.ring_bytes = cast("dict[str, float]", Counter())
        self.world: dict[str, int] = {}  # the group size last seen for each kind
        # id(group) -> ring bytes of calls on it
        self.group_ring_bytes = cast("dict[int, float]", Counter())
        self._saved: dict[str, Any] = {}

    def _matches(self, group: dist.ProcessGroup | None) -> bool:
        if self.group is None:
            return True
        if group is None or group is dist.group.WORLD:
            return self.group is dist.group.WORLD
        return group is self.group

    def _count(self, kind: str, nbytes: int, group: dist.ProcessGroup | None) -> None:
        if self._matches(group):
            n = dist.get_world_size(group)
            self.calls[kind] += 1
            self.bytes[kind] += nbytes
            self.ring_bytes[kind] += nbytes * BUSBW_FACTOR[kind](n)
            self.world[kind] = n
            self.group_ring_bytes[_group_key(group)] += nbytes * BUSBW_FACTOR[kind](n)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind, data_arg = _OPS[name]
        sig = inspect.signature(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            self._count(kind, _nbytes(bound.arguments[data_arg]), bound.arguments.get("group"))
            return fn(*args, **kwargs)

        # a name dtl.compat hides (DTL_HIDE_NEW_COLLECTIVES) stays hidden behind the counter (a
        # marker attribute on a function, which mypy does not model)
        counted.dtl_hidden = getattr(fn, "dtl_hidden", False)  # type: ignore[attr-defined]
        return counted

    def _wrap_batch(
        self, batch_fn: Callable[..., list[dist.Work]]
    ) -> Callable[..., list[dist.Work]]:
        def counted(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
            for op in p2p_op_list:  # P2POp(op, tensor, peer, group): one send or recv each
                # by name: op.op is torch's own isend even when dist.isend is wrapped
                kind = "send" if op.op.__name__ == "isend" else "recv"
                self._count(kind, _nbytes(op.tensor), op.group)
            return batch_fn(p2p_op_list)

        return counted

    def __enter__(self) -> CommCounter:
        names = [n for n in (*_OPS, "P2POp", "batch_isend_irecv") if hasattr(dist, n)]
        originals = {name: getattr(dist, name) for name in names}
        self._saved = originals
        for name in _OPS:
            if name in originals:  # all_gather_single exists from torch 2.13 only
                setattr(dist, name, self._wrap(name, originals[name]))
        # P2POp only accepts the real isend/irecv (it checks identity), so hand it those back;
        # the ops inside a batch are counted by the batch_isend_irecv wrapper instead.
        real = {dist.isend: originals["isend"], dist.irecv: originals["irecv"]}
        base = originals["P2POp"]

        # the class in force now (a subclass, if a counter is already active): mypy cannot check
        # a base class held in a variable
        class P2POp(base):  # type: ignore[misc,valid-type]
            def __new__(cls, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                return base.__new__(cls, real.get(op, op), *args, **kwargs)

            def __init__(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
                super().__init__(real.get(op, op), *args, **kwargs)

        dist.P2POp = P2POp  # type: ignore[misc]  # replaced while the counter is active
        batch = originals["batch_isend_irecv"]
        dist.batch_isend_irecv = self._wrap_batch(batch)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved = {}

    def ring_bytes_per_rank(self, kind: str | None = None) -> float:
        """Bytes per link if every counted collective runs a bandwidth-optimal ring (each call
        weighted by its own group's size)."""
        return sum(self.ring_bytes[k] for k in ([kind] if kind else list(self.ring_bytes)))

    def ring_bytes_on(self, *groups: dist.ProcessGroup | None) -> float:
        """Ring bytes of the calls made on any of `groups` (process groups; None = the world):
        what a lesson with several groups (TP, PP, DP) reports per axis."""
        keys = {_group_key(g) for g in groups}
        return sum(self.group_ring_bytes[k] for k in keys)

    def table(self) -> str:
        rows = [f"{'collective':<16}{'calls':>7}{'bytes (S)':>14}{'ring bytes/rank':>17}"]
        for k in sorted(self.calls):
            rows.append(
                f"{k:<16}{self.calls[k]:>7}{self.bytes[k]:>14,}"
                f"{self.ring_bytes_per_rank(k):>17,.0f}"
            )
        return "\n".join(rows)
