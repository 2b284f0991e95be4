"""The benchmark's operations: what each one runs, its bus-bandwidth factor and its closed-form
check. Built-ins go through torch.distributed; the rest are the hand-written algorithms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from day16_nccl import algorithms as algo
from dtl import compat
from dtl.comm import BUSBW_FACTOR

# op name -> (nccl-tests kind for the busbw factor, hand-written?)
OPS = {
    "all_reduce": ("all_reduce", False),
    "all_gather": ("all_gather", False),
    "reduce_scatter": ("reduce_scatter", False),
    "broadcast": ("broadcast", False),
    "ring_all_reduce": ("all_reduce", True),
    "tree_all_reduce": ("all_reduce", True),
    "dbt_all_reduce": ("all_reduce", True),
    "ring_reduce_scatter": ("reduce_scatter", True),
    "ring_all_gather": ("all_gather", True),
}


@dataclass
class Case:
    numel: int  # elements of S (the full vector)
    elem: int  # bytes per element
    factor: float  # busbw / algbw
    run: Callable[[], object]  # one call, on buffers made once (in-place ops grow them x n a call)
    check: Callable[[], int]  # one call on integer-valued data: elements wrong, summed over ranks


def _base(numel: int, dtype, device) -> torch.Tensor:
    # small integers: every partial sum is exact in every dtype (|sum| <= 3 * n(n+1)/2 <= 256 for
    # n <= 12, bf16's exact-integer range), so "wrong" means wrong, not rounded differently
    return (torch.arange(numel, device=device) % 7 - 3).to(dtype)


def _run_and_expect(op: str, numel: int, dtype, device, chunk: int):
    """Return (fn, expected): fn() runs `op` once on fresh integer-valued inputs."""
    n, r = dist.get_world_size(), dist.get_rank()
    base, m = _base(numel, dtype, device), numel // n
    mine, total = (r + 1) * base, n * (n + 1) // 2 * base  # sum_k (k + 1) = n(n+1)/2
    if op in ("all_reduce", "ring_all_reduce", "tree_all_reduce", "dbt_all_reduce"):
        fns = {
            "all_reduce": dist.all_reduce,
            "ring_all_reduce": algo.ring_all_reduce,
            "tree_all_reduce": lambda t: algo.tree_all_reduce(t, chunk_bytes=chunk),
            "dbt_all_reduce": lambda t: algo.double_tree_all_reduce(t, chunk_bytes=chunk),
        }
        return (lambda: (fns[op](mine), mine)[1]), total
    if op == "broadcast":
        return (lambda: (dist.broadcast(mine, src=0), mine)[1]), base  # rank 0 holds 1 * base
    if op in ("all_gather", "ring_all_gather"):
        parts = [(k + 1) * base[k * m : (k + 1) * m] for k in range(n)]
        out = torch.empty(numel, dtype=dtype, device=device)  # both get a preallocated output
        if op == "ring_all_gather":
            return (lambda: algo.ring_all_gather(parts[r], numel, out=out)[0]), torch.cat(parts)
        return (lambda: (compat.all_gather_single(out, parts[r]), out)[1]), torch.cat(parts)
    expected = total[r * m : (r + 1) * m]  # reduce_scatter: chunk r of the sum
    out = torch.empty(m, dtype=dtype, device=device)
    if op == "ring_reduce_scatter":
        return (lambda: algo.ring_reduce_scatter(mine, out=out)[0]), expected
    return (lambda: (compat.reduce_scatter_single(out, mine), out)[1]), expected


def make_case(op: str, nbytes: int, n: int, dtype, device, chunk_bytes: int) -> Case:
    kind, _ = OPS[op]
    elem = dtype.itemsize  # bytes per element, read off the dtype: no tensor needed
    numel = max(nbytes // elem, 1)
    if kind in ("all_gather", "reduce_scatter"):
        numel = max(numel // n, 1) * n  # nccl-tests too rounds the count to a multiple of n

    def check() -> int:
        fn, expected = _run_and_expect(op, numel, dtype, device, chunk_bytes)
        wrong = torch.tensor([(fn() != expected).sum().item()], device=device)
        dist.all_reduce(wrong)
        return int(wrong.item())

    timed, _ = _run_and_expect(op, numel, dtype, device, chunk_bytes)
    return Case(numel, elem, BUSBW_FACTOR[kind](n), timed, check)
