"""Expert parallelism by hand: each of ep ranks holds E/ep experts of every MoE layer, and the
tokens travel to them and back by all-to-all (GShard, Lepikhin et al. 2020; megatron-core's
MoEAlltoAllTokenDispatcher).

    apply_ep(gpt, grid.ep_group)   # before training: keep my experts, swap the dispatcher

Rank r of the ep group owns experts r*E/ep .. (r+1)*E/ep - 1, so "sorted by expert" is also
"sorted by destination rank". Per layer, forward (N tokens here, k slots each, C wide):

    rows     (N*k, C)   my (token, slot) rows in expert order (dtl.moe.sort_by_expert)
    1. counts all-to-all: (E,) my rows per expert -> (ep, E/ep) the rows each rank sends to
       each of my experts. Its numbers become split sizes: a host sync, every layer.
    2. rows all-to-all (uneven): (N*k, C) -> (R, C), R = the rows all ranks send me,
       rank-major: rank 0's rows for my experts, then rank 1's ...
    3. regroup rank-major -> expert-major (a stable sort by local expert): each of my experts
       gets one contiguous slice, ranks in order within it, and runs on it
    4. the inverse regroup, then the reverse all-to-all (splits swapped): (R, C) -> (N*k, C)
    5. back to (token, slot) order and the weighted sum over the k slots (dtl.moe.combine)
Backward runs the same two all-to-alls in reverse order, each with its splits swapped
(`_AllToAll.backward`): 4 all-to-alls of rows per layer per step.

Where the gradients go. A dense parameter (attention, router) is replicated on every rank of
the ep group, which saw other tokens: averaged over it, as over dp. An expert is on one rank of
the ep group, and its gradient there is already the sum over every ep rank's tokens (they came
to it); over the ranks that hold copies of it (dp, the expert-data-parallel group) it is summed,
and the whole is divided by the number of data ranks, dp x ep: the same 1/DP loss normalisation
as the dense parameters. dtl.reduction says so with the `routed` role.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

from dtl.exercise_seam import exercise
from dtl.grid import ParallelGrid
from dtl.moe import MoE, Routing, combine, moe_layers, run_experts, sort_by_expert
from dtl.reduction import EXPERT

[EP_AXIS] = EXPERT  # the grid's axis of expert parallelism
# megatron-core's order tp-cp-ep-dp-pp, outermost first: an ep group is the data ranks next to
# each other inside one dp coordinate (the experts' copies lie along dp)
EP_AXES = ("pp", "dp", "ep", "cp", "tp")
# the groups the stack's reductions ask for besides the grid's default ones: dense gradients
# averaged over dp x ep x cp, the norm's squares summed over ep (other experts), tp and pp
EP_COMBOS = (("dp", "ep", "cp"), ("ep", "tp", "pp"), ("pp", "ep"))


def check_ep(n_expert: int, ep: int) -> None:
    """One line before any process group: the experts must split evenly over the ep ranks."""
    if n_expert % ep:
        raise ValueError(f"{n_expert} experts do not split over ep {ep} ranks; use a divisor")


def local_experts(n_expert: int, ep: int, ep_rank: int) -> range:
    """The experts rank `ep_rank` of an ep group holds: a contiguous block of E/ep."""
    per_rank = n_expert // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks `send` names and back: all_to_all_single with uneven splits. The
    backward is the same call with the splits swapped (what came from rank j goes back to it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (send, recv), group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        send, recv = ctx.splits
        return _all_to_all(grad, recv, send, ctx.group), None, None, None


def _all_to_all(
    x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))  # (rows from every rank, C)
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all_rows(
    x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """(sum(send), C) -> (sum(recv), C): send[j] rows to rank j, recv[j] rows from it."""
    return cast(torch.Tensor, _AllToAll.apply(x, send, recv, group))


@dataclass
class Traffic:
    """What one layer's dispatcher moved since the last reset: rows sent and received (each row
    C numbers) and forward calls; the formula of the rows' bytes reads it."""

    rows_sent: int = 0
    rows_received: int = 0
    calls: int = 0

    def add(self, sent: int, received: int) -> None:
        self.rows_sent, self.rows_received = self.rows_sent + sent, self.rows_received + received
        self.calls += 1


def take_traffic(modules: Iterable[nn.Module]) -> Traffic:
    """The rows every all-to-all MoE layer of `modules` moved since the last call, summed; the
    counters start again from zero."""
    total = Traffic()
    for layer in (m for module in modules for m in moe_layers(module)):
        if isinstance(layer.dispatcher, AllToAllDispatcher):
            t = layer.dispatcher.traffic
            total.rows_sent += t.rows_sent
            total.rows_received += t.rows_received
            total.calls += t.calls
            layer.dispatcher.traffic = Traffic()
    return total


def data_rank(grid: ParallelGrid) -> tuple[int, int]:
    """(this rank's index among the ranks that see other rows, how many there are): dp x ep,
    ep inner, as the grid lays them out."""
    ep, ep_rank = grid.sizes.get(EP_AXIS, 1), grid.coords.get(EP_AXIS, 0)
    return grid.dp_rank * ep + ep_rank, grid.dp_size * ep


