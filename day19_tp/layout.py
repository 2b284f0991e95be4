"""Day 19: draw who owns which weight elements under tensor parallelism, from the TP plan itself.

Each weight of one block is replaced by a tensor of its element indices, cut with the same
`dtl.tp_plan.shard_tensor` that apply_tp uses, and every element is coloured by the rank that
receives it: the picture cannot disagree with the code.

    python -m day19_tp.layout --tp=2        # writes outputs/day19_tp/layout.png

`block_figure` draws one block as the notes show it (day19_tp/figures/tp_block.png, through
tools/figures.py): every activation's shape on one rank, with each linear's split, and so where
f and g sit, read from the same plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dtl import config as dtl_config
from dtl.model import GPT, GPTConfig
from dtl.tp_plan import shard_tensor, tp_shard_of

# one block's matrices, as torch stores them (out x in), with the operator around each
PANELS = [
    ("blocks.0.attn.c_attn", "c_attn: column, 3 blocks (Q|K|V), by heads; f before"),
    ("blocks.0.attn.c_proj", "attn.c_proj: row; g after"),
    ("blocks.0.mlp.c_fc", "mlp.c_fc: column; f before"),
    ("blocks.0.mlp.c_proj", "mlp.c_proj: row; g after"),
]


def owner_map(weight_shape, module_name: str, tp: int) -> torch.Tensor:
    """(out, in) tensor: the TP rank that holds each element of the module's weight."""
    shard = tp_shard_of(module_name)
    n = weight_shape[0] * weight_shape[1]
    index = torch.arange(n).view(weight_shape).float()  # host: a table for the picture only
    owner = torch.full(weight_shape, -1.0)  # host: the same, never in a collective
    for rank in range(tp):
        mine = shard_tensor(index, shard, False, rank, tp).long().flatten()
        owner.view(-1)[mine] = rank
    return owner


