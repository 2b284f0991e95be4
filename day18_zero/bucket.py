"""Day 18: one ZeRO bucket: some parameters laid end to end, padded to a multiple of N, of which
this rank owns slice `rank`. zero.py's ZeroModel drives the buckets through a step; the two
collectives every stage runs live here, with their shapes:

    reduce_scatter  (P,) this rank's local gradients -> (P/N,) the mean of my slice over ranks
    all_gather      (P/N,) my slice of the parameters -> (P,) every slice, in rank order (stage 3:
                    just before a unit runs; stages 1 and 2: the new parameters after the step)

Each runs inside a named range (dtl.profile.range) with the bucket's label: `reduce_scatter
bucket 1` or `all_gather unit 2` around the launch, `wait all_gather unit 2` around the wait.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtl import compat
from dtl import profile as dtl_profile
from dtl.exercise_seam import exercise
from dtl.flat import FlatBuffer
from dtl.precision import at_least_fp32


class Bucket:
    """Some parameters laid end to end, padded to a multiple of N; this rank owns slice `rank`.

    Stages 1 and 2 keep the full flat parameters (the model's parameters are views into them);
    stage 3 keeps only this rank's slice and re-creates the full buffer when the unit runs.
    """

    def __init__(
        self,
        params,
        names,
        stage: int,
        rank: int,
        world: int,
        group,
        offload: bool = False,
        label: str = "bucket",
    ):
        self.params, self.names = params, names
        self.label = label  # its name in the ranges: "bucket 1" (stages 1-2), "unit 2", "root"
        self.offload = offload  # the optimizer's tensors (master, m, v) kept in CPU memory
        self.stage, self.rank, self.world, self.group = stage, rank, world, group
        # (P,) = every parameter's values end to end, then zeros up to a multiple of N
        self.full = FlatBuffer.of([p.detach() for p in params], pad_to=world)
        self.dtype = self.full.data.dtype
        self._point_params_at_full()  # p is now a view of self.full: writes to one show in both
        if stage == 3:
            # (P/N,): the only copy of my slice; the full buffer's memory is given back
            self.param_shard = self.full.shard(rank, world).clone()
            self.free_full_params()
        else:
            # a view: the optimizer's update of my slice lands in the full parameters directly
            self.param_shard = self.full.shard(rank, world)
        # the tensor the optimizer steps: my slice itself in fp32 (or fp64), an fp32 copy
        # ("master") in bf16 or when the optimizer is offloaded (ZeRO-Offload: the copy lives in
        # CPU memory, so the optimizer's m and v are created there too, and its step runs there)
        master_dtype = at_least_fp32(self.dtype)  # never narrower than the parameters
        # a separate copy or the slice itself: said once, here (a data_ptr comparison would mean
        # nothing under dtl.simulate's fake tensors)
        self.master_is_copy = self.dtype != master_dtype or offload
        if not self.master_is_copy:
            self.master = nn.Parameter(self.param_shard)  # shares the slice's memory
        else:
            home = "cpu" if offload else self.param_shard.device  # bf16 alone: stays on device
            master = self.param_shard.detach().to(home, master_dtype, copy=True)
            self.master = nn.Parameter(master)
        # gradients: stage 1 keeps them full (P,), stages 2 and 3 only my averaged slice (P/N,)
        self.full_grads: FlatBuffer | None = self._new_grad_buffer() if stage == 1 else None
        self.grad_shard = (
            self.full_grads.shard(rank, world) if stage == 1 else self._zeros(self.shard_numel)
        )
        self.arrived: set[int] = set()  # parameters whose gradient arrived in this backward
        self.reduce_work = None  # the async reduce-scatter in flight, if any
        self.gather_work = None  # stage 3: the async all-gather in flight (a prefetch), if any
        self.gathered = stage < 3

    @property
    def padded_numel(self) -> int:
        return self.full.data.numel()

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.dtype, device=self.full.data.device)

    def _new_grad_buffer(self) -> FlatBuffer:
        return FlatBuffer(
            self.full.shapes, dtype=self.dtype, device=self.full.data.device, pad_to=self.world
        )

    def _point_params_at_full(self) -> None:
        for p, view in zip(self.params, self.full.views):
            p.data = view

    # --- gradients ------------------------------------------------------------------------------

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        """Move one parameter's gradient into the bucket's full (P,) gradient buffer."""
        if self.full_grads is None:  # stages 2 and 3 allocate it per backward (or per no_sync)
            self.full_grads = self._new_grad_buffer()
        self.full_grads.views[i].add_(grad)
        self.arrived.add(i)

    @property
    def complete(self) -> bool:
        return len(self.arrived) == len(self.params)

    @exercise("day18.zero2_reduce_scatter")
    def launch_reduce_scatter(self) -> None:
        # (P,) my local grads on every rank -> (P/N,) the SUM over ranks of my slice, written in
        # place into my slice of the same buffer (NCCL and gloo both accept this aliasing);
        # asynchronous: the handle goes to self.reduce_work, finish_reduce_scatter waits on it
        data = self.full_grads.data
        with dtl_profile.range(dtl_profile.comm_name("reduce_scatter", self.label)):
            # exercise day18.zero2_reduce_scatter: begin
            mine = self.full_grads.shard(self.rank, self.world)  # a (P/N,) view into data
            self.reduce_work = compat.reduce_scatter_single(
                mine, data, group=self.group, async_op=True
            )
            # exercise day18.zero2_reduce_scatter: end

    @exercise("day18.zero2_reduce_scatter")
    def finish_reduce_scatter(self) -> None:
        """Wait; turn the sum into the mean; stages 2/3 add it to the kept slice, free the rest."""
        with dtl_profile.range(dtl_profile.comm_name("reduce_scatter", self.label, wait=True)):
            self.reduce_work.wait()
        self.reduce_work = None
        mine = self.full_grads.shard(self.rank, self.world)  # (P/N,): the sum over the ranks
        # stage 1: grad_shard is this very view. Stages 2/3: grad_shard is a (P/N,) tensor of its
        # own, kept across micro-steps; the (P,) buffer exists only until its slice is taken
        # exercise day18.zero2_reduce_scatter: begin
        if self.stage == 1:
            mine.div_(self.world)
        else:
            self.grad_shard.add_(mine, alpha=1.0 / self.world)  # accumulates across micro-steps
            self.full_grads = None  # the (P,) buffer is gone: only (P/N,) stays (ZeRO-2's saving)
        # exercise day18.zero2_reduce_scatter: end

    def zero_grad(self) -> None:
        self.grad_shard.zero_()
        if self.stage == 1:
            self.full_grads.data.zero_()
        self.master.grad = None

    # --- stage 3: the full parameters exist only while the unit runs --------------------------

    @exercise("day18.zero3_gather")
    def launch_gather(self) -> None:
        """Start the all-gather of the full parameters (asynchronous: self.gather_work), into
        self.full.data, whose storage free_full_params shrank to 0 bytes: give it its bytes
        back first (untyped_storage().resize_), in place, so the views autograd saved see them."""
        if self.gathered or self.gather_work is not None:
            return
        # (P/N,) my slice on every rank -> (P,) all slices in rank order, into the full buffer
        with dtl_profile.range(dtl_profile.comm_name("all_gather", self.label)):
            # exercise day18.zero3_gather: begin
            storage = self.full.data.untyped_storage()
            storage.resize_(self.padded_numel * self.full.data.element_size())  # memory back
            self.gather_work = compat.all_gather_single(
                self.full.data, self.param_shard, group=self.group, async_op=True
            )
            # exercise day18.zero3_gather: end

    def wait_gather(self) -> None:
        if self.gathered:
            return
        self.launch_gather()  # no-op if a prefetch already launched it
        with dtl_profile.range(dtl_profile.comm_name("all_gather", self.label, wait=True)):
            self.gather_work.wait()
        self.gather_work = None
        self._point_params_at_full()
        self.gathered = True

    def free_full_params(self) -> None:
        """FSDP's trick: shrink the buffer's storage to 0 bytes, so views that autograd saved in
        forward keep pointing at it and see the data again once it is re-gathered for backward;
        the parameters themselves become empty tensors (reading freed storage would crash)."""
        self.full.data.untyped_storage().resize_(0)
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.full.data.device)
        self.gathered = False

    def full_bytes_alive(self) -> int:
        """Bytes the full parameter buffer holds right now (0 when freed): read from storage."""
        return self.full.data.untyped_storage().nbytes()
