"""Day 21: context parallelism for the shared GPT: the sequence split over cp ranks, every layer.

    gpt = apply_cp(GPT(cfg, seed), grid, attn="ring_zigzag")   # or apply_tp / apply_sp first
    x, y, pos = cp_batch(gpt, x, y)      # (B, T) -> my (B, T/cp) tokens and their positions
    loss = loss_fn(gpt(x, pos), y)       # the mean over my tokens
    # gradients: averaged over dp x cp (grid.group("dp", "cp")): every parameter is replicated
    # over cp, each cp rank saw T/cp of the tokens, and the mean of the cp ranks' means is the
    # mean over the sequence (equal token counts)

Only attention talks across cp ranks (ring_attention.py or ulysses.py); embeddings, LayerNorm,
MLP and the loss are per token. Position ids are the global positions of my tokens
(dtl.data.cp_positions): with a zig-zag split they are not contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

from day21_sp_cp.ring_attention import RingAttention, RingStats
from day21_sp_cp.ulysses import UlyssesAttention
from dtl.data import cp_positions, cp_shard
from dtl.grid import ParallelGrid
from dtl.model import GPT

ATTENTION = {  # --attn -> (how the sequence is split, the attention)
    "ring": "contiguous",
    "ring_zigzag": "zigzag",
    "ulysses": "contiguous",
}


class CPError(ValueError):
    """A sequence or head count that does not split over cp; one line."""


def check_cp(
    n_head: int, tp: int, cp: int, seq_len: int | None, attn: str, sp: bool = False
) -> None:
    """Everything context parallelism cuts must divide (checked before any collective)."""
    if attn not in ATTENTION:
        raise CPError(f"unknown attention '{attn}'; choose one of {', '.join(ATTENTION)}")
    if attn == "ulysses" and (n_head // tp) % cp:
        raise CPError(
            f"{n_head // tp} heads per TP rank do not split over cp {cp} "
            "(Ulysses sends each rank whole heads)"
        )
    if seq_len is None:
        return
    pieces = cp * (2 if ATTENTION[attn] == "zigzag" else 1)
    if seq_len % pieces:
        raise CPError(
            f"seq_len {seq_len} is not divisible by {pieces} ({attn} over cp {cp}"
            f"{': zig-zag needs 2·cp chunks' if ATTENTION[attn] == 'zigzag' else ''})"
        )
    if sp and (seq_len // cp) % tp:
        raise CPError(f"the {seq_len // cp} tokens of a cp rank do not split over tp {tp} (SP)")


@dataclass
class CPInfo:
    group: object
    size: int
    rank: int
    attn: str
    split: str
    stats: RingStats | None


def apply_cp(
    model: GPT, grid: ParallelGrid, attn: str = "ring", stats: RingStats | None = None
) -> GPT:
    """Give every attention layer of `model` the cp-parallel attention over grid.cp_group."""
    heads = model.blocks["0"].attn.n_local_heads  # per TP rank after apply_tp
    check_cp(heads, 1, grid.cp_size, None, attn)
    split = ATTENTION[attn]
    if grid.cp_size > 1:  # cp = 1: keep the fused kernel (a ring of one would be the same math)
        if attn == "ulysses":
            fn = UlyssesAttention(grid.cp_group)
        else:
            fn = RingAttention(grid.cp_group, split=split, stats=stats)
        model.set_attention(fn)
    model.cp = CPInfo(grid.cp_group, grid.cp_size, grid.cp_rank, attn, split, stats)
    return model


def cp_batch(model: GPT, x, y):
    """(B, T) inputs and targets -> this cp rank's (B, T/cp) of each and its (T/cp,) positions."""
    info: CPInfo = model.cp
    r, n, split = info.rank, info.size, info.split
    pos = cp_positions(x.size(1), r, n, split).to(x.device)
    return cp_shard(x, r, n, split), cp_shard(y, r, n, split), pos
