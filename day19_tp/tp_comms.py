"""Day 19: the four communication operators of tensor parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, section 3) names two conjugate operators:

    f  = copy_to_tp        forward: identity           backward: all-reduce the gradient
    g  = reduce_from_tp    forward: all-reduce          backward: identity

A column-parallel layer starts with f: every TP rank gets the same input X and computes its
columns of X A, so the gradient of X is a *sum* of the ranks' partial gradients (each rank only
sees its columns' contribution). A row-parallel layer ends with g: each rank's partial product
X_t A_t is summed into the full output, and the gradient of a sum flows unchanged to each term.
The other two move a tensor between "split along the last dimension" and "whole":

    gather_from_tp        forward: all-gather (…, C/t) -> (…, C)   backward: keep my slice
    scatter_to_tp         forward: keep my slice (…, C) -> (…, C/t) backward: all-gather

Each is a torch.autograd.Function: forward and backward written side by side, so the
communication of both directions is visible in one place (megatron/core/tensor_parallel/
mappings.py has the same four, plus the sequence-parallel ones of day 21).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtl import profile as dtl_profile
from dtl.exercise_seam import exercise


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x.view_as(x)
    x = x.contiguous().clone()  # all_reduce works in place: never sum into autograd's tensor
    with dtl_profile.range(dtl_profile.comm_name("all_reduce", "tp")):  # a named range
        dist.all_reduce(x, group=group)
    return x


def _my_slice(x: torch.Tensor, group) -> torch.Tensor:
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if x.size(-1) % t:
        raise ValueError(f"last dimension {x.size(-1)} does not split over {t} TP ranks")
    return x.chunk(t, dim=-1)[r].contiguous()


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    t = dist.get_world_size(group)
    if t == 1:
        return x.view_as(x)
    # (…, C/t) on every rank -> t pieces in rank order -> (…, C)
    parts = [torch.empty_like(x) for _ in range(t)]
    with dtl_profile.range(dtl_profile.comm_name("all_gather", "tp")):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# f and g: forward and backward of each, written side by side. backward returns one gradient per
# input of forward (x, group), None for the group; what backward needs of forward goes on ctx.


class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over the TP group."""

    @staticmethod
    @exercise("day19.f_and_g")
    def forward(ctx, x, group):
        # (B, T, C) -> (B, T, C), the same values on every rank
        # exercise day19.f_and_g: begin
        ctx.group = group
        return x.view_as(x)  # a new tensor for autograd, the same storage
        # exercise day19.f_and_g: end

    @staticmethod
    @exercise("day19.f_and_g")
    def backward(ctx, grad):
        # (B, T, C) partial dL/dX on each rank (its columns' share) -> (B, T, C) the sum
        # exercise day19.f_and_g: begin
        return _all_reduce(grad, ctx.group), None
        # exercise day19.f_and_g: end


class ReduceFromTP(torch.autograd.Function):
    """g: forward sums the partial outputs over the TP group; identity backward."""

    @staticmethod
    @exercise("day19.f_and_g")
    def forward(ctx, x, group):
        # (B, T, C) partial X_t A_t on each rank -> (B, T, C) the full X A on every rank
        # exercise day19.f_and_g: begin
        return _all_reduce(x, group)
        # exercise day19.f_and_g: end

    @staticmethod
    @exercise("day19.f_and_g")
    def backward(ctx, grad):
        # (B, T, C) dL/dY, the same on every rank -> dL/d(this rank's term)
        # exercise day19.f_and_g: begin
        return grad, None  # d(sum)/d(term) = 1: each rank gets the whole gradient
        # exercise day19.f_and_g: end


class GatherFromTP(torch.autograd.Function):
    """Forward all-gathers the last dimension; backward keeps this rank's slice of the grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_dim(x, group)  # (…, C/t) -> (…, C)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice(grad, ctx.group), None  # (…, C) -> (…, C/t)


class ScatterToTP(torch.autograd.Function):
    """Forward keeps this rank's slice of the last dimension; backward all-gathers the grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice(x, group)  # (…, C) -> (…, C/t)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad, ctx.group), None  # (…, C/t) -> (…, C)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return ScatterToTP.apply(x, group)
