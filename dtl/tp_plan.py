"""The tensor-parallel plan: one declaration of how the GPT's modules split over TP ranks, read
by the TP, SP, checkpoint and reduction code (torchtitan keeps its plan as a dict the same way).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """How a module's weight (and bias) is split over tensor-parallel ranks.

    column  Linear, output features split: weight rows (dim 0) and bias; Y_t = X A_t
    row     Linear, input features split: weight columns (dim 1); the partial outputs are summed
            (all-reduce), so the bias is added once, after the sum: not split
    vocab   Embedding (or the output layer) with the vocabulary split: rows (dim 0)
    `blocks` > 1: the output is several tensors side by side (the fused QKV: 3), each split on
    its own, so a rank holds [Q_t; K_t; V_t], i.e. whole heads of each.
    """

    style: str
    blocks: int = 1


TP_PLAN: dict[str, Shard] = {
    "wte": Shard("vocab"),
    "blocks.*.attn.c_attn": Shard("column", blocks=3),  # fused Q, K, V: split by heads
    "blocks.*.attn.c_proj": Shard("row"),
    "blocks.*.mlp.c_fc": Shard("column"),
    "blocks.*.mlp.c_proj": Shard("row"),
    "lm_head": Shard("vocab"),  # column-parallel over the vocabulary (tied to wte)
}  # not listed (wpe, ln_1, ln_2, ln_f): replicated on every TP rank


def tp_shard_of(module_name: str) -> Shard | None:
    """The plan's entry for a module name, or None when the module is replicated."""
    return next((s for pat, s in TP_PLAN.items() if fnmatch.fnmatchcase(module_name, pat)), None)


def shard_tensor(
    full: torch.Tensor, shard: Shard, is_bias: bool, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """Rank `tp_rank`'s piece of a full weight or bias under `shard` (a copy)."""
    if shard.style == "row":
        return full.clone() if is_bias else _split(full, 1, 1, tp_rank, tp_size)
    return _split(full, 0, shard.blocks, tp_rank, tp_size)


def _split(t: torch.Tensor, dim: int, blocks: int, rank: int, size: int) -> torch.Tensor:
    if t.size(dim) % (blocks * size):
        raise ValueError(
            f"dimension {dim} of size {t.size(dim)} does not split into {blocks} block(s) x "
            f"{size} ranks"
        )
    pieces = [b.chunk(size, dim)[rank] for b in t.chunk(blocks, dim)]
    return torch.cat(pieces, dim).clone()


def per_head_rows(n_head: int, head_dim: int) -> torch.Tensor:
    """The row order that turns c_attn's [Q; K; V] (one-process) into [q_0; k_0; v_0; q_1; ...]
    (Megatron's per-head layout, read by dtl.model.qkv_per_head): `weight[per_head_rows(...)]`.
    Its argsort turns it back."""
    C = n_head * head_dim
    head = torch.arange(head_dim)  # host: row indices, read by indexing on any device
    return torch.cat([j * C + h * head_dim + head for h in range(n_head) for j in range(3)])
