"""Day 17: what DDP does between loss.backward() and optimizer.step(), written by hand.

Three gradient-sync strategies for any module (the shared GPT included), each a drop-in wrapper
used exactly like torch's DDP: `loss_fn(model(x), y).backward(); opt.step()`.

    naive    after backward, one blocking all-reduce per gradient: nothing overlaps
    overlap  a hook on every parameter launches an async all-reduce the moment its grad is ready
    bucket   hooks copy grads into flat buckets (reverse parameter order, a small first bucket,
             a size cap); a full bucket launches one async all-reduce; the buckets are rebuilt
             after the first iteration in the order the gradients actually became ready

Every strategy computes g = (1/n) sum_r g_r: the gradient of the mean loss over the global batch,
what one process computes on the n local batches concatenated. Each collective runs inside a
named range (dtl.profile.range): `all_reduce bucket 3` around its launch, `wait all_reduce`
around the wait before the optimizer, so a trace or an Nsight Systems report names them.
Names in the comments point at torch's C++ Reducer (torch/csrc/distributed/c10d/reducer.cpp),
which these classes imitate.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from day17_ddp import ddp_logging
from dtl import profile as dtl_profile
from dtl.dist import run_device
from dtl.exercise_seam import exercise
from dtl.flat import FlatBuffer

SYNC_MODES = ("naive", "overlap", "bucket", "ddp")
MiB = 1024 * 1024


class SyncError(ValueError):
    """Bad sync configuration; a one-line message, raised before any collective."""


def check_sync_args(sync: str, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> None:
    if sync not in SYNC_MODES:
        raise SyncError(f"unknown sync mode '{sync}'; choose one of {', '.join(SYNC_MODES)}")
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise SyncError(f"{name} must be a number of MiB > 0, got {value!r}")


@exercise("day17.assign_buckets")
def assign_buckets(
    nbytes: list[int], order: list[int], first_cap: int, cap: int
) -> list[list[int]]:
    """Group parameter indices, taken in `order`, into buckets (compute_bucket_assignment_by_size).

    nbytes[i]: parameter i's gradient size in bytes. Returns the buckets, each a list of
    indices in `order`'s order: every index once, none left out. A bucket closes as soon as its
    size reaches its limit (>=, so one large tensor may exceed it); the first bucket's limit is
    `first_cap`, every later one `cap`. A last bucket below its limit is kept.
    """
    # exercise day17.assign_buckets: begin
    buckets, current, size, limit = [], [], 0, first_cap
    for i in order:
        current.append(i)
        size += nbytes[i]
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, cap
    if current:  # the remainder: a bucket that never reached its limit
        buckets.append(current)
    # exercise day17.assign_buckets: end
    return buckets


class CommStats:
    """One backward's all-reduces as [t_launch, t_done, bytes, bucket], compute end, blocked."""

    def __init__(self):
        self.events: list[list] = []
        self.last_ready = 0.0  # time.perf_counter() when the last grad hook fired
        self.compute_end = 0.0  # when the whole backward graph was done (_finalize)
        self.blocked_s = 0.0  # time the training thread waited on communication after that
        self.pending_at_compute_end = 0  # all-reduces still in flight when compute ended
        self.bucket_ready_order: list[int] = []  # buckets in the order their grads completed

    def stamp(self, nbytes: int, bucket: int | None = None) -> list:
        event = [time.perf_counter(), None, nbytes, bucket]
        self.events.append(event)
        return event


