"""Process-group plumbing every lesson shares: init, cleanup, printing, and the 4-D parallel grid.

Under torchrun each process finds RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in its environment; `init()` reads them. Run as plain `python script.py` and `init()`
builds a one-process group, so every lesson also runs (and can be debugged) without a launcher.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120  # a desync fails in two minutes instead of NCCL's default 10 (gloo: 30)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def choose_backend(local_world_size: int) -> str:
    """NCCL when every local rank can own a GPU, gloo otherwise; DTL_BACKEND overrides."""
    forced = os.environ.get("DTL_BACKEND")
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def timeout_s() -> float:
    return float(os.environ.get("DTL_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def init(backend: str | None = None, timeout: float | None = None) -> DistInfo:
    """Join (or create) the default process group and pick this rank's device.

    Idempotent: a second call returns the same info. `backend` overrides the automatic choice.
    """
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if dist.is_initialized():  # already joined (e.g. under dtl.testing): report what it is
        backend = dist.get_backend()
    else:
        backend = backend or choose_backend(local_world_size)
    if backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("error: backend nccl needs CUDA GPUs; this machine has none (use gloo)")
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout or timeout_s()))
        if device.type == "cuda":
            # eager NCCL init: the communicator exists before the first op, so a lesson whose
            # first NCCL call is point-to-point (where some ranks may sit a round out) is safe
            kwargs["device_id"] = device
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(
                store=_attempt_store(world_size), rank=rank, world_size=world_size, **kwargs
            )
        elif "MASTER_ADDR" in os.environ:
            dist.init_process_group(rank=rank, world_size=world_size, **kwargs)
        else:  # plain `python script.py`: a one-process group backed by an in-memory store
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return DistInfo(rank, world_size, local_rank, local_world_size, backend, device)


def _attempt_store(world_size: int) -> dist.Store:
    """torchrun's store, with keys namespaced by restart attempt.

    After `--max-restarts` restarts the workers, they share the agent's store with the dead
    attempt; gloo's rendezvous could read the dead workers' addresses from it and fail with
    "connectFullMesh failed ... Connection refused" (3 of 8 restarts here). A prefix per attempt
    gives every attempt a clean key space (0 failures since).
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s()),
    )
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def cleanup() -> None:
    """Barrier, destroy, collect: without the gc.collect, gloo workers sometimes abort at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else _env_int("RANK", 0)


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def print_rank(*args) -> None:
    """Every rank prints, prefixed by its rank; one write() per line so lines never interleave."""
    text = " ".join(str(a) for a in args)
    lines = "".join(f"[rank {get_rank()}] {line}\n" for line in text.splitlines() or [""])
    os.write(sys.stdout.fileno(), lines.encode())


def world_table(info: DistInfo) -> list[tuple]:
    """Gather (rank, local rank, host, device, backend) from every rank (all_gather_object)."""
    mine = (info.rank, info.local_rank, socket.gethostname(), str(info.device), info.backend)
    rows: list = [None] * info.world_size
    dist.all_gather_object(rows, mine)
    return rows


# ---------------------------------------------------------------------------------------------
# The parallel grid: Megatron's default rank order "tp-cp-dp-pp" (parallel_state's `order`, with
# expert parallelism 1): TP innermost, so a TP group shares a node's fast links; PP outermost.
# ---------------------------------------------------------------------------------------------

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost


class ParallelGrid:
    """Rank <-> (dp, pp, cp, tp) coordinates, and one process group per axis.

    Rank r sits at `torch.arange(world).view(pp, dp, cp, tp)[p, d, c, t] == r`: consecutive ranks
    differ in tp first, then cp, then dp, then pp. Megatron's own example, 16 GPUs, tp=2 pp=4
    (so dp=2): tp groups [0,1] [2,3] ...; dp groups [0,2] [1,3] [4,6] ...; pp groups
    [0,4,8,12] [1,5,9,13] ... (megatron/core/parallel_state.py, initialize_model_parallel).
    """

    def __init__(self, dp=1, pp=1, cp=1, tp=1, *, world_size=None, rank=None, build_groups=None):
        self.sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for axis, size in self.sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelGrid: {axis} must be a positive integer, got {size!r}")
        initialized = dist.is_initialized()
        world_size = (
            world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        )
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        product = dp * pp * cp * tp
        if product != world_size:
            raise ValueError(
                f"ParallelGrid: dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {product} "
                f"does not match world size {world_size}"
            )
        self.world_size = world_size
        self.ranks = torch.arange(world_size).view(pp, dp, cp, tp)
        where = (self.ranks == self.rank).nonzero()[0].tolist()
        self.coords = dict(zip(AXES, where))
        self.groups: dict[str, object] = {}
        if build_groups if build_groups is not None else initialized:
            self._build_groups()

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, as lists of global ranks (the same on every rank)."""
        k = AXES.index(axis)
        moved = self.ranks.movedim(k, -1).reshape(-1, self.sizes[axis])
        return [row.tolist() for row in moved]

    def ranks_along(self, axis: str) -> list[int]:
        """The global ranks in this rank's group along `axis`."""
        return next(g for g in self.group_ranks(axis) if self.rank in g)

    def _build_groups(self) -> None:
        # new_group is collective: every rank creates every group, in the same order, keeps its own.
        for axis in AXES:
            for ranks in self.group_ranks(axis):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[axis] = group

    def __getattr__(self, name: str):
        # grid.tp_rank, grid.dp_size, grid.pp_group ... read off the tables above
        axis, _, what = name.partition("_")
        if axis in AXES and what in ("rank", "size", "group"):
            if what == "rank":
                return self.coords[axis]
            if what == "size":
                return self.sizes[axis]
            return self.groups[axis]
        raise AttributeError(name)

    def __str__(self) -> str:
        sizes = "-".join(f"{a.upper()}({self.sizes[a]})" for a in reversed(AXES))
        coords = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"{sizes} rank {self.rank}: {coords}"
