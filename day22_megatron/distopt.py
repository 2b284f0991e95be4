"""Day 22: ZeRO-1 under the stack, the way Megatron's distributed optimizer does it.

Without it, every DP rank of day 22's stack keeps Adam's m and v for all of its shard's
parameters, the same numbers on each of them. With it, each DP rank keeps 1/d of them, d the
ranks a parameter's gradient is averaged over (dp x cp: its reduction record's `average` axes):

    per rank, fp32      parameters   gradients   Adam m, v
    replicated          4 P          4 P         8 P
    distributed         4 P'         4 P'        8 P' / d   P' = P + the flats' padding to d

(Megatron quotes 6 + 12/d bytes per parameter in bf16: 2 for the bf16 weight, 4 for its fp32
gradient, 12/d for the fp32 master, m and v. Here the weights train in fp32, so they are the
master: 4 + 4 + 8/d.)

The parameters are grouped by the axes their gradients average over and by their weight decay
(every group is one AdamW parameter group), each group laid out flat and padded to a multiple of
its d: the parameters become views of that buffer, so rank r's slice of it is r's piece of the
weights, updated in place; their gradients are views of a second buffer of the same layout
(Megatron's grad buffer), which backward accumulates into and which stays between steps (ZeRO-2
would free all but my slice). One optimizer step, per group of P (padded) elements:

    backward          full gradients (P,) accumulate into the grad buffer, as without ZeRO-1
    reduce_scatter    (P,) -> (P/d,): the sum of my slice over the group, / d, written into my
                      slice of the grad buffer (the rest of it is stale from here on)
    global norm       my slice's squares, where this rank counts them (below), all-reduced
    AdamW             on my (P/d,) slice only: m and v are (P/d,)
    all_gather        (P/d,) -> (P,): every rank has the new weights again

Bytes: a reduce-scatter and an all-gather of P move (d-1)/d P each, the all-reduce's 2(d-1)/d P:
ZeRO-1 costs the dp axis what plain averaging costs (day 18's table). Which elements enter the
norm: along the averaged axes each rank now holds its own slice (all count); along a `replica`
axis (tp for a LayerNorm) the copies are the same numbers (coordinate 0 counts); a `copy_of`
(a tied lm_head) never counts; the squares are all-reduced over the whole grid.

    opt = DistributedOptimizer(stack.named, stack.reduction, stack.grid, optim)
    opt.reduce_scatter_gradients(); norm = opt.clip(max_norm); opt.step(); opt.zero_grad()

Megatron-core: megatron/core/optimizer/distrib_optimizer.py (its buffers by dtype and expert
group, `_build_model_gbuf_range`), megatron/core/distributed/param_and_grad_buffer.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtl import compat
from dtl import profile as dtl_profile
from dtl.dist import norm_of_pieces
from dtl.flat import FlatBuffer
from dtl.grid import ParallelGrid
from dtl.optim import OptimConfig, clip_coefficient
from dtl.reduction import Reduction, ReductionTable
from dtl.state import StateBytes, nbytes, optimizer_state_bytes


@dataclass
class ShardGroup:
    """Parameters averaged over the same axes with the same weight decay, flat, and my slice."""

    axes: tuple[str, ...]  # the axes the gradients are averaged over: the shard group
    group: dist.ProcessGroup | None  # None: nobody to share with (d = 1)
    size: int  # d
    divisor: int  # what the summed slice is divided by: the ranks whose tokens reached it
    params: list[torch.nn.Parameter]
    flat: FlatBuffer  # the parameters' storage: each parameter is a view of it
    grads: torch.Tensor  # (P,) the gradients' storage: each parameter's .grad is a view of it
    shard: torch.Tensor  # (P/d,) my slice of the weights: a view of flat, updated in place
    counted: torch.Tensor  # (P/d,) float64: 1 where my slice's element enters the norm


def counts_in_norm(record: Reduction, grid: ParallelGrid) -> bool:
    """Whether this rank's slice of a parameter enters the global norm once its gradient is
    reduce-scattered: not a copy, and coordinate 0 along every axis where the ranks hold the same
    numbers (a `replica` axis, or one the record does not name). Along its averaged axes (now
    sliced), its shard, stage and routed axes each rank holds numbers of its own."""
    own = record.average + record.shard + record.stage + record.routed
    same = [a for a in grid.axes if a not in own]
    return record.copy_of is None and all(grid.coords[a] == 0 for a in same)


class DistributedOptimizer:
    """ZeRO-1 over each parameter's averaged axes: AdamW on this rank's slice of every group.
    `param_groups` is the inner AdamW's (dtl.optim.set_lr sets the step's rate on it)."""

    def __init__(
        self,
        named: Mapping[str, torch.Tensor],
        table: ReductionTable,
        grid: ParallelGrid,
        optim: OptimConfig,
    ):
        self.grid = grid
        parts = list(_by_axes_and_decay(named, table, optim))
        self.groups = [self._group(axes, params, table, named) for axes, params, _ in parts]
        self.inner = torch.optim.AdamW(
            [
                {"params": [g.shard], "weight_decay": decay}
                for g, (_, _, decay) in zip(self.groups, parts)
            ],
            lr=optim.lr,
            eps=optim.eps,
            betas=optim.betas,
        )
        self.param_groups = self.inner.param_groups

    def _group(
        self,
        axes: tuple[str, ...],
        params: list,
        table: ReductionTable,
        named: Mapping[str, torch.Tensor],
    ) -> ShardGroup:
        size = self.grid.group_size(*axes) if axes else 1
        group = self.grid.group(*axes) if size > 1 else None
        rank = dist.get_rank(group) if group is not None else 0
        divisor = self.grid.group_size(*table.divisor_axes(axes)) if axes else 1
        flat = FlatBuffer.of([p.detach() for p in params], pad_to=size)
        grads = torch.zeros_like(flat.data)  # only the .grad views below refer to it
        for p, view, offset, numel in zip(params, flat.views, flat.offsets, flat.numels):
            p.data = view  # the parameter lives in the buffer from now on
            p.grad = grads[offset : offset + numel].view(view.shape)  # backward adds in place
        name_of: dict[int, str] = {}  # a tied weight under its first name (wte, not the copy)
        for n, p in named.items():
            name_of.setdefault(id(p), n)
        mask = torch.zeros(flat.data.numel(), dtype=torch.float64, device=flat.data.device)
        for p, offset, numel in zip(params, flat.offsets, flat.numels):
            mask[offset : offset + numel] = float(counts_in_norm(table[name_of[id(p)]], self.grid))
        n = flat.data.numel() // size
        mine = slice(rank * n, (rank + 1) * n)
        shard = flat.data[mine]
        shard.grad = grads[mine]  # my averaged slice lands here: what AdamW reads
        return ShardGroup(axes, group, size, divisor, params, flat, grads, shard, mask[mine])

    def reduce_scatter_gradients(self) -> int:
        """Each group's gradient buffer (P,) -> my averaged slice (P/d,), in my slice of the
        buffer (the shard's .grad). Returns the bytes of the buffers reduce-scattered."""
        sent = 0
        for g in self.groups:
            _into_buffer(g)
            if g.group is not None:
                summed = torch.empty_like(g.shard)  # (P/d,)
                with dtl_profile.range(dtl_profile.comm_name("reduce_scatter", "dp grads")):
                    compat.reduce_scatter_single(summed, g.grads, group=g.group)  # (P,) -> (P/d,)
                g.shard.grad.copy_(summed)
                sent += g.grads.numel() * g.grads.element_size()
            g.shard.grad.div_(g.divisor)  # the average over the ranks that saw other tokens
        return sent

    def global_norm(self) -> float:
        """The dense model's gradient norm from the slices: each rank's counted elements, their
        squares summed over the whole grid (float64)."""
        return norm_of_pieces(g.shard.grad.double() * g.counted for g in self.groups)

    @torch.no_grad()
    def clip(self, max_norm: float | None) -> float:
        """clip_grad_norm_'s rule on the slices; returns the norm before clipping."""
        norm = self.global_norm()
        coef = clip_coefficient(norm, max_norm)
        if coef < 1.0:
            for g in self.groups:
                g.shard.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self) -> int:
        """AdamW on my slices, then every group's slices all-gathered into its buffer (the
        parameters' storage). Returns the bytes of the buffers gathered."""
        self.inner.step()
        got = 0
        for g in self.groups:
            if g.group is None:
                continue
            out = torch.empty_like(g.flat.data)  # (P,)
            with dtl_profile.range(dtl_profile.comm_name("all_gather", "dp params")):
                compat.all_gather_single(out, g.shard.clone(), group=g.group)  # (P/d,) -> (P,)
            g.flat.data.copy_(out)
            got += out.numel() * out.element_size()
        return got

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers; they stay, and the .grad views with them (Megatron's buffer
        persists between steps): `set_to_none` is taken and has nothing to free."""
        for g in self.groups:
            g.grads.zero_()

    def state_bytes(self) -> StateBytes:
        """What this rank holds, counted from the buffers (their padding included) and AdamW's
        moments (not its step counters, as the formula)."""
        return StateBytes(
            params=sum(nbytes(g.flat.data) for g in self.groups),
            grads=sum(nbytes(g.grads) for g in self.groups),
            optim=optimizer_state_bytes(self.inner, counters=False),
        )

    @property
    def padding(self) -> int:
        """Elements of padding over all groups (each flat to a multiple of its d)."""
        return sum(g.flat.padding for g in self.groups)


def padding_of(optimizer: object) -> int:
    """The elements ZeRO-1's flat buffers add to reach multiples of d (0 for any other
    optimizer): the formulas' `padding`."""
    return optimizer.padding if isinstance(optimizer, DistributedOptimizer) else 0


def _into_buffer(g: ShardGroup) -> None:
    """Every parameter's gradient in its view of the buffer: backward adds into the view in
    place; where autograd replaced it with a tensor of its own (or it was set to None), the
    numbers are copied back and the view restored."""
    for p, offset, numel in zip(g.params, g.flat.offsets, g.flat.numels):
        view = g.grads[offset : offset + numel].view(p.shape)
        if p.grad is None or p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad if p.grad is not None else torch.zeros_like(view))
            p.grad = view


def _by_axes_and_decay(
    named: Mapping[str, torch.Tensor], table: ReductionTable, optim: OptimConfig
) -> Iterator[tuple[tuple[str, ...], list, float]]:
    """(averaged axes, parameters, weight decay) per group: the table's groups (each parameter
    once), each split as the optimizer config splits parameters into decay groups."""
    for axes, params in table.average_groups(named).items():
        split = optim.groups(params)  # decay on matrices only: two dicts; else the parameters
        if not all(isinstance(group, dict) for group in split):
            yield axes, params, optim.weight_decay
            continue
        for group in split:
            if group["params"]:
                yield axes, group["params"], group["weight_decay"]
