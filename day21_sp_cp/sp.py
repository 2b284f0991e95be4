"""Day 21: Megatron sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2).

Under day 19's tensor parallelism every TP rank holds the *whole* (B, T, C) activation wherever
the layer is not split: LayerNorm, dropout, the residual stream. Those tensors are identical on
the t ranks: t copies of the same bytes. Sequence parallelism splits them along the sequence:

    TP only    (B,T,C) -LN-> f -> col | attn | row -> g (all-reduce)     -> (B,T,C) -dropout, +x
    TP + SP    (B,T/t,C) -LN-> all-gather -> col | attn | row -> reduce-scatter -> (B,T/t,C) ...

An all-reduce is a reduce-scatter followed by an all-gather, so g = all-reduce becomes a
reduce-scatter (forward; its backward is an all-gather) and f = identity becomes an all-gather
(forward; backward: reduce-scatter). Per layer the same bytes cross the wire as under TP; every
tensor between a row-parallel layer and the next column-parallel one is 1/t as big.

Three details make it exact and memory-saving (Megatron does all three):
- the column-parallel layer keeps only its (B, T/t, C) input shard for backward and all-gathers
  it again there, overlapped with the input-gradient matmul (`save_gathered=False`, Megatron's
  LinearWithGradAccumulationAndAsyncCommunication): activations /t, one more all-gather per
  column layer in backward. `save_gathered=True` keeps the gathered input: bytes = TP's exactly;
- parameters that are not split (LayerNorm weight and bias, the row-parallel bias) now see only
  T/t tokens on each rank: their gradients are partial sums and are all-reduced over the TP
  group (megatron/core/distributed/finalize_model_grads.py; here a hook on each parameter);
- the position embedding is looked up for the whole sequence and cut (`scatter_to_sp`), whose
  backward all-gathers: every rank ends with the whole wpe gradient, nothing to add.

    gpt = apply_sp(apply_tp(GPT(cfg, seed), grid))   # then tp_loss(gpt, gpt(x), y) as on day 19
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from day19_tp.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from day19_tp.tp_comms import _all_reduce
from dtl import compat
from dtl import profile as dtl_profile
from dtl.model import GPT
from dtl.tp_plan import tp_shard_of


class SPError(ValueError):
    """Sequence parallelism asked for where it cannot run; one line."""


# --- the sequence-dimension collectives (dim 1 of (B, T, C), dim -2 in general) -----------------


def _check_split(n: int, t: int) -> None:
    if n % t:
        raise SPError(f"sequence of {n} tokens does not split over {t} TP ranks")


def all_gather_seq(x: torch.Tensor, group, async_op: bool = False):
    """(B, T/t, C) on each rank -> (B, T, C), rank r's tokens at rows [r·T/t, (r+1)·T/t).
    all_gather_single stacks along dim 0, so the sequence is moved to the front and back."""
    t = dist.get_world_size(group)
    front = x.movedim(-2, 0).contiguous()  # (T/t, ..., C)
    out = torch.empty((t * front.size(0), *front.shape[1:]), dtype=x.dtype, device=x.device)
    with dtl_profile.range(dtl_profile.comm_name("all_gather", "sp")):  # a named range
        work = compat.all_gather_single(out, front, group=group, async_op=async_op)
    result = out.movedim(0, -2)
    return (result, work) if async_op else result


def reduce_scatter_seq(x: torch.Tensor, group, async_op: bool = False):
    """(B, T, C) partial sums on each rank -> (B, T/t, C): the sum, this rank's tokens only."""
    t = dist.get_world_size(group)
    _check_split(x.size(-2), t)
    front = x.movedim(-2, 0).contiguous()  # (T, ..., C)
    out = torch.empty((front.size(0) // t, *front.shape[1:]), dtype=x.dtype, device=x.device)
    with dtl_profile.range(dtl_profile.comm_name("reduce_scatter", "sp")):
        work = compat.reduce_scatter_single(out, front, group=group, async_op=async_op)
    result = out.movedim(0, -2)
    return (result, work) if async_op else result


def _my_tokens(x: torch.Tensor, group) -> torch.Tensor:
    t, r = dist.get_world_size(group), dist.get_rank(group)
    _check_split(x.size(-2), t)
    return x.chunk(t, dim=-2)[r].contiguous()


class ReduceScatterToSP(torch.autograd.Function):
    """After a row-parallel layer: forward reduce-scatter, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)  # (B, T, C) partial -> (B, T/t, C) summed

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None  # (B, T/t, C) -> (B, T, C)


class ScatterToSP(torch.autograd.Function):
    """Keep my tokens (forward, no communication); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_tokens(x, group)  # (…, T, C) -> (…, T/t, C)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


class SPColumnLinear(torch.autograd.Function):
    """all-gather the sequence, then x A_r (+ b_r): Megatron's column layer under SP.

    Forward  (B, T/t, in) -all-gather-> (B, T, in) @ (in, out/t) -> (B, T, out/t)
    Backward dX = dY A_r^T (B, T, in), partial over ranks -reduce-scatter-> (B, T/t, in);
             dA_r = dY^T X needs the whole X: re-gathered here unless it was saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, save_gathered):
        full = all_gather_seq(x, group)
        ctx.save_for_backward(full if save_gathered else x, weight)
        ctx.group, ctx.save_gathered, ctx.has_bias = group, save_gathered, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        if ctx.save_gathered:
            full, gather = x, None
        else:  # start the all-gather, compute dX meanwhile (Megatron's overlap)
            full, gather = all_gather_seq(x, ctx.group, async_op=True)
        grad_full = grad_y @ weight  # (B, T, out/t) @ (out/t, in) -> (B, T, in), partial
        if gather is not None:
            gather.wait()
        grad_x, scatter = reduce_scatter_seq(grad_full, ctx.group, async_op=True)
        gy = grad_y.reshape(-1, grad_y.size(-1))
        grad_w = gy.t() @ full.reshape(-1, full.size(-1))  # (out/t, in), while dX travels
        grad_b = gy.sum(0) if ctx.has_bias else None
        scatter.wait()
        return grad_x, grad_w, grad_b, None, None


# --- the SP versions of day 19's layers: the same Parameters, other communication ----------------


class SPColumnParallelLinear(nn.Module):
    def __init__(self, layer: ColumnParallelLinear, save_gathered: bool = False):
        super().__init__()
        self.group, self.save_gathered = layer.group, save_gathered
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x):  # (B, T/t, in) -> (B, T, out/t)
        return SPColumnLinear.apply(x, self.weight, self.bias, self.group, self.save_gathered)


class SPRowParallelLinear(nn.Module):
    def __init__(self, layer: RowParallelLinear):
        super().__init__()
        self.group = layer.group
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x):  # (B, T, in/t) -> (B, T, out) partial -> (B, T/t, out) summed
        y = ReduceScatterToSP.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y  # bias on my tokens only


class SPVocabParallelEmbedding(nn.Module):
    """Day 19's embedding, its all-reduce replaced by a reduce-scatter: (B, T) -> (B, T/t, C)."""

    def __init__(self, layer: VocabParallelEmbedding):
        super().__init__()
        self.group, self.lo, self.hi = layer.group, layer.lo, layer.hi
        self.per_rank, self.weight = layer.per_rank, layer.weight

    def forward(self, ids):
        outside = (ids < self.lo) | (ids >= self.hi)
        rows = F.embedding((ids - self.lo).masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C), my words only
        return ReduceScatterToSP.apply(rows, self.group)


class SPVocabParallelHead(nn.Module):
    """The output layer: all-gather the sequence, then this rank's V/t logits, (B, T, V/t)."""

    def __init__(self, layer: VocabParallelHead, save_gathered: bool = False):
        super().__init__()
        self.group, self.weight, self.save_gathered = layer.group, layer.weight, save_gathered

    def forward(self, x):
        return SPColumnLinear.apply(x, self.weight, None, self.group, self.save_gathered)


class SPPositionEmbedding(nn.Module):
    """wpe for the whole sequence, cut to my tokens: (T,) or (B, T) positions -> (…, T/t, C)."""

    def __init__(self, wpe: nn.Embedding, group):
        super().__init__()
        self.group, self.weight = group, wpe.weight

    def forward(self, pos):
        return ScatterToSP.apply(F.embedding(pos, self.weight), self.group)


@dataclass
class SPInfo:
    group: object
    size: int
    save_gathered: bool
    synced: list  # names of the replicated parameters whose gradients are all-reduced over TP


def _sync_over_tp(group):
    def hook(grad):  # a partial sum (my T/t tokens) -> the sum over the TP group
        return _all_reduce(grad, group)

    return hook


def replicated_parameters(model: GPT) -> list[str]:
    """Parameters every TP rank holds whole that see only its tokens under SP (wpe excepted)."""
    names = []
    for name, _ in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        shard = tp_shard_of(module_name)
        if module_name == "wpe":
            continue  # its cut's backward all-gathers: every rank has the whole gradient
        if shard is None or (shard.style == "row" and kind == "bias"):
            names.append(name)
    return names


@torch.no_grad()
def apply_sp(model: GPT, save_gathered: bool = False) -> GPT:
    """Turn day 19's TP model (apply_tp) into TP + SP over the same TP group, in place."""
    info = getattr(model, "tp", None)
    if info is None or info.size == 1:
        raise SPError("sequence parallelism needs tensor parallelism: apply_tp with tp > 1 first")
    if model.cfg.dropout > 0:  # Megatron forks a per-TP-rank RNG stream for the SP regions
        raise SPError("SP with dropout needs a separate RNG stream per TP rank (not built here)")
    for name, module in list(model.named_modules()):
        if isinstance(module, ColumnParallelLinear):
            new = SPColumnParallelLinear(module, save_gathered)
        elif isinstance(module, RowParallelLinear):
            new = SPRowParallelLinear(module)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    model.wte = SPVocabParallelEmbedding(model.wte)
    model.lm_head = SPVocabParallelHead(model.lm_head, save_gathered)
    model.wpe = SPPositionEmbedding(model.wpe, info.group)
    synced = replicated_parameters(model)
    params = dict(model.named_parameters())
    for name in synced:
        params[name].register_hook(_sync_over_tp(info.group))
    model.sp = SPInfo(info.group, info.size, save_gathered, synced)
    return model