class _GradSync(nn.Module):
    """The part all three strategies share: broadcast at start, hooks, no_sync, end-of-backward."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        # parameters() de-duplicates: the GPT's tied wte/lm_head weight is one tensor, one grad
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.require_backward_grad_sync = True  # the flag DDP's no_sync() flips
        self._armed = False  # "expect_autograd_hooks_": this backward must sync
        self._queued = False
        self._ready = set()
        self._futures: list = []
        self.stats = CommStats()
        self._broadcast_from_rank0()
        self._hooks = []
        for i, p in enumerate(self.params):
            # fires after p.grad has been accumulated: the post-hook DDP puts on AccumulateGrad
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        # DDP's _sync_module_states: every replica starts from rank 0's parameters and buffers
        src = dist.get_global_rank(self.group or dist.group.WORLD, 0)
        with dtl_profile.range(dtl_profile.comm_name("broadcast", "parameters")):
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t, src=src, group=self.group)

    @exercise("day17.bucket_sync")
    def forward(self, *args, **kwargs):
        # DDP decides in *forward* whether the next backward syncs (Reducer::prepare_for_backward).
        # Flipping require_backward_grad_sync after forward changes nothing for that backward.
        # self._armed is what the grad hooks read; a backward that syncs starts from a fresh
        # prepare_for_backward() (no grad ready yet, no all-reduce launched)
        # exercise day17.bucket_sync: begin
        self._armed = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._armed:
            self.prepare_for_backward()
        # exercise day17.bucket_sync: end
        return self.module(*args, **kwargs)

    def prepare_for_backward(self) -> None:
        self.stats = CommStats()
        self._ready.clear()
        self._futures = []  # the async all-reduces this backward launches (none for naive)

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: forward+backward inside the block keep their grads local."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def remove_hooks(self) -> None:
        """Detach from the parameters (the module keeps working, unsynchronized)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _make_hook(self, i: int):
        # the hook lives on the parameter; a weak reference back to the sync keeps the
        # parameter -> hook -> sync -> module -> parameter loop out of the garbage collector,
        # so the sync dies with its last reference, not at interpreter shutdown
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            self = ref()
            if self is None or not self._armed:  # no_sync: the grad accumulates in p.grad
                return
            if not self._queued:  # run _finalize once the whole backward graph is done
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self._ready.add(i)
            self.stats.last_ready = time.perf_counter()  # stamped before grad_ready may launch
            self.grad_ready(i, p)

        return hook

    def _finalize(self) -> None:
        # Reducer::finalize_backward: runs after the last AccumulateGrad, before backward returns
        self.stats.compute_end = time.perf_counter()
        self.stats.pending_at_compute_end = sum(not f.done() for f in self._futures)
        missing = [i for i in range(len(self.params)) if i not in self._ready]
        if missing:
            raise RuntimeError(
                f"parameters {missing} got no gradient in this backward; the "
                "hand-written sync needs every parameter used in the loss"
            )
        self.reduce_and_wait()
        self.stats.blocked_s = time.perf_counter() - self.stats.compute_end
        self._armed = self._queued = False
        # the sync is finished: drop its futures (and the gloo work they hold). Kept until the
        # next backward, they outlived destroy_process_group() in a script's last step and were
        # destroyed during interpreter shutdown, which aborted the process ("terminate called
        # without an active exception") in about 1 of 8 exits
        self._futures = []

    def _all_reduce_async(self, flat: torch.Tensor, bucket: int | None = None, index: int = 0):
        """Launch a SUM all-reduce of `flat` in place; the returned future also stamps its end.
        The range names it `all_reduce bucket <bucket>` (or <index>: a tensor's own "bucket")."""
        event = self.stats.stamp(flat.numel() * flat.element_size(), bucket)
        name = dtl_profile.comm_name("all_reduce", f"bucket {index if bucket is None else bucket}")
        with dtl_profile.range(name):
            work = dist.all_reduce(flat, group=self.group, async_op=True)

        def done(fut):
            # gloo: runs on its worker thread when the all-reduce is done. NCCL completes the
            # future when the kernel is *enqueued* (the GPU runs it later), so there this stamps
            # the launch: the GPU-side times are in the profiler trace (observe.trace_spans)
            event[1] = time.perf_counter()
            return fut.value()

        return work.get_future().then(done)

    # the strategy-specific part
    def grad_ready(self, i: int, p: torch.Tensor) -> None:
        raise NotImplementedError

    def reduce_and_wait(self) -> None:
        raise NotImplementedError


class NaiveDDP(_GradSync):
    """All-reduce every gradient after backward: simple, correct, and nothing overlaps."""

    def grad_ready(self, i, p):
        pass  # only arms _finalize; all the communication happens after backward

    def reduce_and_wait(self):
        for i, p in enumerate(self.params):  # one blocking collective per tensor: 28 for tiny
            event = self.stats.stamp(p.grad.numel() * p.grad.element_size())
            p.grad.div_(self.world_size)  # pre-divide: SUM of g_r / n = mean
            with dtl_profile.range(dtl_profile.comm_name("all_reduce", f"bucket {i}")):
                dist.all_reduce(p.grad, group=self.group)
            event[1] = time.perf_counter()


class OverlapDDP(_GradSync):
    """One async all-reduce per parameter, launched by its hook while backward goes on."""

    def grad_ready(self, i, p):
        # p.grad is final for this backward: AccumulateGrad ran and nothing writes it again
        p.grad.div_(self.world_size)
        self._futures.append(self._all_reduce_async(p.grad, index=i))

    def reduce_and_wait(self):
        with dtl_profile.range(dtl_profile.comm_name("all_reduce", wait=True)):
            for fut in self._futures:
                fut.wait()


