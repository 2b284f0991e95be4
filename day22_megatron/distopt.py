"""Day 22: ZeRO-1 under the stack, the way Megatron's distributed optimizer does it.

Without it, every DP rank of day 22's stack keeps Adam's m and v for all of its shard's
parameters, the same numbers on each of them. With it, each DP rank keeps 1/d of them, d the
ranks a parameter's gradient is averaged over (dp x cp: its reduction record's `average` axes):

    per rank, fp32      parameters   gradients   Adam m, v
    replicated          4 P          4 P         8 P
    distributed         4 P          4 P         8 P / d  (+ padding: flats to multiples of d)

(Megatron quotes 6 + 12/d bytes per parameter in bf16: 2 for the bf16 weight, 4 for its fp32
gradient, 12/d for the fp32 master, m and v. Here the weights train in fp32, so they are the
master: 4 + 4 + 8/d.)

The parameters are grouped by the axes their gradients average over and by their weight decay
(every group is one AdamW parameter group), each group laid out flat and padded to a multiple of
its d: the parameters become views of that buffer, so rank r's slice of it is r's piece of the
weights, updated in place. One optimizer step, per group of P (padded) elements:

    backward          full gradients (P,) accumulate on every rank, as without ZeRO-1 (they
                      stay until zero_grad, as Megatron's grad buffer; ZeRO-2 frees them)
    reduce_scatter    (P,) -> (P/d,): the sum of my slice over the group, / d
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
from dtl.flat import FlatBuffer
from dtl.grid import ParallelGrid
from dtl.optim import OptimConfig
from dtl.reduction import Reduction, ReductionTable


@dataclass
class ShardGroup:
    """Parameters averaged over the same axes with the same weight decay, flat, and my slice."""

    axes: tuple[str, ...]  # the axes the gradients are averaged over: the shard group
    group: dist.ProcessGroup | None  # None: nobody to share with (d = 1)
    size: int  # d
    rank: int  # my index in the group: which slice is mine
    params: list[torch.nn.Parameter]
    flat: FlatBuffer  # the parameters' storage: each parameter is a view of it
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
        self.state = self.inner.state

    def _group(self, axes, params, table, named) -> ShardGroup:
        size = self.grid.group_size(*axes) if axes else 1
        group = self.grid.group(*axes) if size > 1 else None
        rank = dist.get_rank(group) if group is not None else 0
        flat = FlatBuffer.of([p.detach() for p in params], pad_to=size)
        for p, view in zip(params, flat.views):
            p.data = view  # the parameter lives in the buffer from now on
        name_of: dict[int, str] = {}  # a tied weight under its first name (wte, not the copy)
        for n, p in named.items():
            name_of.setdefault(id(p), n)
        mask = torch.zeros(flat.data.numel(), dtype=torch.float64, device=flat.data.device)
        for p, offset, numel in zip(params, flat.offsets, flat.numels):
            mask[offset : offset + numel] = float(counts_in_norm(table[name_of[id(p)]], self.grid))
        n = flat.data.numel() // size
        mine = slice(rank * n, (rank + 1) * n)
        return ShardGroup(axes, group, size, rank, params, flat, flat.data[mine], mask[mine])

    def reduce_scatter_gradients(self) -> int:
        """Each group's full gradients (P,) -> my averaged slice (P/d,), set as the slice's
        gradient. Returns the bytes of the buffers reduce-scattered."""
        sent = 0
        for g in self.groups:
            full = FlatBuffer.of([_grad(p) for p in g.params], pad_to=g.size).data  # (P,)
            mine = torch.empty_like(g.shard)  # (P/d,)
            if g.group is not None:
                with dtl_profile.range(dtl_profile.comm_name("reduce_scatter", "dp grads")):
                    compat.reduce_scatter_single(mine, full, group=g.group)  # (P,) -> (P/d,) sum
                sent += full.numel() * full.element_size()
            else:
                mine.copy_(full)
            g.shard.grad = mine / g.size  # the average over the d ranks that saw other tokens
        return sent

    def global_norm(self) -> float:
        """The dense model's gradient norm from the slices: each rank's counted squares, summed
        over the whole grid (float64)."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.groups[0].shard.device)
        for g in self.groups:
            sq += (g.shard.grad.double().pow(2) * g.counted).sum()
        dist.all_reduce(sq)
        return sq.sqrt().item()

    @torch.no_grad()
    def clip(self, max_norm: float | None) -> float:
        """clip_grad_norm_'s rule on the slices; returns the norm before clipping."""
        norm = self.global_norm()
        coef = (max_norm / (norm + 1e-6)) if max_norm else 1.0
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
        for g in self.groups:
            g.shard.grad = None
            for p in g.params:
                p.grad = None

    @property
    def padding(self) -> int:
        """Elements of padding over all groups (each flat to a multiple of its d)."""
        return sum(g.flat.padding for g in self.groups)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


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
