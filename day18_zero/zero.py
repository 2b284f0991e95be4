"""Day 18: ZeRO stages 1, 2 and 3 written by hand, for any nn.Module.

DDP (day 17) keeps on every rank a full copy of the parameters, the gradients and the optimizer
state. ZeRO (Rajbhandari et al. 2019) removes the copies one kind of state at a time. With Ψ
parameters and N data-parallel ranks, bytes per rank (mixed precision: 2 + 2 + 12 per parameter):

    stage     sharded                 params   grads    optimizer (fp32 master, m, v)
    0 (DDP)   nothing                 2Ψ       2Ψ       12Ψ
    1         optimizer state         2Ψ       2Ψ       12Ψ/N
    2         + gradients             2Ψ       2Ψ/N     12Ψ/N
    3         + parameters            2Ψ/N     2Ψ/N     12Ψ/N

The data structure under all three: the parameters are grouped into buckets (at stage 3 one
bucket per *unit*, e.g. one transformer block), each bucket laid out flat and padded to a
multiple of N (`dtl.flat.FlatBuffer`); rank r owns slice r of every bucket: the optimizer state
for it, the averaged gradient of it and, at stage 3, the only copy of its parameters.

One optimizer step, per bucket of P (padded) elements; the collective and its shapes:

    stage 1  backward accumulates full grads (P,) locally, exactly as DDP's would;
             step(): reduce_scatter (P,) -> (P/N,) my averaged slice; AdamW on my slice only;
             all_gather (P/N,) -> (P,) so every rank has all the new parameters again
    stage 2  as stage 1, but a bucket is reduce-scattered *during* backward, the moment all its
             grads are in (hooks, as in day 17), and its full (P,) grad buffer is then freed
    stage 3  parameters live only as (P/N,) slices; a unit is all-gathered (P/N,) -> (P,) just
             before its forward and freed after it; gathered again before its backward; its
             grads reduce-scattered and its full parameters freed as soon as its backward is
             done; the next unit's all-gather is launched early (prefetch)

Communication per step (ring cost per rank, in units of the gradient bytes): stages 1 and 2 move
(N-1)/N x Ψ in the reduce-scatter and (N-1)/N x Ψ in the all-gather = 2Ψ(N-1)/N, the same as
DDP's all-reduce (which *is* a reduce-scatter then an all-gather). Stage 3 gathers twice: 3Ψ(N-1)/N.

    model = apply_zero(gpt, grid, stage=2, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr))
    loss_fn(model(x), y).backward()    # stage 2/3: reduce-scatters happen in here
    model.step()                       # AdamW on this rank's slice; stage 1/2: all-gather params
    model.zero_grad()

Names in the comments point at DeepSpeed (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py)
and FSDP2 (torch/distributed/fsdp/_fully_shard/), which do the same with more machinery.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from day17_ddp.ddp_manual import assign_buckets
from day18_zero.bucket import Bucket
from dtl import compat
from dtl import profile as dtl_profile
from dtl.exercise_seam import exercise
from dtl.flat import FlatBuffer
from dtl.grid import ParallelGrid
from dtl.state import StateBytes, nbytes, optimizer_state_bytes

STAGES = (1, 2, 3)
MiB = 1024 * 1024


class ZeroError(ValueError):
    """Bad ZeRO configuration; a one-line message, raised before any collective."""


def check_zero_args(stage, bucket_cap_mb: float = 25.0) -> None:
    if stage not in STAGES:
        raise ZeroError(f"unknown ZeRO stage {stage!r}; the hand-written stages are 1, 2, 3")
    if isinstance(bucket_cap_mb, bool) or not bucket_cap_mb > 0:
        raise ZeroError(f"bucket_cap_mb must be a number of MiB > 0, got {bucket_cap_mb!r}")


class ZeroModel(nn.Module):
    """`module` trained with ZeRO stage 1, 2 or 3 over `group`; used like DDP plus a step().

    Expects a plain module whose parameters are all trained (every one gets a gradient or is
    reported at the end of backward). At stage 3, `units` (default: the children of
    `module.blocks` if it has one) are the modules gathered one at a time; everything else
    (embeddings, final norm, head, and any parameter shared between units) is the root unit,
    gathered for the whole forward and the whole backward.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        group=None,
        bucket_cap_mb: float = 25.0,
        units: list[nn.Module] | None = None,
        prefetch: bool = True,
        max_in_flight: int = 2,
        offload_optimizer: bool = False,
    ):
        check_zero_args(stage, bucket_cap_mb)
        super().__init__()
        self.module, self.stage, self.group, self.prefetch = module, stage, group, prefetch
        # stages 2-3: reduce-scatters allowed in flight during backward; launching one more first
        # finishes the oldest and frees its (P,) gradient buffer (DeepSpeed double-buffers too)
        self.max_in_flight = max_in_flight
        self._in_flight: deque[Bucket] = deque()
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.require_backward_grad_sync = True  # what no_sync() flips
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._broadcast_from_first_rank()  # all ranks start from the same parameters, as in DDP
        if stage == 3:
            self.units = units if units is not None else default_units(module)
            root_group, groups = _unit_param_groups(self.units, named)
        else:
            self.units, root_group = [], []
            groups = _size_buckets(named, int(bucket_cap_mb * MiB))
        make = lambda g, label: Bucket(  # noqa: E731
            [p for _, p in g], [n for n, _ in g], stage, self.rank, self.world, group,
            offload_optimizer, label,
        )  # fmt: skip
        # stage 3's always-gathered unit; the labels name the buckets in profiler ranges
        self.root = make(root_group, "root") if root_group else None
        kind = "unit" if stage == 3 else "bucket"
        self.unit_buckets = [make(g, f"{kind} {i}") for i, g in enumerate(groups)]
        self.buckets = ([self.root] if self.root else []) + self.unit_buckets
        self.locate = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for p in (p for b in self.buckets for p in b.params):
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.optimizer = make_optimizer([b.master for b in self.buckets])
        self._queued = False
        self._synced_backward = True
        if stage == 3:
            self._install_unit_hooks()
        self.live = LiveMemory(self)

    @torch.no_grad()
    def _broadcast_from_first_rank(self) -> None:
        src = dist.get_global_rank(self.group or dist.group.WORLD, 0)
        with dtl_profile.range(dtl_profile.comm_name("broadcast", "parameters")):
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t, src=src, group=self.group)

    # --- forward --------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self.stage < 3:
            return self.module(*args, **kwargs)
        if self.root is not None:
            self.root.wait_gather()  # the root unit (embeddings, head) stays gathered in forward
            self.live.update()
        out = self.module(*args, **kwargs)
        if self.root is not None:
            self.root.free_full_params()
            self._on_backward_of(out, self.root)
        self._recording = False  # the first forward is over: the units' order is known
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, until the block exits.

        Stage 1 always does this (its reduce-scatter is in step()). Stages 2 and 3 then keep
        full (P,) gradient buffers between micro-steps, like FSDP's no_sync: fewer collectives
        for more memory. Without no_sync they reduce-scatter every micro-step into the kept
        (P/N,) slice, like DeepSpeed's gradient accumulation.
        """
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # --- stage 3: gather before a unit runs, free after, prefetch the next ---------------------

    def _install_unit_hooks(self) -> None:
        self.forward_order: list[Bucket] = []  # recorded in the first forward (DeepSpeed's trace)
        self._recording = True
        for unit, bucket in zip(self.units, self.unit_buckets, strict=True):
            unit.register_forward_pre_hook(self._make_pre_forward(bucket))
            unit.register_forward_hook(self._make_post_forward(bucket))

    def _neighbour(self, bucket: Bucket, step: int) -> Bucket | None:
        order = self.forward_order
        if self._recording or bucket not in order:
            return None
        i = order.index(bucket) + step
        return order[i] if 0 <= i < len(order) else None

    # Bucket.wait_gather() makes a unit whole (the all-gather launched unless a prefetch did,
    # waited on); launch_gather() only starts it; free_full_params() gives the memory back.
    # self._neighbour(bucket, +1 / -1): the unit after / before it in forward, or None.

    @exercise("day18.zero3_gather")
    def _make_pre_forward(self, bucket: Bucket):
        def pre_forward(module, args):
            if self._recording and torch.is_grad_enabled():
                self.forward_order.append(bucket)
            # this unit whole now; with self.prefetch, the next unit's all-gather started too
            # exercise day18.zero3_gather: begin
            bucket.wait_gather()
            nxt = self._neighbour(bucket, +1) if self.prefetch else None
            if nxt is not None:
                nxt.launch_gather()  # its all-gather runs while this unit computes
            # exercise day18.zero3_gather: end
            self.live.update()

        return pre_forward

    @exercise("day18.zero3_gather")
    def _make_post_forward(self, bucket: Bucket):
        def post_forward(module, args, output):
            # the unit has run: its full parameters go, and come back for its backward
            # exercise day18.zero3_gather: begin
            bucket.free_full_params()
            self._on_backward_of(output, bucket)
            # exercise day18.zero3_gather: end
            return output

        return post_forward

    @exercise("day18.zero3_gather")
    def _on_backward_of(self, output, bucket: Bucket) -> None:
        """Gather `bucket` again when the gradient of `output` arrives, i.e. just before the
        unit's own backward runs (FSDP1's pre-backward hook on the unit's outputs)."""
        if not torch.is_grad_enabled():
            return
        done = []

        def pre_backward(grad):
            if not done:  # one output's hook is enough
                done.append(True)
                self._queue_finalize()
                # whole again; with self.prefetch, also start gathering the one backward runs next
                # exercise day18.zero3_gather: begin
                bucket.wait_gather()
                prev = self._neighbour(bucket, -1) if self.prefetch else None
                if prev is not None:
                    prev.launch_gather()
                # exercise day18.zero3_gather: end
                self.live.update()
            return grad

        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(pre_backward)

    # --- backward: gradients into buckets, buckets reduce-scattered ------------------------------

    def _queue_finalize(self) -> None:
        if not self._queued:  # once per backward, from inside it
            self._queued = True
            self._synced_backward = self.require_backward_grad_sync
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    @exercise("day18.zero2_reduce_scatter")
    def _grad_ready(self, p: torch.Tensor) -> None:
        # runs right after AccumulateGrad wrote p.grad (the hook DDP puts on it)
        self._queue_finalize()
        bucket, i = self.locate[id(p)]
        bucket.add_grad(i, p.grad)
        p.grad = None  # the bucket holds it now; the model keeps no gradient of its own
        self.live.update_grads()
        if not bucket.complete:
            return
        # all its gradients are in. Stages 2 and 3 (outside no_sync: self._synced_backward)
        # launch its reduce-scatter now, queue it in self._in_flight, and leave at most
        # self.max_in_flight in flight (self._retire). Stage 1 waits for step().
        # exercise day18.zero2_reduce_scatter: begin
        if self.stage >= 2 and self._synced_backward:
            bucket.launch_reduce_scatter()  # overlaps with the rest of backward
            self._in_flight.append(bucket)
            self._retire(keep=self.max_in_flight)
        # exercise day18.zero2_reduce_scatter: end
        if self.stage == 3:
            bucket.free_full_params()  # its backward is done: give the full params back
            self.live.update()

    def _retire(self, keep: int) -> None:
        """Finish the oldest reduce-scatters (wait, average, keep my slice, free the (P,)
        buffer) until at most `keep` are in flight; also any that have already completed."""
        while self._in_flight and (
            len(self._in_flight) > keep or self._in_flight[0].reduce_work.is_completed()
        ):
            self._in_flight.popleft().finish_reduce_scatter()

    def _finalize(self) -> None:
        """After the last gradient of this backward (DDP's finalize_backward)."""
        self._queued = False
        for bucket in self.buckets:
            if not bucket.complete:
                missing = [n for i, n in enumerate(bucket.names) if i not in bucket.arrived]
                raise RuntimeError(
                    f"ZeRO: parameters got no gradient in this backward ({missing[:3]} ...); "
                    "every trained parameter must be used in the loss"
                )
            bucket.arrived.clear()
            if self.stage == 3 and bucket.gathered:
                bucket.free_full_params()
        self._retire(keep=0)  # the step needs every averaged slice

    # --- the optimizer step on this rank's slices ----------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        if self.stage == 1:  # ZeRO-1: the gradients were kept full through backward; now share
            for b in self.buckets:
                b.launch_reduce_scatter()
            for b in self.buckets:
                b.finish_reduce_scatter()
        for b in self.buckets:
            # (P/N,) my averaged gradient slice -> the master's device and dtype (offloaded:
            # device -> CPU, the PCIe copy ZeRO-Offload pays every step)
            b.master.grad = b.grad_shard.to(b.master.device, b.master.dtype)
        self.optimizer.step()  # touches only (P/N,) slices: 1/N of the optimizer's work and state
        for b in self.buckets:
            if b.master_is_copy:
                b.param_shard.copy_(b.master)  # fp32 master -> the slice (CPU -> device)
            if self.stage < 3:
                # (P/N,) my new slice -> (P,) every rank's, into the model's parameters in place
                with dtl_profile.range(dtl_profile.comm_name("all_gather", b.label)):
                    b.gather_work = compat.all_gather_single(
                        b.full.data, b.param_shard, group=self.group, async_op=True
                    )
        with dtl_profile.range(dtl_profile.comm_name("all_gather", wait=True)):
            for b in self.buckets:
                if b.gather_work is not None:
                    b.gather_work.wait()
                    b.gather_work = None

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()

    # --- reading the state -----------------------------------------------------------------------

    def state_bytes(self) -> StateBytes:
        """Bytes this rank holds for parameters, gradients and optimizer state, counted from the
        live tensors at the moment of the call (stage 3's gathered units are in `live`)."""
        params = sum(
            nbytes(b.full.data) if self.stage < 3 else nbytes(b.param_shard) for b in self.buckets
        )
        # stage 1: the full buffers (my slice is a view in them); stages 2/3: my slices, plus
        # any full buffer alive now (inside a no_sync accumulation)
        grads = sum(nbytes(b.full_grads.data) for b in self.buckets if b.full_grads is not None)
        if self.stage >= 2:
            grads += sum(nbytes(b.grad_shard) for b in self.buckets)
        masters = sum(nbytes(b.master) for b in self.buckets if b.master_is_copy)
        # m and v; AdamW's step counters (one 0-dim tensor per slice, 4 B) are no per-parameter
        # state, and leaving them out makes the count equal the formula to the byte
        state = optimizer_state_bytes(self.optimizer, counters=False)
        return StateBytes(params=params, grads=grads, optim=masters + state)

    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> full parameter (a copy), gathered from the slices: collective, every rank."""
        out = {}
        for b in self.buckets:
            buf = b.full
            if self.stage == 3:  # a fresh buffer: the unit's own may be freed
                buf = FlatBuffer(
                    b.full.shapes, dtype=b.dtype, device=b.full.data.device, pad_to=self.world
                )
                compat.all_gather_single(buf.data, b.param_shard, group=self.group)
            out.update({n: v.clone() for n, v in zip(b.names, buf.views)})
        return out


class LiveMemory:
    """High-water marks of what exists only for a while, read from the live buffers:
    stage 3's full parameters (all units; and how many non-root units at once), after every
    gather and free; the full (P,) gradient buffers, after every gradient hook."""

    def __init__(self, zero: ZeroModel):
        self.zero = zero
        self.peak_bytes = 0
        self.peak_units = 0  # non-root units whose full parameters were alive together
        self.peak_grad_bytes = 0

    def update_grads(self) -> None:
        alive = sum(
            nbytes(b.full_grads.data) for b in self.zero.buckets if b.full_grads is not None
        )
        self.peak_grad_bytes = max(self.peak_grad_bytes, alive)

    def update(self) -> None:
        if self.zero.stage < 3:
            return
        units = [b.full_bytes_alive() for b in self.zero.unit_buckets]
        root = self.zero.root.full_bytes_alive() if self.zero.root else 0
        self.peak_bytes = max(self.peak_bytes, root + sum(units))
        self.peak_units = max(self.peak_units, sum(a > 0 for a in units))

    def limit_bytes(self, units: int = 2) -> int:
        """The stated limit: the root unit plus the `units` largest other units."""
        full = lambda b: b.padded_numel * b.full.data.element_size()  # noqa: E731
        sizes = sorted((full(b) for b in self.zero.unit_buckets), reverse=True)
        return (full(self.zero.root) if self.zero.root else 0) + sum(sizes[:units])


# --- how the parameters are grouped ------------------------------------------------------------


def _size_buckets(named, cap_bytes: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Stages 1 and 2: buckets of about `cap_bytes`, in reverse registration order (the order
    backward produces gradients in, roughly: output layer first), as DDP and DeepSpeed do."""
    nbytes = [p.numel() * p.element_size() for _, p in named]
    order = list(reversed(range(len(named))))
    return [[named[i] for i in idx] for idx in assign_buckets(nbytes, order, cap_bytes, cap_bytes)]


