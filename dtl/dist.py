"""Process-group plumbing every lesson shares: init, cleanup, printing (the grid: dtl/grid.py).

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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

# torch.distributed.nn.functional binds `group=group.WORLD` as a default argument when it is
# first imported, and torch._dynamo imports it (the first torch.optim optimizer does). Imported
# after init_process_group, those defaults hold the default group: destroy_process_group() then
# neither frees it nor joins gloo's worker threads. A worker that is still releasing its last work
# (the barrier's) when the interpreter starts shutting down needs the GIL for a Python object in
# that work's thread-local state; Python ends the thread instead, and the process aborts
# ("terminate called without an active exception", about 1 exit in 100). Imported here, before
# any process group exists, the defaults are None and destroy_process_group() frees the group.
import torch.distributed.nn  # noqa: F401
from torch.distributed.tensor import DTensor

from dtl import profile
from dtl.flat import FlatBuffer
from dtl.optim import clip_coefficient
from dtl.simulate import item

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


def launch_world_size() -> int:
    """The world size the launcher gave this process (torchrun's WORLD_SIZE; 1 under plain
    python), readable before any process group exists: what configs validate against."""
    return _env_int("WORLD_SIZE", 1)


BACKENDS = ("gloo", "nccl")


class BackendError(ValueError):
    """A backend that cannot run here; the message is one line."""


def choose_backend(local_world_size: int) -> str:
    """NCCL when every local rank can own a GPU, gloo otherwise; DTL_BACKEND overrides."""
    forced = os.environ.get("DTL_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise BackendError(
                f"DTL_BACKEND={forced!r} is not a backend this course runs; use one of "
                f"{', '.join(BACKENDS)} (or unset it for the automatic choice)"
            )
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def local_world_size() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE,
    else the world size (one node)."""
    world = _env_int("WORLD_SIZE", 1)
    return _env_int("LOCAL_WORLD_SIZE", _env_int("LOCAL_SIZE", world))


def planned_backend() -> str:
    """The backend this run has, or will have once init() runs: known before any process group,
    so a config can be checked against the device (DeepSpeed's accelerator, device memory) first.
    Raises BackendError (one line) for a DTL_BACKEND the course does not run."""
    if dist.is_initialized():
        return dist.get_backend()
    return choose_backend(local_world_size())