def plot_layout(cfg: GPTConfig, tp: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpt = GPT(cfg, seed=0)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 4.2))
    for ax, (name, title) in zip(axes, PANELS):
        shape = tuple(gpt.get_submodule(name).weight.shape)
        ax.imshow(
            owner_map(shape, name, tp),
            cmap="tab10",
            vmin=0,
            vmax=9,
            aspect="auto",
            interpolation="nearest",
        )
        ax.set_title(f"{title}\nweight {shape[0]} x {shape[1]} (out x in)", fontsize=9)
        ax.set_xlabel("in features")
        ax.set_ylabel("out features")
    fig.suptitle(
        f"tensor parallel layout, t = {tp}: colour = the rank holding each weight element "
        f"(n_embd {cfg.n_embd}, {cfg.n_head} heads)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- one block as a schematic: shapes per rank, the split of each linear, f and g ------------

TP_COLORS = {
    "whole": "#E5E5E5",
    "column": "#A9C4E8",
    "row": "#F3C6A5",
    "f": "#55A868",
    "g": "#C44E52",
    "add": "white",
}


def _linear(name: str, dense_in: str, dense_out: str) -> tuple[str, str, str, str]:
    """(style, box text, per-rank input, per-rank output) of one linear, from its TP_PLAN entry:
    column splits the output features, row the input features (and outputs partial sums)."""
    shard = tp_shard_of(f"blocks.0.{name}")
    i, o = (dense_in, f"{dense_out}/t") if shard.style == "column" else (f"{dense_in}/t", dense_out)
    blocks = f", {shard.blocks} blocks" if shard.blocks > 1 else ""
    out = f"(B,T,{o})" + (" partial" if shard.style == "row" else "")
    return shard.style, f"{name}\n{shard.style}{blocks}\nA: ({i}, {o})", f"(B,T,{i})", out


def _sublayer(first: str, middle: str, second: str, dims: tuple[str, ...]) -> list[tuple]:
    """The nodes (kind, text, output shape) of ln -> linear -> middle -> linear -> +, with f
    before a column-parallel linear and g after a row-parallel one (Megatron's pairing)."""
    s1, t1, in1, out1 = _linear(first, dims[0], dims[1])
    s2, t2, in2, out2 = _linear(second, dims[2], dims[3])
    nodes = [("f", "f", in1)] if s1 == "column" else []
    nodes += [(s1, t1, out1), ("whole", middle, in2), (s2, t2, out2)]
    return nodes + ([("g", "g", "(B,T,C)")] if s2 == "row" else []) + [("add", "+", "(B,T,C)")]


def _chain(ax, y: float, nodes: list[tuple]) -> list[float]:
    """Draw nodes left to right on row y, an arrow labelled with each node's output shape after
    it; returns the x of each node's centre."""
    from matplotlib.patches import Circle, FancyBboxPatch

    x, centres = 0.3, []
    for k, (kind, text, out) in enumerate(nodes):
        w = 0.6 if kind in ("f", "g", "add") else 2.1
        if w < 1:
            ax.add_patch(Circle((x + w / 2, y), 0.3, fc=TP_COLORS[kind], ec="black"))
        else:
            ax.add_patch(
                FancyBboxPatch(
                    (x, y - 0.55), w, 1.1, boxstyle="round,pad=0.05", fc=TP_COLORS[kind], ec="black"
                )
            )
        color = "white" if kind in ("f", "g") else "black"
        ax.text(
            x + w / 2,
            y,
            text,
            ha="center",
            va="center",
            fontsize=8 if w > 1 else 12,
            color=color,
            weight="bold" if w < 1 else "normal",
        )
        centres.append(x + w / 2)
        x += w
        if k < len(nodes) - 1:
            ax.annotate("", (x + 1.65, y), (x + 0.05, y), arrowprops=dict(arrowstyle="->"))
            ax.text(
                x + 0.85, y + 0.1, out.replace(" ", "\n"), ha="center", va="bottom", fontsize=7.5
            )
            x += 1.7
    return centres


def block_figure():
    """One block on one of t ranks, a matplotlib Figure (tools/figures.py saves it for the notes):
    every activation's shape, each linear's split as TP_PLAN says, f and g where it puts them."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    attn = [("whole", "x\nthe same on\nevery TP rank", "(B,T,C)"), ("whole", "ln_1", "(B,T,C)")]
    attn += _sublayer(
        "attn.c_attn",
        "causal attention\nnh/t heads of hs\nno communication",
        "attn.c_proj",
        ("C", "3C", "C", "C"),
    )
    mlp = [("whole", "h = x + attn(x)", "(B,T,C)"), ("whole", "ln_2", "(B,T,C)")]
    mlp += _sublayer(
        "mlp.c_fc", "GELU\nelement-wise\non my columns", "mlp.c_proj", ("C", "4C", "4C", "C")
    )
    fig = Figure(figsize=(14, 4.5))
    ax = fig.subplots()
    ends = []
    for y, nodes in ((4.2, attn), (1.6, mlp)):
        xs = _chain(ax, y, nodes)
        ends.append(xs[-1])
        # the residual: up from the sublayer's input, over it, down into the +
        x0 = xs[0] + 0.5  # beside where the input arrives from above
        ax.plot([x0, x0, xs[-1]], [y + 0.6, y + 1.0, y + 1.0], color="gray", ls="--")
        ax.annotate(
            "",
            (xs[-1], y + 0.3),
            (xs[-1], y + 1.0),
            arrowprops=dict(arrowstyle="->", color="gray", ls="--"),
        )
        ax.text(
            (xs[0] + xs[-1]) / 2,
            y + 1.05,
            "residual (B,T,C)",
            ha="center",
            va="bottom",
            fontsize=7.5,
            color="gray",
        )
    # the attention sublayer's sum feeds the MLP sublayer
    ax.plot([ends[0], ends[0], xs[0]], [3.9, 2.95, 2.95], color="black", lw=1)
    ax.annotate("", (xs[0], 2.2), (xs[0], 2.95), arrowprops=dict(arrowstyle="->"))
    ax.set(xlim=(0, 24.8), ylim=(-0.7, 5.4), aspect="equal")
    ax.axis("off")
    handles = [
        Patch(fc=TP_COLORS["whole"], ec="black", label="whole on every TP rank"),
        Patch(
            fc=TP_COLORS["column"],
            ec="black",
            label="column parallel: output features split, no communication",
        ),
        Patch(
            fc=TP_COLORS["row"],
            ec="black",
            label="row parallel: input features split, outputs partial sums",
        ),
        Patch(fc=TP_COLORS["f"], label="f: forward identity, backward all-reduce dL/dx"),
        Patch(fc=TP_COLORS["g"], label="g: forward all-reduce, backward identity"),
    ]
    ax.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    ax.set_title(
        "One GPT block on one of t tensor-parallel ranks (dtl.tp_plan.TP_PLAN): shapes one "
        "rank holds; per block 2 all-reduces of B·T·C forward (g), 2 backward (f)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


@dataclass
class Config:
    tp: int = 2  # tensor-parallel size to draw
    n_embd: int = 16  # a small width, so single heads stay visible
    n_head: int = 4  # heads (must divide by tp)
    out_dir: str = "outputs/day19_tp"  # layout.png goes here

    def validate(self) -> None:
        if self.tp < 1:
            raise dtl_config.ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.n_head % self.tp or self.n_embd % self.n_head:
            raise dtl_config.ConfigError(
                f"n_head {self.n_head} must divide by tp {self.tp} and n_embd {self.n_embd} "
                f"by n_head"
            )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, "layout.png")
    model = GPTConfig(n_layer=1, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=64)
    plot_layout(model, cfg.tp, path)
    print(f"summary: day19 layout t={cfg.tp} drawn from the TP plan -> {path}", flush=True)


if __name__ == "__main__":
    main()