class BucketDDP(_GradSync):
    """Flat buckets, one async all-reduce per bucket, launched strictly in bucket order."""

    def __init__(self, module, group=None, bucket_cap_mb=25.0, first_bucket_mb=1.0, rebuild=True):
        check_sync_args("bucket", bucket_cap_mb, first_bucket_mb)  # before the broadcast
        super().__init__(module, group)
        self.cap, self.first_cap = int(bucket_cap_mb * MiB), int(first_bucket_mb * MiB)
        self.rebuild, self.rebuilt = rebuild, False
        self.nbytes = [p.numel() * p.element_size() for p in self.params]
        # first guess of the ready order: reverse registration (the output layer is used last)
        self.ready_order: list[int] = []
        self.build(list(reversed(range(len(self.params)))))

    def build(self, order: list[int]) -> None:
        """Reducer::initialize_buckets: one flat buffer per bucket, a view per parameter."""
        self.layout = assign_buckets(self.nbytes, order, self.first_cap, self.cap)
        self.buffers, self.views, self.locator = [], [], {}
        for b, idx in enumerate(self.layout):
            params = [self.params[i] for i in idx]
            # (sum of numels,) zeros; views[j] is a slice of it shaped like params[j]
            bucket = FlatBuffer(params, dtype=params[0].dtype, device=params[0].device)
            self.buffers.append(bucket.data)
            self.views.append(bucket.views)
            self.locator.update({i: (b, j) for j, i in enumerate(idx)})

    def prepare_for_backward(self):
        super().prepare_for_backward()
        if self.rebuild and not self.rebuilt and len(self.ready_order) == len(self.params):
            self.rebuild_buckets()
        self.pending = [len(idx) for idx in self.layout]
        self.next_bucket = 0

    def rebuild_buckets(self) -> None:
        # Reducer::rebuild_buckets + sync_bucket_indices: rank 0's observed order wins everywhere.
        # (P,) int64 parameter indices, broadcast from rank 0, on the device the group's backend
        # needs: this rank's GPU under NCCL (a CPU tensor here kills a GPU run at its first
        # rebuild, the second step), the CPU under gloo
        order = torch.tensor(self.ready_order, dtype=torch.int64, device=run_device(self.group))
        with dtl_profile.range(dtl_profile.comm_name("broadcast", "bucket order")):
            src = dist.get_global_rank(self.group or dist.group.WORLD, 0)
            dist.broadcast(order, src=src, group=self.group)
        self.build(order.tolist())
        self.rebuilt = True

    @exercise("day17.bucket_sync")
    def grad_ready(self, i, p):
        if not self.rebuilt:
            self.ready_order.append(i)  # Reducer::push_rebuilt_params
        # p is parameter i: slot j of bucket b, views[b][j] its slice of the flat buffers[b].
        # Copy its gradient into the bucket divided by n (mark_variable_ready_dense), count it
        # off pending[b], and launch every bucket that is full, in index order only
        # (Reducer::mark_bucket_ready): next_bucket is the first not yet launched. Every rank
        # then issues the same all-reduces in the same order even if its grads arrive
        # differently. _all_reduce_async(buffers[b], bucket=b) returns a future: keep it in
        # self._futures, which reduce_and_wait waits on.
        b, j = self.locator[i]
        # exercise day17.bucket_sync: begin
        torch.mul(p.grad, 1.0 / self.world_size, out=self.views[b][j])  # copy and divide at once
        self.pending[b] -= 1
        while self.next_bucket < len(self.layout) and self.pending[self.next_bucket] == 0:
            full = self.next_bucket
            self._futures.append(self._all_reduce_async(self.buffers[full], bucket=full))
            self.next_bucket += 1
        # exercise day17.bucket_sync: end
        if self.pending[b] == 0:  # the order buckets filled in, whatever the launch order
            self.stats.bucket_ready_order.append(b)

    @exercise("day17.bucket_sync")
    def reduce_and_wait(self):
        with dtl_profile.range(dtl_profile.comm_name("all_reduce", wait=True)):
            for fut in self._futures:  # the wait before the optimizer step
                fut.wait()
        # the buckets hold the averaged gradients: back into each parameter's .grad
        # (Reducer::copy_bucket_to_grad); layout[b][j] is the parameter index of views[b][j]
        # exercise day17.bucket_sync: begin
        for b, idx in enumerate(self.layout):
            for j, i in enumerate(idx):
                self.params[i].grad.copy_(self.views[b][j])
        # exercise day17.bucket_sync: end

    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, comparable with DDP's logging data 'rebuilt_bucket_sizes'."""
        return [sum(self.nbytes[i] for i in idx) for idx in self.layout]


def torch_ddp(module, group=None, bucket_cap_mb=25.0, first_bucket_mb=1.0, **ddp_kwargs):
    """torch DDP with the same bucket limits as BucketDDP (torch 2.13 semantics).

    DDP(bucket_cap_mb=X) sets the first bucket to X too; only the defaults give 1 MiB + 25 MiB.
    Any other (first, cap) pair is passed as bucket_cap_mb_list=[first, cap].
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if (first_bucket_mb, bucket_cap_mb) == (1.0, 25.0):
        caps = {}
    elif first_bucket_mb == bucket_cap_mb:
        caps = {"bucket_cap_mb": bucket_cap_mb}
    else:
        caps = {"bucket_cap_mb_list": [first_bucket_mb, bucket_cap_mb]}
    model = DDP(module, process_group=group, **caps, **ddp_kwargs)
    ddp_logging.time_every_iteration(model)  # the Reducer's timing stats on every iteration
    return model


def wrap(
    module: nn.Module,
    sync: str,
    group=None,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    **ddp_kwargs,
) -> nn.Module:
    """The one entry point: validate (before any collective), then build the wrapper."""
    check_sync_args(sync, bucket_cap_mb, first_bucket_mb)
    if sync == "naive":
        return NaiveDDP(module, group)
    if sync == "overlap":
        return OverlapDDP(module, group)
    if sync == "bucket":
        return BucketDDP(module, group, bucket_cap_mb, first_bucket_mb)
    return torch_ddp(module, group, bucket_cap_mb, first_bucket_mb, **ddp_kwargs)
