"""Day 19: draw who owns which weight elements under tensor parallelism, from the TP plan itself.

Each weight of one block is replaced by a tensor of its element indices, cut with the same
`dtl.model.shard_tensor` that apply_tp uses, and every element is coloured by the rank that
receives it: the picture cannot disagree with the code.

    python -m day19_tp.layout --tp=2        # writes outputs/day19_tp/layout.png
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dtl import config as dtl_config
from dtl.model import GPT, GPTConfig, shard_tensor, tp_shard_of

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
