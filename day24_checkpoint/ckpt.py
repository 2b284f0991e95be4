"""Day 24: a training state, saved sharded (sync or async), committed atomically, loaded anywhere.

What a training state is, and where each piece lives here (`AppState`):

    model, optimizer       get_state_dict(model, optimizer): plain tensors under DDP, DTensor
                           shards under FSDP2; every rank writes the pieces it owns (DCP)
    scheduler              its state_dict (the step it counts from)
    progress               step and samples seen: the data position (batches are a pure
                           function of (seed, step, dp rank), dtl.data.get_batch)
    rng                    each rank's torch generator state (dropout masks), one key per rank
    config, code version   meta.json beside the shards (rank 0), with the file manifest

A checkpoint folder, committed in three moves so that a crash at any moment leaves either the old
checkpoint or the new one, never a half-written one that gets loaded:

    1. every rank writes into   <dir>/step_00000040.tmp/   (DCP: __<rank>_0.distcp + .metadata)
    2. rank 0 writes meta.json (sizes and sha256 of every file), renames the folder to
       <dir>/step_00000040/  (one rename: atomic on a POSIX file system)
    3. rank 0 points <dir>/latest at it (write latest.tmp, then os.replace: atomic), and
       deletes checkpoints beyond the newest `keep`

Loading reads `latest`, checks every file against the manifest (a missing or corrupted shard
is a one-line CheckpointError naming the file, never a silent load), checks the model config,
then lets DCP read each rank's pieces, resharding when the world size or the sharding changed.

    ckpt = Checkpointer("outputs/run/ckpt", keep=3, async_save=True)
    step = ckpt.load(app) if ckpt.latest() else 0        # every rank
    ...; ckpt.save(app, step); ckpt.poll()               # every rank; poll commits async saves
    ckpt.wait()                                          # before exit
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dtl.dist import run_device
from dtl.exercise_seam import exercise
from dtl.shared_folder import require_shared_folder

PREFIX, TMP, OLD, LATEST, META = "step_", ".tmp", ".old", "latest", "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line and names the file."""


# --- the application state --------------------------------------------------------------------