class AllToAllDispatcher:
    """Steps 1-5 of the module docstring: this rank's experts, the others' by all-to-all."""

    def __init__(self, group: dist.ProcessGroup, n_expert: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.experts = local_experts(n_expert, self.ep, dist.get_rank(group))
        self.traffic = Traffic()

    def __deepcopy__(self, memo: dict) -> AllToAllDispatcher:
        return self  # a process group is not copied: a pipeline stage's copy shares it

    def __call__(
        self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleDict, n_expert: int
    ) -> torch.Tensor:
        order, counts = sort_by_expert(routing, n_expert)
        rows = tokens[order // routing.top_k]  # (N*k, C), expert-major = destination-major
        returned, received = self.exchange(rows, counts, experts)  # steps 1-4
        self.traffic.add(rows.size(0), int(received.sum()))
        # 5. expert order -> (token, slot) order, weighted sum over the k slots
        return combine(returned[torch.argsort(order)], routing)

    @exercise("day22.ep_dispatch")
    def exchange(
        self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-4: `rows` (N*k, C), this rank's rows sorted by expert, `counts` (E,) how
        many go to each expert -> (the rows' expert outputs, in the same order, (N*k, C); the
        (ep, E/ep) matrix of rows each rank sent to each of this rank's experts). This rank's
        experts are `self.experts` (a range), found in `experts` by str(index); the group is
        `self.group` of `self.ep` ranks. all_to_all_rows moves rows with autograd;
        dist.all_to_all_single moves the counts; run_experts runs experts on slices."""
        per_rank = len(self.experts)
        # exercise day22.ep_dispatch: begin
        # 1. (E,) counts -> (ep * E/ep,): what each rank sends to each of my experts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ep, per_rank)  # [source rank, my expert]
        send = counts.view(self.ep, per_rank).sum(1).tolist()  # the host sync: split sizes
        recv = received.sum(1).tolist()
        # 2. (N*k, C) -> (R, C), rank-major
        arrived = all_to_all_rows(rows, send, recv, self.group)
        # 3. rank-major -> expert-major: each row's local expert, sorted stably
        local = torch.arange(per_rank, device=counts.device).repeat(self.ep)
        regroup = torch.sort(local.repeat_interleave(received.flatten()), stable=True).indices
        mine = [experts[str(e)] for e in self.experts]
        out = run_experts(arrived[regroup], received.sum(0).tolist(), mine)
        # 4. expert-major -> rank-major, then (R, C) -> (N*k, C) back to their tokens' ranks
        returned = all_to_all_rows(out[torch.argsort(regroup)], recv, send, self.group)
        return returned, received
        # exercise day22.ep_dispatch: end


class AllGatherDispatcher:
    """The other way to move tokens (megatron-core's MoEAllGatherTokenDispatcher): every rank
    gathers every rank's tokens, runs its own experts on the rows routed to them, and the
    partial outputs are summed across the group. More bytes than all-to-all (all tokens
    everywhere), no split sizes to exchange; the tests use it as a second opinion."""

    def __init__(self, group: dist.ProcessGroup, n_expert: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.experts = local_experts(n_expert, self.ep, dist.get_rank(group))

    def __deepcopy__(self, memo: dict) -> AllGatherDispatcher:
        return self  # a process group is not copied: a pipeline stage's copy shares it

    def __call__(
        self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleDict, n_expert: int
    ) -> torch.Tensor:
        mine = torch.tensor([tokens.size(0)], device=tokens.device)
        sizes = [torch.zeros_like(mine) for _ in range(self.ep)]
        dist.all_gather(sizes, mine, group=self.group)
        n, longest = [int(s) for s in sizes], max(int(s) for s in sizes)
        everyone = _gather_rows(tokens, n, longest, self.group)  # (sum n, C)
        chosen = _gather_rows(routing.experts, n, longest, self.group)  # (sum n, k)
        k = routing.top_k
        flat = chosen.flatten()
        ours = torch.nonzero((flat >= self.experts.start) & (flat < self.experts.stop)).flatten()
        order = ours[torch.sort(flat[ours], stable=True).indices]  # my slots, expert-major
        counts = torch.bincount(flat[order] - self.experts.start, minlength=len(self.experts))
        out = run_experts(
            everyone[order // k], counts.tolist(), [experts[str(e)] for e in self.experts]
        )
        partial = out.new_zeros(flat.numel(), out.size(1)).index_copy(0, order, out)
        total = cast(torch.Tensor, _Sum.apply(partial, self.group))  # every slot's output
        start = sum(n[: dist.get_rank(self.group)]) * k
        return combine(total[start : start + tokens.size(0) * k], routing)


class _Sum(torch.autograd.Function):
    """All-reduce (sum) forward; backward the same: every rank's output used every input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _GatherRows(torch.autograd.Function):
    """All-gather of equal (padded) row blocks; backward: the gathered gradient summed over the
    ranks (each used every block) and this rank's block kept (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)  # (ep * rows, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


def _gather_rows(
    x: torch.Tensor, sizes: list[int], longest: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Every rank's (sizes[r], ...) rows end to end, padded to `longest` for the gather."""
    padded = torch.cat([x, x.new_zeros(longest - x.size(0), *x.shape[1:])])
    parts = cast(torch.Tensor, _GatherRows.apply(padded, group)).chunk(len(sizes))
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)])


def apply_ep(
    model: nn.Module, group: dist.ProcessGroup, dispatcher: type = AllToAllDispatcher
) -> nn.Module:
    """Expert parallelism over `group`, in place: every MoE layer keeps its E/ep experts (the
    others are deleted; the kept ones keep their one-process names, so init, checkpoints and
    the reduction table find them) and moves tokens with `dispatcher`."""
    for layer in moe_layers(model):
        check_ep(layer.cfg.n_expert, dist.get_world_size(group))
        layer.dispatcher = dispatcher(group, layer.cfg.n_expert)
        _keep(layer, cast(AllToAllDispatcher, layer.dispatcher).experts)
    return model


def _keep(layer: MoE, experts: range) -> None:
    for name in list(layer.experts.keys()):
        if int(name) not in experts:
            del layer.experts[name]