def default_units(module: nn.Module) -> list[nn.Module]:
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    return []  # one unit: the whole module is the root


def _unit_param_groups(units, named):
    """Stage 3: (root params, [unit 0's params, unit 1's, ...]); a parameter that appears in more
    than one unit, or in none, belongs to the root (it is gathered whenever the model runs)."""
    owners: dict[int, set[int]] = {}
    for u, unit in enumerate(units):
        for p in unit.parameters():
            owners.setdefault(id(p), set()).add(u)
    groups: list[list] = [[] for _ in range(len(units) + 1)]
    for name, p in named:
        owner = owners.get(id(p), set())
        groups[1 + next(iter(owner)) if len(owner) == 1 else 0].append((name, p))
    empty = [u for u, g in enumerate(groups[1:]) if not g]
    if empty:
        raise ZeroError(f"ZeRO-3 units {empty} hold no trainable parameters of their own")
    return groups[0], groups[1:]


def apply_zero(
    model: nn.Module,
    grid: ParallelGrid,
    stage: int,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    **kwargs,
) -> ZeroModel:
    """Shard `model`'s training state over the grid's data-parallel ranks (dp x cp, as
    Megatron's distributed optimizer does). Expects an unwrapped module whose parameters may
    already be TP shards or one pipeline stage's; returns the ZeroModel that owns the
    optimizer. Keyword arguments go to ZeroModel (bucket_cap_mb, units, prefetch)."""
    check_zero_args(stage, kwargs.get("bucket_cap_mb", 25.0))
    return ZeroModel(model, stage, make_optimizer, group=grid.group("dp", "cp"), **kwargs)