@dataclass
class Progress:
    step: int = 0  # optimizer steps done: the next batch is get_batch(..., step=step)
    samples: int = 0  # sequences seen, over all ranks


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class RunState(Stateful):
    """What every saved run holds beside its tensors: the progress, the scheduler (if any), each
    rank's generators. AppState (a torch model) and sharded.StackState (day 22's stack) add the
    model and optimizer; Checkpointer saves and loads either."""

    def __init__(self, scheduler=None, progress: Progress | None = None, restore_rng: bool = True):
        self.scheduler = scheduler
        self.progress = progress or Progress()
        self.restore_rng = restore_rng
        self.rng_key = f"rank{_rank()}"
        self.load_rng = True  # set False by Checkpointer.load when the world size changed

    def run_state_dict(self) -> dict:
        state = {"progress": asdict(self.progress)}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.load_rng:  # one key per rank: rank r reads back only its own generators
            state["rng"] = {self.rng_key: rng_bytes()}
        return state

    def load_run_state_dict(self, state: dict) -> None:
        self.progress = Progress(**state["progress"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.load_rng and self.restore_rng:
            set_rng_bytes(state["rng"][self.rng_key])


class AppState(RunState):
    """Everything a resumed run needs, as one DCP-saveable object."""

    def __init__(
        self,
        model,
        optimizer,
        scheduler=None,
        progress: Progress | None = None,
        restore_rng: bool = True,
    ):
        super().__init__(scheduler, progress, restore_rng)
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, **self.run_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        sd = dict(model_state_dict=state["model"], optim_state_dict=state["optim"])
        set_state_dict(self.model, self.optimizer, **sd)
        self.load_run_state_dict(state)


def run_uses_cuda() -> bool:
    """Does this process compute on a GPU? Its process group's device when there is one (NCCL:
    cuda:<local rank>; gloo: the CPU, on a GPU machine too), else whether it has used CUDA."""
    if dist.is_initialized():
        return run_device().type == "cuda"
    return torch.cuda.is_initialized()


def rng_bytes() -> bytes:
    """This process's generators (the CPU's, and its GPU's when the run computes there: dropout
    on a GPU draws from it) as one bytes value. DCP saves a non-tensor value whole and loads it
    by replacement, so a checkpoint written on a CPU loads on a GPU machine and the other way
    round (a dict of tensors would be flattened into keys that one side lacks). Not run on a
    GPU: by design, and tested only between CPU runs."""
    state = {"cpu": torch.get_rng_state()}
    if run_uses_cuda():  # the current device's: cuda:<local rank>, set by dtl.dist.init
        state["cuda"] = torch.cuda.get_rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def set_rng_bytes(data: bytes) -> None:
    """Put back what rng_bytes saved; a GPU state only on a run that computes on its GPU (a
    CPU run's checkpoint restores the CPU generator alone, and the other way round)."""
    state = torch.load(io.BytesIO(data), weights_only=True)
    torch.set_rng_state(state["cpu"])
    if run_uses_cuda() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# --- the folder layout ------------------------------------------------------------------------


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{PREFIX}{step:08d}")


def committed(root: str) -> list[str]:
    """Committed checkpoints, oldest commit first (folders with a meta.json; never a .tmp).

    Ordered by commit time, not by step: a fresh run writing step 4 into a folder where an
    older run left step 16 must keep its own step 4 (retention deletes the oldest commits)."""
    if not os.path.isdir(root):
        return []
    paths = [
        os.path.join(root, n) for n in os.listdir(root) if n.startswith(PREFIX) and "." not in n
    ]
    done = [p for p in paths if os.path.isfile(os.path.join(p, META))]
    return sorted(done, key=lambda p: (os.path.getmtime(os.path.join(p, META)), p))


def latest(root: str) -> str | None:
    """The checkpoint `latest` points to, or None when there is none."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    if not os.path.isdir(path) and os.path.isdir(path + OLD):
        path += OLD  # a crash between setting the old folder aside and the new rename
    if not os.path.isfile(os.path.join(path, META)):
        raise CheckpointError(f"{pointer} points to {name}, which is not a committed checkpoint")
    return path


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(folder: str) -> dict[str, list]:
    """name -> [bytes, sha256] of every file DCP wrote (the shards and .metadata)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name != META:
            path = os.path.join(folder, name)
            out[name] = [os.path.getsize(path), _sha256(path)]
    return out


def code_version() -> str:
    """The git commit of the code that wrote the checkpoint ("unknown" outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


@exercise("day24.verify")
def verify(path: str, expect_config: dict | None = None) -> dict:
    """Check a committed checkpoint before loading it: meta.json readable, every file present
    with its size and sha256, the model config equal. Returns meta. One-line errors."""
    # meta.json: {"files": {name: [bytes, sha256]}, "config": ..., ...}, written by the commit.
    # Each fault is a CheckpointError of one line that names the file: no meta.json, a
    # meta.json that is not JSON, a listed file missing, a size or a sha256 that differs
    # exercise day24.verify: begin
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} has no {META}: not a committed checkpoint")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path} is unreadable: {e}") from None
    for name, (size, sha) in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint file {file} is missing")
        if os.path.getsize(file) != size or _sha256(file) != sha:
            raise CheckpointError(
                f"checkpoint file {file} is corrupt (size or sha256 differs from meta.json)"
            )
    # exercise day24.verify: end
    if expect_config is not None and meta["config"] != expect_config:
        diff = [
            f"{k} {meta['config'].get(k)} (checkpoint) vs {v}"
            for k, v in expect_config.items()
            if meta["config"].get(k) != v
        ]
        raise CheckpointError(f"{path} is from another model config: {'; '.join(diff)}")
    return meta


# --- saving and loading ----------------------------------------------------------------------


@dataclass
class SaveRecord:
    step: int
    blocked_s: float  # how long the training loop was held up by this save
    total_s: float = 0.0  # from the call to the commit
    started: float = field(default_factory=time.perf_counter)


class Checkpointer:
    """Sharded saves (sync or async) with an atomic commit, retention and `latest`; loads."""

    def __init__(
        self,
        root: str,
        *,
        keep: int = 3,
        async_save: bool = False,
        config: dict | None = None,
        on_write=None,
    ):
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        # rank 0 alone commits a step every rank loads: across nodes, a folder all of them see
        require_shared_folder(root, "checkpoint folder")
        self.root, self.keep, self.async_save = root, keep, async_save
        self.config = config or {}
        self.on_write = on_write  # a hook called after this rank's shard is written (drills)
        # async saves run their collectives (plan gather, metadata) on their own process group,
        # from a background thread: on the training group they could interleave with DDP's
        # all-reduces in a different order on different ranks and deadlock
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: tuple | None = None  # (future, step, tmp path, record)
        self.records: list[SaveRecord] = []
        self.code = code_version()
        if _rank() == 0:
            self._remove_stale_tmp()

    def _remove_stale_tmp(self) -> None:
        """What a crash can leave: a half-written step_N.tmp (never loaded: removed) and, in
        the instant of re-committing an existing step, step_N.old (put back, or removed)."""
        if os.path.isdir(self.root):
            for name in os.listdir(self.root):
                path = os.path.join(self.root, name)
                if name.endswith(TMP):
                    shutil.rmtree(path, ignore_errors=True)
                elif name.endswith(OLD) and not os.path.exists(path[: -len(OLD)]):
                    os.rename(path, path[: -len(OLD)])  # a crash mid-commit: put it back
                elif name.endswith(OLD):
                    shutil.rmtree(path, ignore_errors=True)

    def latest(self) -> str | None:
        return latest(self.root)

    # save -----------------------------------------------------------------------------------
    def save(self, app: AppState, step: int) -> SaveRecord:
        """Save `app` as of now; returns how long training was blocked."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight: its staged copy is still in memory
        tmp = step_dir(self.root, step) + TMP
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._barrier()
        record = SaveRecord(step, 0.0, started=t0)
        writer = _DrillWriter(tmp, self.on_write, step)
        if self.async_save:  # stage a copy (blocks), write it from a thread (does not)
            future = dcp.async_save({"app": app}, storage_writer=writer, process_group=self.group)
            self.pending = (future, step, tmp, record)
            record.blocked_s = time.perf_counter() - t0
        else:
            dcp.save({"app": app}, storage_writer=writer, process_group=self.group)
            self._commit(step, tmp, record)
            self._barrier()  # every rank returns with the checkpoint committed
            record.blocked_s = time.perf_counter() - t0
        self.records.append(record)
        return record

    def poll(self) -> None:
        """Commit an async save that has finished (rank 0); never blocks."""
        if self.pending is not None and self.pending[0].done():
            self._finish_pending()

    def wait(self) -> None:
        """Block until the async save in flight (if any) is written and committed."""
        if self.pending is not None:
            self.pending[0].result()
            self._finish_pending()

    def _finish_pending(self) -> None:
        future, step, tmp, record = self.pending
        self.pending = None
        future.result()  # re-raises a failed write here, in the training thread
        self._commit(step, tmp, record)

    @exercise("day24.atomic_commit")
    def _commit(self, step: int, tmp: str, record: SaveRecord) -> None:
        # DCP returns on rank 0 only after every rank's write succeeded and .metadata is on
        # disk, so rank 0 alone can commit; the other ranks need not wait for it
        if _rank() == 0:
            meta = dict(
                step=step,
                world_size=_world(),
                config=self.config,
                code=self.code,
                torch=torch.__version__,
                time=time.strftime("%Y-%m-%d %H:%M:%S"),
                files=_manifest(tmp),
            )
            # the three moves, each durable before the next (module top): meta on disk in the
            # .tmp folder, the folder renamed to step_dir (a step already there set aside as
            # .old first), `latest` replaced whole; then the .old and every checkpoint beyond
            # the newest `keep` (committed(): commit order) removed, never the one just made
            # exercise day24.atomic_commit: begin
            with open(os.path.join(tmp, META), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            final = step_dir(self.root, step)
            if os.path.exists(final):  # the same step again: set the old one aside first, so
                os.replace(final, final + OLD)  # `latest` never points at a deleted folder
            os.rename(tmp, final)  # 2. the commit
            pointer = os.path.join(self.root, LATEST)
            with open(pointer + TMP, "w") as f:
                f.write(os.path.basename(final))
                f.flush()
                os.fsync(f.fileno())
            os.replace(pointer + TMP, pointer)  # 3. latest moves
            shutil.rmtree(final + OLD, ignore_errors=True)
            for old in committed(self.root)[: -self.keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
            # exercise day24.atomic_commit: end
        record.total_s = time.perf_counter() - record.started

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # load -----------------------------------------------------------------------------------
    def load(self, app: AppState, path: str | None = None) -> int:
        """Load `path` (default: latest) into `app`, resharding if needed; returns its step."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint to resume from in {self.root}")
        meta = verify(path, self.config or None)
        app.load_rng = meta["world_size"] == _world()  # per-rank generators: same ranks only
        dcp.load(
            {"app": app},
            checkpoint_id=path,
            process_group=self.group,
            no_dist=not dist.is_initialized(),
        )  # one process: no collectives at all
        app.load_rng = True
        return app.progress.step


class _DrillWriter(dcp.FileSystemWriter):
    """DCP's file writer, plus a hook after this rank's data is written (the kill drills)."""

    def __init__(self, path, on_write, step):
        super().__init__(path)
        self.on_write, self.step = on_write, step

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if self.on_write is not None:
            future.wait()
            self.on_write(self.step)
        return future
