"""The notes' picture of one MoE layer's dispatch under expert parallelism, from a real routing:
tiny-moe's first layer (E = 4, k = 2, seed 0) on two ranks' first tokens of the corpus, ep = 2.

Three columns per rank, as the all-to-all dispatcher (ep.py) lays its buffers out: the rows it
sends, sorted by expert (so by destination rank); the rows that arrive, rank-major; the same
rows regrouped expert-major, one contiguous slice per local expert. A cell is one (token, slot)
row: "r0 t3" is rank 0's token 3; its colour is its expert.
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from day22_megatron.ep import local_experts
from dtl.data import get_batch, load_corpus
from dtl.model import GPT, preset
from dtl.moe import MoE, sort_by_expert

EP, TOKENS = 2, 5  # ranks, tokens per rank
EXPERT_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")


def routed_rows() -> list[list[tuple[int, int, int]]]:
    """Per rank, its (rank, token, expert) rows in expert order, from the real router."""
    gpt = GPT(preset("tiny-moe"), seed=0)
    layer = gpt.blocks["0"].mlp
    assert isinstance(layer, MoE)
    seen: list[torch.Tensor] = []
    layer.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    x, _ = get_batch(load_corpus(tokenizer="byte").train, TOKENS, EP, seed=0, step=0)
    with torch.no_grad():
        gpt(x)  # (EP, TOKENS): one row of tokens per rank
    rows = []
    for rank in range(EP):
        tokens = seen[0][rank]  # (TOKENS, C): the layer's input on this rank
        routing = layer.route(tokens)
        order, _ = sort_by_expert(routing, layer.cfg.n_expert)
        flat = routing.experts.flatten()
        rows.append([(rank, int(i) // layer.cfg.top_k, int(flat[i])) for i in order])
    return rows


def _column(ax, x: float, top: int, title: str, cells: list[tuple[int, int, int]]) -> None:
    """Rows top-down from `top`, each a cell coloured by its expert."""
    ax.text(x + 0.5, top + 0.3, title, ha="center", fontsize=8)
    for i, (rank, token, expert) in enumerate(cells):
        y = top - 1 - i
        ax.add_patch(Rectangle((x, y), 1.0, 0.9, fc=EXPERT_COLORS[expert], ec="black"))
        ax.text(x + 0.5, y + 0.45, f"r{rank} t{token}", ha="center", va="center", fontsize=7)


def _splits(ax, x: float, top: int, cells: list[tuple[int, int, int]], per_rank: int) -> None:
    """Brackets left of a send column: which rows go to which rank."""
    start = 0
    for dst in range(EP):
        n = sum(1 for _, _, e in cells if e // per_rank == dst)
        if n:
            high, low = top - start, top - start - n + 0.1
            ax.plot([x - 0.15, x - 0.15], [low, high - 0.1], color="black", lw=1)
            ax.text(x - 0.25, (high + low) / 2, f"to rank {dst}\n{n} rows", ha="right",
                    va="center", fontsize=7)  # fmt: skip
        start += n


def dispatch_figure() -> Figure:
    rows = routed_rows()
    n_expert = len(EXPERT_COLORS)
    per_rank = n_expert // EP
    arrived = [
        [row for src in rows for row in src if row[2] in local_experts(n_expert, EP, rank)]
        for rank in range(EP)
    ]  # rank-major: rank 0's rows for my experts, then rank 1's
    top = max(len(c) for c in (*rows, *arrived))
    fig = Figure(figsize=(12, 4.6))
    ax = fig.subplots()
    for rank in range(EP):
        mine = local_experts(n_expert, EP, rank)
        regrouped = sorted(arrived[rank], key=lambda row: row[2])  # stable: ranks in order
        x0 = 1.2 + rank * 6.2
        _column(ax, x0, top, f"rank {rank} sends\n(sorted by expert)", rows[rank])
        _splits(ax, x0, top, rows[rank], per_rank)
        _column(ax, x0 + 1.7, top, f"rank {rank} receives\n(rank-major)", arrived[rank])
        title = f"experts {mine.start}-{mine.stop - 1} run\n(expert-major)"
        _column(ax, x0 + 3.4, top, title, regrouped)
    for e, color in enumerate(EXPERT_COLORS):
        ax.add_patch(Rectangle((13.4, top - 2 - e), 0.5, 0.5, fc=color, ec="black"))
        ax.text(14.05, top - 1.75 - e, f"expert {e} (rank {e // per_rank})", va="center")
    ax.set_xlim(-0.3, 16.5)
    ax.set_ylim(-0.3, top + 1.3)
    ax.axis("off")
    fig.suptitle(
        "One MoE layer (tiny-moe, E = 4, k = 2) on ep = 2 ranks of 5 tokens: the rows of the"
        " first all-to-all and the regroup, from a real routing",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
