"""Day 21: Ulysses attention: all-to-all from sequence shards to head shards and back.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509). Attention heads are independent, so
instead of passing K/V blocks around a ring, one all-to-all re-cuts Q, K and V: each rank gives
away its tokens of the other ranks' heads and receives every token of its own nh/cp heads. Then
it runs ordinary (fused, causal) attention on whole sequences, and one more all-to-all cuts the
output back into sequence shards:

    (B, nh, T/cp, hs)  --all-to-all-->  (B, nh/cp, T, hs)  --attention-->  (B, nh/cp, T, hs)
      my tokens, all heads                all tokens, my heads               --all-to-all-->
                                                                           (B, nh, T/cp, hs)

Four all-to-alls forward (Q, K, V, output) and four backward (each one's inverse), each moving
(cp-1)/cp of a B·(T/cp)·C tensor per rank: the volume per rank falls as cp grows, where ring
attention's stays 2·B·(T/cp)·C per step for cp - 1 steps. The price: cp must divide the number of
heads (of one TP rank), and the causal split is contiguous (rank r holds chunk r; all-to-all
concatenates the shards in rank order, which is then the sequence order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtl import profile as dtl_profile
from dtl.exercise_seam import exercise


class UlyssesError(ValueError):
    """Heads that do not split over cp; one line."""


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Dim 0 of x (cp pieces): piece j goes to rank j; piece i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    with dtl_profile.range(dtl_profile.comm_name("all_to_all", "cp")):  # a named range
        dist.all_to_all_single(out, x, group=group)
    return out


@exercise("day21.ulysses_all_to_all")
def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, nh, T/cp, hs) my tokens of every head -> (B, nh/cp, T, hs) every token of my heads.

    Rank j's heads are the j-th run of nh/cp (heads j·nh/cp to (j+1)·nh/cp - 1); rank i holds
    tokens i·T/cp to (i+1)·T/cp - 1 (the contiguous split), so the pieces received, laid end
    to end in rank order along the sequence, are the whole sequence in order."""
    cp = dist.get_world_size(group)
    B, nh, t, hs = x.shape
    if nh % cp:
        raise UlyssesError(f"{nh} heads do not split over cp {cp} (Ulysses needs heads % cp == 0)")
    # all-to-all: my tokens of rank j's heads go to rank j; rank i's tokens of my heads come back
    # exercise day21.ulysses_all_to_all: begin
    pieces = x.reshape(B, cp, nh // cp, t, hs).transpose(0, 1)  # (cp, B, nh/cp, T/cp, hs)
    got = _all_to_all(pieces, group)  # piece i: rank i's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(B, nh // cp, cp * t, hs)
    # exercise day21.ulysses_all_to_all: end


@exercise("day21.ulysses_all_to_all")
def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse: (B, nh/cp, T, hs) every token of my heads -> (B, nh, T/cp, hs)."""
    cp = dist.get_world_size(group)
    B, h, T, hs = y.shape
    # all-to-all: rank i's tokens of my heads go to rank i; my tokens of rank j's heads come back
    # exercise day21.ulysses_all_to_all: begin
    pieces = y.reshape(B, h, cp, T // cp, hs).permute(2, 0, 1, 3, 4)  # (cp, B, nh/cp, T/cp, hs)
    got = _all_to_all(pieces, group)  # piece i: my tokens of rank i's heads
    return got.transpose(0, 1).reshape(B, cp * h, T // cp, hs)
    # exercise day21.ulysses_all_to_all: end


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group), None  # an all-to-all's gradient: its inverse


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group), None


class UlyssesAttention:
    """An attention function for GPT.set_attention: Ulysses over `group`, any local kernel."""

    def __init__(self, group, causal: bool = True):
        self.group, self.causal = group, causal

    def __call__(self, q, k, v):
        q, k, v = (SeqToHeads.apply(t, self.group) for t in (q, k, v))  # (B, nh/cp, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return HeadsToSeq.apply(y, self.group)  # (B, nh, T/cp, hs)
