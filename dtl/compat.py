"""Collectives whose names are new in a recent torch, called through one place.

torch 2.13 renamed the one-tensor collectives that FSDP and ZeRO are built on:

    all_gather_into_tensor(out, x)   ->  all_gather_single(out, x)      (N,) -> (n*N,)
    reduce_scatter_tensor(out, x)    ->  reduce_scatter_single(out, x)  (n*N,) -> (N,)

The new names do not exist in torch 2.11 or 2.12 (which GPU images often ship); the old names
exist in all three (deprecated in 2.13). The course calls `compat.all_gather_single(...)`, which
takes the newest name this torch has. The lookup happens at every call, not at import, so
`dtl.comm.CommCounter`, which swaps the `torch.distributed` functions while it counts, still sees
the call.

The guard that keeps a 2.13-only call from coming back: with DTL_HIDE_NEW_COLLECTIVES=1 (the test
suite sets it, tests/conftest.py) `hide_new_collectives()` replaces the two new names with a
function that raises when the course's own code calls it directly, and forwards calls from torch
itself (torch 2.13's FSDP2 calls `dist.all_gather_single`). compat then takes the old names, so
the whole suite runs the path a torch 2.11 machine runs.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import torch
import torch.distributed as dist

# the torch 2.13 name -> the name every supported torch has
NEW_TO_OLD = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}
HIDE_ENV = "DTL_HIDE_NEW_COLLECTIVES"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# frames that may sit between a caller and the real collective: this file, the counter's wrapper
_PASS_THROUGH = {os.path.abspath(__file__), os.path.join(_REPO, "dtl", "comm.py")}


def collective(new_name: str) -> Callable[..., Any]:
    """The function torch has for `new_name`: itself where it exists (and is not hidden), else the
    older name it had before torch 2.13."""
    fn: Callable[..., Any] | None = getattr(dist, new_name, None)
    if fn is None or getattr(fn, "dtl_hidden", False):
        return cast("Callable[..., Any]", getattr(dist, NEW_TO_OLD[new_name]))
    return fn


def _call(new_name: str, *args: Any, **kwargs: Any) -> dist.Work | None:
    fn: Callable[..., dist.Work | None] = collective(new_name)
    if fn.__name__ == new_name:
        return fn(*args, **kwargs)
    with warnings.catch_warnings():  # torch 2.13 calls the old names deprecated: we know
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)


def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """(N,) on each of n ranks -> (n*N,) on every rank, rank k's tensor at [k*N, (k+1)*N)."""
    return _call("all_gather_single", output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """(n*N,) on each of n ranks -> (N,): slice r of the sum over ranks, on rank r."""
    return _call("reduce_scatter_single", output, input, op=op, group=group, async_op=async_op)


def available() -> dict[str, bool]:
    """Which of the new names this torch really has (hidden ones count as absent)."""
    return {name: collective(name) is getattr(dist, name, None) for name in NEW_TO_OLD}


def _course_caller() -> str | None:
    """'file:line' of the nearest caller outside compat/comm when it is the course's own code
    (dtl/ or a day folder), else None (torch, DeepSpeed, megatron-core or a test)."""
    frame: FrameType | None = sys._getframe(2)
    while frame and os.path.abspath(frame.f_code.co_filename) in _PASS_THROUGH:
        frame = frame.f_back
    if frame is None:
        return None
    path = os.path.abspath(frame.f_code.co_filename)
    rel = os.path.relpath(path, _REPO)
    top = rel.split(os.sep)[0]
    if top == "dtl" or top.startswith("day"):
        return f"{rel}:{frame.f_lineno}"
    return None


def _hidden(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def hidden(*args: Any, **kwargs: Any) -> Any:
        caller = _course_caller()
        if caller:
            raise AttributeError(
                f"{caller} calls torch.distributed.{name}, which torch < 2.13 does not have; "
                f"call dtl.compat.{name} instead"
            )
        return real(*args, **kwargs)

    hidden.dtl_hidden = True  # type: ignore[attr-defined]  # a marker attribute on a function
    return hidden


def hide_new_collectives() -> None:
    """Make the torch 2.13-only names unusable from the course's code (see the module docstring).
    Idempotent; a no-op on a torch that lacks them anyway."""
    for name in NEW_TO_OLD:
        real = getattr(dist, name, None)
        if real is not None and not getattr(real, "dtl_hidden", False):
            setattr(dist, name, _hidden(name, real))


if os.environ.get(HIDE_ENV) == "1":
    hide_new_collectives()
