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
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from dtl.exercise_seam import exercise
from dtl.grid import ParallelGrid
from dtl.moe import Dispatcher, MoE, Routing, combine, moe_layers, run_experts, sort_by_expert
from dtl.reduction import EXPERT

[EP_AXIS] = EXPERT  # the grid's axis of expert parallelism
# megatron-core's order tp-cp-ep-dp-pp, outermost first: an ep group is the data ranks next to
# each other inside one dp coordinate (the experts' copies lie along dp)
EP_AXES = ("pp", "dp", "ep", "cp", "tp")
# the groups the stack's reductions ask for besides the grid's default ones: dense gradients
# averaged over dp x ep x cp, the norm's squares summed over ep (other experts), tp and pp
EP_COMBOS = (("dp", "ep", "cp"), ("ep", "tp", "pp"), ("pp", "ep"))  # and the full state's
# merge of other tensors: the stages' (pp) and the experts' (ep)


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
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (send, recv), group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
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
    moved: torch.Tensor = _AllToAll.apply(x, send, recv, group)  # type: ignore[no-untyped-call]
    return moved


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


class HoldsExperts:
    """A dispatcher over an ep group: the group, its size and this rank's block of experts.
    A pipeline stage's deep copy shares it (a process group is not copied)."""

    def __init__(self, group: dist.ProcessGroup, n_expert: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.experts = local_experts(n_expert, self.ep, dist.get_rank(group))

    def __deepcopy__(self, memo: dict[int, Any]) -> HoldsExperts:
        return self


class AllToAllDispatcher(HoldsExperts):
    """Steps 1-5 of the module docstring: this rank's experts, the others' by all-to-all."""

    def __init__(self, group: dist.ProcessGroup, n_expert: int):
        super().__init__(group, n_expert)
        self.traffic = Traffic()

    def __call__(
        self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleDict, n_expert: int
    ) -> torch.Tensor:
        order, counts = sort_by_expert(routing, n_expert)
        rows = tokens[order // routing.top_k]  # (N*k, C), expert-major = destination-major
        returned, recv = self.exchange(rows, counts, experts)  # steps 1-4
        self.traffic.add(rows.size(0), sum(recv))
        # 5. expert order -> (token, slot) order, weighted sum over the k slots
        return combine(returned[torch.argsort(order)], routing)

    @exercise("day22.ep_dispatch")
    def exchange(
        self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict
    ) -> tuple[torch.Tensor, list[int]]:
        """Steps 1-4: `rows` (N*k, C), this rank's rows sorted by expert, `counts` (E,) how
        many go to each expert -> (the rows' expert outputs, in the same order, (N*k, C); the
        rows each rank sent here, a list of ep ints). This rank's experts are `self.experts`
        (a range), found in `experts` by str(index); the group is `self.group` of `self.ep`
        ranks. all_to_all_rows moves rows with autograd; dist.all_to_all_single moves the
        counts; run_experts runs experts on slices. One host sync: the split sizes."""
        per_rank = len(self.experts)
        # exercise day22.ep_dispatch: begin
        # 1. (E,) counts -> (E,) received: what each rank sends to each of my experts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # the host sync: both tables as Python ints, [rank][expert of that rank's block]
        sent_table, recv_table = torch.stack([counts, received]).view(2, self.ep, -1).tolist()
        send = [sum(row) for row in sent_table]  # rows to each rank
        recv = [sum(row) for row in recv_table]  # rows from each rank
        per_expert = [sum(col) for col in zip(*recv_table, strict=True)]  # rows per my expert
        # 2. (N*k, C) -> (R, C), rank-major
        arrived = all_to_all_rows(rows, send, recv, self.group)
        # 3. rank-major -> expert-major: each row's local expert, sorted stably
        local = torch.arange(per_rank, device=counts.device).repeat(self.ep)
        expert_of_row = local.repeat_interleave(received, output_size=sum(recv))  # (R,)
        regroup = torch.sort(expert_of_row, stable=True).indices
        mine = [experts[str(e)] for e in self.experts]
        out = run_experts(arrived[regroup], per_expert, mine)
        # 4. expert-major -> rank-major, then (R, C) -> (N*k, C) back to their tokens' ranks
        returned = all_to_all_rows(out[torch.argsort(regroup)], recv, send, self.group)
        return returned, recv
        # exercise day22.ep_dispatch: end


class ExpertDispatcher(Dispatcher, Protocol):
    """A dispatcher that holds some of the experts: built from (group, E), it knows which."""

    experts: range

    def __init__(self, group: dist.ProcessGroup, n_expert: int) -> None: ...


def apply_ep(
    model: nn.Module,
    group: dist.ProcessGroup,
    dispatcher: type[ExpertDispatcher] = AllToAllDispatcher,
) -> nn.Module:
    """Expert parallelism over `group`, in place: every MoE layer keeps its E/ep experts (the
    others are deleted; the kept ones keep their one-process names, so init, checkpoints and
    the reduction table find them) and moves tokens with `dispatcher`."""
    for layer in moe_layers(model):
        check_ep(layer.cfg.n_expert, dist.get_world_size(group))
        moves = dispatcher(group, layer.cfg.n_expert)
        layer.dispatcher = moves
        _keep(layer, moves.experts)
    return model


def _keep(layer: MoE, experts: range) -> None:
    for name in list(layer.experts.keys()):
        if int(name) not in experts:
            del layer.experts[name]