def timeout_s() -> float:
    return float(os.environ.get("DTL_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def init(backend: str | None = None, timeout: float | None = None) -> DistInfo:
    """Join (or create) the default process group and pick this rank's device.

    Idempotent: a second call returns the same info. `backend` overrides the automatic choice.
    """
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_size = local_world_size()
    if dist.is_initialized():  # already joined (e.g. under dtl.testing): report what it is
        backend = dist.get_backend()
    else:
        automatic = backend is None and not os.environ.get("DTL_BACKEND")
        try:
            backend = backend or choose_backend(local_size)
        except BackendError as e:
            exit_with_error(e)
        if automatic and backend == "gloo" and torch.cuda.is_available() and rank == 0:
            # a GPU machine with fewer GPUs than local ranks: say it, or a PASS reads as a GPU's
            print(
                f"note: gloo on the CPU: {local_size} ranks on this node, "
                f"{torch.cuda.device_count()} GPU(s) (NCCL needs one GPU per rank); "
                "this run is not a GPU result",
                flush=True,
            )
    if backend == "nccl" and not torch.cuda.is_available():
        exit_with_error("backend nccl needs CUDA GPUs; this machine has none (use gloo)")
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = dict(
            backend=backend, timeout=datetime.timedelta(seconds=timeout or timeout_s())
        )
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
    return DistInfo(rank, world_size, local_rank, local_size, backend, device)


def _attempt_store(world_size: int) -> dist.Store:
    """torchrun's store, with keys namespaced by restart attempt.

    After `--max-restarts` restarts the workers, they share the agent's store with the dead
    attempt; gloo's rendezvous can read the dead workers' addresses from it and fail with
    "connectFullMesh failed ... Connection refused". A prefix per attempt gives every attempt a
    clean key space (tests/test_dtl_dist.py restarts a crashed rank through it).
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


def finish(ok: bool = True) -> None:
    """A script's last call: cleanup() (barrier, destroy the group, gc), then exit 1 when the
    run's own checks failed, so torchrun, make tour and CI see the failure."""
    cleanup()
    if not ok:
        raise SystemExit(1)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else _env_int("RANK", 0)


def run_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must be on to enter a collective on `group` (default: the world):
    this rank's GPU under NCCL, the CPU under gloo (a gloo run on a GPU machine included).
    NCCL raises at once on a CPU tensor; gloo would take a tensor from anywhere, which is why
    every tensor the course builds for a collective names this device."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA stream runs ahead of the host; a timer must
    wait for it); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_scalar(
    value: float, group: dist.ProcessGroup | None = None, average: bool = False
) -> float:
    """Sum (or average) one Python number over `group`: a float64 tensor on the device the
    backend needs (NCCL only reduces CUDA tensors), for losses and timings in step logs."""
    t = torch.tensor([value], dtype=torch.float64, device=run_device(group))
    dist.all_reduce(t, group=group)
    return t.item() / (dist.get_world_size(group) if average else 1)


def norm_of_pieces(pieces: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> float:
    """The 2-norm of a tensor spread over ranks: each rank's squares of the pieces it counts,
    summed in float64, all-reduced over `group` (the world by default). Collective."""
    sq = torch.zeros(1, dtype=torch.float64, device=run_device(group))
    for piece in pieces:
        sq += piece.detach().double().pow(2).sum().to(sq.device)
    dist.all_reduce(sq, group=group)
    return item(sq.sqrt())  # nan under dtl.simulate's fake tensors: no value to read


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_by_pieces(
    params: Iterable[torch.Tensor], counted: Iterable[torch.Tensor], max_norm: float | None
) -> float:
    """Global-norm clipping of gradients spread over ranks: the norm of the `counted`
    parameters' gradients, this rank's pieces of them (each element counted on one rank), over
    the world (norm_of_pieces), then clip_grad_norm_'s rule applied to every gradient of
    `params`. Returns the norm before clipping. Collective."""
    norm = norm_of_pieces(local_piece(p.grad) for p in counted if p.grad is not None)
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def average_gradients(
    params: Iterable[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    divisor: int | None = None,
) -> int:
    """Data parallelism after the fact: every gradient averaged over `group`, in one all-reduce
    per dtype (the gradients flattened into one buffer, as a DDP bucket is), for lessons whose
    backward is not a single call DDP could hook (a pipeline's micro-batches). Returns the bytes
    all-reduced. `divisor` (default: the group's size) is what the sum is divided by: more than
    the group when each gradient already sums other ranks' shares (an expert's, under expert
    parallelism). Parameters without a gradient are skipped; every rank must hold the same
    parameters with gradients, in the same order."""
    n = dist.get_world_size(group)
    divisor = divisor or n
    grads = [p.grad for p in params if p.grad is not None]
    if divisor == 1 or not grads:
        return 0
    sent = 0
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        flat = FlatBuffer.of(same)  # (sum of numels,): one bucket
        if n > 1:
            with profile.range(profile.comm_name("all_reduce", "dp grads")):
                dist.all_reduce(flat.data, group=group)
            sent += flat.data.numel() * flat.data.element_size()
        flat.data /= divisor
        flat.copy_to(same)
    return sent


def exit_with_error(error: Exception | str) -> NoReturn:
    """Bad user input: one line `error: ...` on stderr (rank 0), exit code 2 on every rank."""
    if get_rank() == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on global rank 0 only."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def print_rank(*args: object) -> None:
    """Every rank prints, prefixed by its rank; one write() per line so lines never interleave."""
    text = " ".join(str(a) for a in args)
    lines = "".join(f"[rank {get_rank()}] {line}\n" for line in text.splitlines() or [""])
    os.write(sys.stdout.fileno(), lines.encode())


def world_table(info: DistInfo) -> list[tuple[int, int, str, str, str]]:
    """Gather (rank, local rank, host, device, backend) from every rank (all_gather_object)."""
    mine = (info.rank, info.local_rank, socket.gethostname(), str(info.device), info.backend)
    rows: list[Any] = [None] * info.world_size
    dist.all_gather_object(rows, mine)
    return rows


def hosts_line(info: DistInfo) -> str:
    """Which host runs which ranks, e.g. "2 hosts: node0 (ranks 0-7), node1 (ranks 8-15)"
    (a collective: world_table's all_gather_object)."""
    ranks_of: dict[str, list[int]] = {}
    for rank, _, host, _, _ in world_table(info):
        ranks_of.setdefault(host, []).append(rank)
    parts = [f"{host} (rank{'s' if len(r) > 1 else ''} {_span(r)})" for host, r in ranks_of.items()]
    return f"{len(ranks_of)} host{'s' if len(ranks_of) > 1 else ''}: {', '.join(parts)}"


def _span(ranks: list[int]) -> str:
    contiguous = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    if contiguous and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
