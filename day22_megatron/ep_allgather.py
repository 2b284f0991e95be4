"""The other way to move an MoE layer's tokens (megatron-core's MoEAllGatherTokenDispatcher):
every rank of the ep group gathers every rank's tokens, runs its own experts on the rows routed
to them, and the partial outputs are summed across the group. More bytes than all-to-all (all
tokens everywhere), no split sizes to exchange. Megatron-core's second identity is that both
dispatchers give the same layer: tests/test_day22_ep.py checks it bit for bit.

    apply_ep(layer, group, AllGatherDispatcher)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from day22_megatron.ep import HoldsExperts
from dtl.moe import Routing, combine, run_experts


class AllGatherDispatcher(HoldsExperts):
    """Every rank's tokens gathered, this rank's experts run on theirs, the outputs summed."""

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
        # every slot's expert output: each rank filled the slots of its own experts
        total: torch.Tensor = _Sum.apply(partial, self.group)  # type: ignore[no-untyped-call]
        start = sum(n[: dist.get_rank(self.group)]) * k
        return combine(total[start : start + tokens.size(0) * k], routing)


class _Sum(torch.autograd.Function):
    """All-reduce (sum) forward; backward the same: every rank's output used every input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _GatherRows(torch.autograd.Function):
    """All-gather of equal (padded) row blocks; backward: the gathered gradient summed over the
    ranks (each used every block) and this rank's block kept (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)  # (ep * rows, ...)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


def _gather_rows(
    x: torch.Tensor, sizes: list[int], longest: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Every rank's (sizes[r], ...) rows end to end, padded to `longest` for the gather."""
    padded = torch.cat([x, x.new_zeros(longest - x.size(0), *x.shape[1:])])
    gathered: torch.Tensor = _GatherRows.apply(padded, group)  # type: ignore[no-untyped-call]
    parts = gathered.chunk(len(sizes))  # (longest, ...) per rank
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)])
