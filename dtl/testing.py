"""Run a function on N gloo ranks from pytest: spawn, a FileStore, no ports, fast failure.

    def _body(scale):                      # module level, so spawn can pickle it
        t = torch.ones(3) * dist.get_rank()
        dist.all_reduce(t)
        return t

    results = run_distributed(_body, 2.0, world_size=4)   # [rank0's return, rank1's, ...]

If any rank raises, the test fails at once with that rank's traceback, and the other ranks (which
may be blocked in a collective waiting for the dead one) are killed, not left to time out.

The other half of every check, the one-process reference and the verdict, is dtl.reference.
`script_error` runs a script expecting bad input to stop it with one line.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import get_all_start_methods
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtl import extras as dtl_extras
from dtl.dist import cleanup
from dtl.script_server import run_script

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    import pytest


def script_error(
    module: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120
) -> str:
    """Run `python -m module args` (no torchrun, no process group) expecting bad input to stop
    it: asserts exit code 2 and exactly one line on stderr, and returns that line. The run is a
    fork of dtl.script_server's interpreter (torch imported once, not per check)."""
    run = run_script(module, *args, env={**os.environ, **(env or {})}, timeout_s=timeout_s)
    assert run.code == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert not run.group, f"{module} stopped after creating a process group"
    return lines[0]


def needs_extras(*extras: str) -> pytest.MarkDecorator:
    """skipif for a test (or a whole file: `pytestmark = needs_extras("deepspeed")`) that needs
    optional Python extras. `make test` sets DTL_REQUIRE_EXTRAS=1, and tests/conftest.py then
    turns such a skip into a failure: the suite that CI runs has them installed, so a skip there
    would hide a broken install, never excuse it. (libaio is a system package: not an extra.)"""
    import pytest

    absent = dtl_extras.missing(extras)
    return pytest.mark.skipif(bool(absent), reason=dtl_extras.skip_reason(absent))


class RankFailed(AssertionError):
    """A rank raised: the message carries its traceback."""


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    fn: Callable[..., object],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Queue[tuple[int, str, Any]],
    timeout_s: float,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # plain pickle, not torch's shared-memory handles: the rank may exit before we read it
        payload = pickle.dumps(fn(*args, **kwargs))
        cleanup()  # before reporting "ok": a failing cleanup is reported as this rank's error
        results.put((rank, "ok", payload))
    except BaseException:  # noqa: BLE001 - the whole point is to report anything
        results.put((rank, "error", traceback.format_exc()))


# What every rank imports anyway (~2.7 s of CPU each here): the fork server imports it once and
# forks each rank from there, instead of a fresh interpreter importing torch per rank (spawn).
# megatron-core (~6 s more, torch._inductor included) and DeepSpeed too where installed: DeepSpeed
# only when DS_ACCELERATOR is set, since it picks its accelerator once, at import.
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "dtl.dist", "dtl.model"]
OPTIONAL_PRELOAD = {"megatron.core": None, "deepspeed": "DS_ACCELERATOR"}


def _preload() -> list[str]:
    names = list(PRELOAD)
    for name, needs_env in OPTIONAL_PRELOAD.items():
        installed = importlib.util.find_spec(name.split(".")[0]) is not None
        if installed and (not needs_env or needs_env in os.environ):
            names.append(name)
    return names


def _context() -> SpawnContext | ForkServerContext:
    """The multiprocessing context of the ranks: "forkserver" preloaded with PRELOAD (a fork of
    a clean server process that has started no thread, unlike forking pytest itself), or
    "spawn" where there is no fork server or DTL_SPAWN=1 asks for it."""
    if os.environ.get("DTL_SPAWN") == "1" or "forkserver" not in get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload())
    return ctx


def run_distributed(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 120, **kwargs: Any
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results."""
    ctx = _context()
    results = ctx.Queue()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(  # not a daemon: a rank may start processes of its own (async checkpoints)
                target=_worker,
                args=(r, world_size, store_path, fn, args, kwargs, results, timeout_s, environ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            outputs = _collect(procs, results, world_size, timeout_s)
        except BaseException:
            _reap(procs, grace_s=0)  # the others may be blocked on the failed rank: kill them now
            raise
        _reap(procs, grace_s=10)
    # a rank that returned its result but then died at exit (gloo's abort without cleanup())
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RankFailed(f"rank {bad[0][0]} finished but exited with code {bad[0][1]}")
    return [outputs[r] for r in range(world_size)]


def _collect(
    procs: Sequence[BaseProcess],
    results: Queue[tuple[int, str, Any]],
    world_size: int,
    timeout_s: float,
) -> dict[int, object]:
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s + 30
    while len(outputs) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outputs
            ]
            if dead:
                raise RankFailed(
                    f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                ) from None
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"ranks {sorted(set(range(world_size)) - set(outputs))} "
                    f"did not finish in {timeout_s + 30:.0f} s"
                ) from None
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} failed:\n{payload}")
        outputs[rank] = pickle.loads(payload)
    return outputs


def _reap(procs: Sequence[BaseProcess], grace_s: float) -> None:
    for p in procs:
        p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
