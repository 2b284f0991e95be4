"""The notes' figures, drawn from the course's own code: each PNG a README embeds is one function
here, and tests/test_figures.py redraws every one and compares it with the committed file.

    python tools/figures.py                     # redraw them all in the day folders (make figures)
    python tools/figures.py --only schedules    # one of them (the names: FIGURES)
    python tools/figures.py --out /tmp/figs     # somewhere else, under the same relative paths

One process, no process group, a few seconds. Where the code holds the data the figure plots it:
day 18's curves are formulas.model_state_bytes, day 20's timelines are schedules.simulate playing
the action lists, day 21's chunks come from dtl.data.cp_chunks and ring_attention.ring_pairs,
day 22's ranks from dtl.grid.ParallelGrid and its dispatch from a real routing, day 28's chart
is compare.figure. Day 19's block is a schematic (day19_tp.layout.block_figure), each linear's
split, so where f and g sit, from TP_PLAN.
"""

from __future__ import annotations

import argparse
import io
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import matplotlib
from matplotlib import ft2font
from matplotlib.figure import Figure
from matplotlib.patches import Circle, Patch, Rectangle
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from day18_zero import formulas as zero
from day19_tp import layout
from day20_pp import schedules, timeline
from day21_sp_cp.ring_attention import attention_work, imbalance, ring_pairs
from day22_megatron import placement, planner
from day22_megatron.dispatch_figure import dispatch_figure
from day28_gpt125m import compare
from dtl.data import cp_chunks
from dtl.grid import ParallelGrid
from dtl.model import num_params
from dtl.precision import PRECISIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DPI = 100
RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


# --- day 18: model-state memory per rank against N ----------------------------------------------


def zero_memory() -> Figure:
    """GB per rank for stages 0-3 at the paper's example (Ψ = 7.5 B, mixed precision: 2 + 2 + 12
    bytes per parameter), N = 1 ... 1024; the paper's N = 64 marked with its values."""
    psi, prec, ns = zero.PAPER_PSI, PRECISIONS["bf16"], [2**i for i in range(11)]
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    for stage, color in zip(zero.STAGES_ALL, RANK_COLORS):
        whole = zero.model_state_bytes(1, math.inf, stage, prec).total  # bytes/param never cut
        cut = zero.model_state_bytes(1, 1, stage, prec).total - whole  # bytes/param over N
        terms = [f"{whole:g}Ψ"] * bool(whole) + [f"{cut:g}Ψ/N"] * bool(cut)
        gb = [zero.model_state_bytes(psi, n, stage, prec).total / 1e9 for n in ns]
        ax.plot(ns, gb, "-", marker=".", color=color, label=f"stage {stage}: {' + '.join(terms)}")
        at = zero.model_state_bytes(psi, zero.PAPER_N, stage, prec).total / 1e9
        ax.plot(zero.PAPER_N, at, "o", color=color)
        ax.annotate(
            f"{at:.1f} GB",
            (zero.PAPER_N, at),
            xytext=(6, 4),
            textcoords="offset points",
            fontsize=8,
            color=color,
        )
    ax.axvline(zero.PAPER_N, color="gray", ls=":", lw=1)
    ax.axhline(80, color="red", ls="--", lw=1, label="80 GB: one H100's memory")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="data-parallel ranks N",
        ylabel="model states per rank (GB, 10⁹ B)",
    )
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_title(
        f"ZeRO stages, Ψ = {psi / 1e9:g} B parameters, {prec.param} + {prec.grad} + "
        f"{prec.optim} bytes each (the paper's figure 1: N = {zero.PAPER_N})",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


# --- day 20: the schedules' timelines ------------------------------------------------------


def pp_schedules(p: int = 4, m: int = 8, v: int = 2) -> Figure:
    """Every schedule of schedules.SCHEDULES at p stages and m micro-batches, its action lists
    played by schedules.simulate (F = 1, B = 2, I = W = 1; an interleaved chunk's actions cost
    1/v of a stage's, so every panel shares one time axis)."""
    names = schedules.every_schedule(v)
    fig = Figure(figsize=(12.5, 2 * len(names) + 0.25))
    axes = fig.subplots(len(names), 1, sharex=True)
    for ax, (name, v_asked) in zip(axes, names):
        plan = schedules.make(name, p, m, v_asked)
        chunks = plan.placement.v  # stages per rank: the interleaved v, DualPipe-V's two
        costs = {kind: cost / chunks for kind, cost in schedules.COSTS.items()}
        tl = schedules.simulate(plan, costs=costs)
        formula = schedules.bubble_formula(name, p, m, v_asked)
        title = (
            f"{name}{f' (v = {chunks} chunks per rank)' if chunks > 1 else ''}: makespan "
            f"{tl.makespan:g}, bubble {tl.bubble:.3f} (formula {formula:.3f}), "
            f"{'(micro-batch, chunk) pairs' if chunks > 1 else 'micro-batches'} in flight per "
            f"rank {tl.peak_in_flight()}"
        )
        timeline.draw(ax, tl.spans, title)
        ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(fc=c, label=k) for k, c in timeline.COLORS.items()]
    axes[0].legend(handles=handles, ncol=4, fontsize=7, loc="upper left", bbox_to_anchor=(0.3, 1))
    axes[-1].set_xlabel(
        f"time, p = {p} ranks, m = {m} micro-batches (unit: one stage's forward; "
        "B = 2, I = W = 1; label: action, micro-batch[.chunk])"
    )
    fig.tight_layout()
    return fig


# --- day 21: the ring, and the causal chunks contiguous and zig-zag -----------------------------


def cp_ring(cp: int = 4) -> Figure:
    """Ranks on a ring passing K/V to the next one; per step, the block each rank holds and what
    its queries compute against it (ring_pairs, contiguous chunks, causal)."""
    fig = Figure(figsize=(12, 4.5))
    ring, table = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.9]})
    at = [(math.sin(2 * math.pi * r / cp), math.cos(2 * math.pi * r / cp)) for r in range(cp)]
    for r, (x, y) in enumerate(at):
        ring.add_patch(Circle((x, y), 0.24, fc=RANK_COLORS[r], ec="black"))
        ring.text(x, y, f"rank {r}\nQ{r}", ha="center", va="center", fontsize=8, color="white")
        nx, ny = at[(r + 1) % cp]
        ring.annotate(
            "",
            (nx * 0.8 + x * 0.2, ny * 0.8 + y * 0.2),
            (x * 0.8 + nx * 0.2, y * 0.8 + ny * 0.2),
            arrowprops=dict(arrowstyle="->", lw=1.5, connectionstyle="arc3,rad=-0.25"),
        )
    ring.text(
        0,
        0,
        "K, V (forward)\nK, V, dK, dV\n(backward)\nto rank r + 1",
        ha="center",
        va="center",
        fontsize=8,
    )
    ring.set(xlim=(-1.45, 1.45), ylim=(-1.45, 1.45), aspect="equal")
    ring.axis("off")
    for r in range(cp):
        for step, (src, pairs) in enumerate(ring_pairs(r, cp, "contiguous", causal=True)):
            kinds = ", ".join(kind for *_, kind in pairs) or "skipped"
            table.add_patch(
                Rectangle(
                    (step, r),
                    1,
                    1,
                    fc=RANK_COLORS[src],
                    alpha=1.0 if pairs else 0.25,
                    ec="white",
                    lw=2,
                )
            )
            table.text(
                step + 0.5,
                r + 0.5,
                f"K{src} V{src}\n{kinds}",
                ha="center",
                va="center",
                fontsize=8,
                color="white" if pairs else "black",
            )
    table.set(
        xlim=(0, cp),
        ylim=(cp, 0),
        xticks=[s + 0.5 for s in range(cp)],
        yticks=[r + 0.5 for r in range(cp)],
    )
    table.set_xticklabels([f"step {s}" for s in range(cp)])
    table.set_yticklabels([f"rank {r} (Q{r})" for r in range(cp)])
    table.tick_params(length=0)
    table.set_title(
        "the K/V block each rank holds per step (colour: its owner) and what its "
        "queries do with it",
        fontsize=9,
    )
    fig.suptitle(
        f"Ring attention, cp = {cp}, contiguous causal chunks: block r − s at step s; "
        "the next block is in flight while this one computes",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def cp_chunks_figure(cp: int = 4) -> Figure:
    """The causal (query, key) chunk grid with each query chunk coloured by the rank holding it
    (dtl.data.cp_chunks): full, diagonal (masked inside) or skipped; contiguous vs zig-zag."""
    fig = Figure(figsize=(12, 5.5))
    for ax, split in zip(fig.subplots(1, 2), ("contiguous", "zigzag")):
        owner = {i: r for r in range(cp) for i in cp_chunks(r, cp, split)}
        n, work = len(owner), attention_work(cp, split)
        for i in range(n):
            for j in range(i + 1):
                ax.add_patch(
                    Rectangle(
                        (j, i),
                        1,
                        1,
                        fc=RANK_COLORS[owner[i]],
                        ec="white",
                        hatch="//" if i == j else None,
                    )
                )
        ax.set(
            xlim=(0, n),
            ylim=(n, 0),
            aspect="equal",
            xticks=[j + 0.5 for j in range(n)],
            yticks=[i + 0.5 for i in range(n)],
        )
        ax.set_xticklabels([f"k{j}" for j in range(n)])
        ax.set_yticklabels([f"q{i} · rank {owner[i]}" for i in range(n)], fontsize=8)
        ax.set_xlabel("key chunk (white: masked, skipped; hatched: diagonal, masked inside)")
        blocks = [w["blocks"] for w in work]
        ax.set_title(
            f"{split}: {n} chunks of T/{n}; blocks per rank {blocks}, slowest / mean "
            f"{imbalance(blocks):.2f}",
            fontsize=9,
        )
    handles = [Patch(fc=RANK_COLORS[r], label=f"rank {r}") for r in range(cp)]
    fig.legend(handles=handles, loc="lower center", ncol=cp, fontsize=8, frameon=False)
    fig.suptitle(
        f"Causal attention over cp = {cp} ranks: the query chunks each rank holds "
        "(dtl.data.cp_chunks)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


# --- day 22: the 4-D grid's rank layout ---------------------------------------------------------


def grid_layout(tp: int = 2, cp: int = 2, dp: int = 2, pp: int = 2) -> Figure:
    """Every rank of ParallelGrid(tp, cp, dp, pp) in nested boxes: pp stages side by side, dp
    rows in each, cp boxes in a row, tp cells in a cp box; the groups of each axis listed."""
    grid = ParallelGrid(tp=tp, cp=cp, dp=dp, pp=pp, world_size=tp * cp * dp * pp, rank=0)
    fig = Figure(figsize=(12, 4.5))
    ax = fig.subplots()
    stage_w = cp * (tp + 0.4) + 0.6
    for p in range(pp):
        x0 = p * (stage_w + 0.5)
        ax.add_patch(Rectangle((x0, 0), stage_w, dp * 1.6 + 0.5, fc="#F4F4F4", ec="black"))
        ax.text(
            x0 + stage_w / 2,
            dp * 1.6 + 0.25,
            f"pp = {p}: pipeline stage {p}",
            ha="center",
            va="center",
            fontsize=9,
        )
        for d in range(dp):
            y0 = (dp - 1 - d) * 1.6 + 0.15
            ax.text(
                x0 + 0.3, y0 + 0.65, f"dp {d}", rotation=90, ha="center", va="center", fontsize=8
            )
            for c in range(cp):
                cx = x0 + 0.6 + c * (tp + 0.4)
                ax.add_patch(
                    Rectangle((cx - 0.1, y0), tp + 0.2, 1.3, fc="white", ec="gray", ls="--")
                )
                ax.text(cx + tp / 2, y0 + 1.17, f"cp {c}", ha="center", fontsize=7, color="gray")
                for t in range(tp):
                    rank = int(grid.ranks[p, d, c, t])
                    ax.add_patch(
                        Rectangle((cx + t, y0 + 0.1), 0.95, 0.9, fc=RANK_COLORS[t], ec="black")
                    )
                    ax.text(
                        cx + t + 0.475,
                        y0 + 0.55,
                        f"{rank}\ntp {t}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white",
                    )
    groups = [
        f"{' x '.join(key)} groups: " + "  ".join(str(g) for g in grid.group_ranks(*key))
        for key in grid.combos
    ]
    ax.text(0, -0.3, "\n".join(groups), va="top", fontsize=8, family="monospace")
    ax.set(xlim=(-0.2, pp * (stage_w + 0.5)), ylim=(-0.4 - 0.17 * len(groups), dp * 1.6 + 0.6))
    ax.axis("off")
    ax.set_title(
        f"ParallelGrid(tp={tp}, cp={cp}, dp={dp}, pp={pp}): the rank at (pp p, dp d, cp c, tp t)"
        f" is ((p·{dp} + d)·{cp} + c)·{tp} + t: TP innermost (neighbouring ranks), PP outermost",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


# --- day 22: where the model state lives, per composition ------------------------------------


def state_placement(model: str = "gpt2-124m", world: int = 8) -> Figure:
    """MB of weights, gradients and Adam moments one rank holds in fp32 (4 + 4 + 8 bytes per
    element it holds), for six ways of spreading `model` over `world` ranks: day 22's
    placement.py, the rows its table prints."""
    cfg = planner.MODELS[model]
    psi = num_params(cfg)
    rows = [(p.label, p.weights, p.gradients, p.moments) for p in placement.placements(cfg, world)]
    fig = Figure(figsize=(10, 4.2))
    ax = fig.subplots()
    kinds = (("weights", 4), ("gradients", 4), ("Adam m, v", 8))
    for i, (_, *elements) in enumerate(rows):
        left = 0.0
        for (kind, width), n, color in zip(kinds, elements, RANK_COLORS):
            mb = width * n / 1e6
            ax.barh(i, mb, left=left, color=color, label=kind if i == 0 else None)
            left += mb
        ax.text(left + 20, i, f"{left:,.0f} MB", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 16 * psi / 1e6 * 1.15)
    ax.set_xlabel("MB of model state per rank (fp32)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{model} on {world} ranks: what one rank holds, by composition", fontsize=10)
    fig.tight_layout()
    return fig


# --- day 28: ZeRO-3 or TP + PP, the chart compare.py draws ---------------------------------------


def trade_off() -> Figure:
    """compare.py's chart at its defaults (the notes' table): no run, no process group."""
    fig = compare.figure(compare.Config())
    fig.set_size_inches(12, 6.75)  # a little smaller than the run's PNG: the notes' page
    fig.tight_layout()
    return fig


class Drawing(NamedTuple):
    path: str  # relative to the repository root: where the notes embed it
    draw: Callable[[], Figure]


FIGURES = {
    "zero_memory": Drawing("day18_zero/figures/zero_memory.png", zero_memory),
    "tp_block": Drawing("day19_tp/figures/tp_block.png", layout.block_figure),
    "schedules": Drawing("day20_pp/figures/schedules.png", pp_schedules),
    "ring": Drawing("day21_sp_cp/figures/ring.png", cp_ring),
    "zigzag": Drawing("day21_sp_cp/figures/zigzag.png", cp_chunks_figure),
    "grid": Drawing("day22_megatron/figures/grid.png", grid_layout),
    "ep_dispatch": Drawing("day22_megatron/figures/ep_dispatch.png", dispatch_figure),
    "state_placement": Drawing("day22_megatron/figures/state_placement.png", state_placement),
    "trade_off": Drawing("day28_gpt125m/figures/trade_off.png", trade_off),
}


def renderer() -> str:
    """What decides the pixels besides the code: matplotlib and the FreeType it draws text with
    (3.11 moved from FreeType 2.6.1 to 2.14: every glyph's edge differs)."""
    return f"matplotlib {matplotlib.__version__}, FreeType {ft2font.__freetype_version__}"


def write(name: str, root: str = ROOT) -> str:
    """Draw figure `name` into root/<its path>; returns the file written. Opaque RGB (the alpha
    channel of matplotlib's RGBA is all 255 here, a third of the bytes); the only metadata is
    the renderer, which the test reads to know whether pixels can be compared."""
    path = os.path.join(root, FIGURES[name].path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buffer = io.BytesIO()
    FIGURES[name].draw().savefig(buffer, format="png", dpi=DPI)
    info = PngInfo()
    info.add_text("Software", f"tools/figures.py; {renderer()}")
    Image.open(buffer).convert("RGB").save(path, optimize=True, pnginfo=info)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        choices=sorted(FIGURES),
        action="append",
        help="draw only this figure (repeatable)",
    )
    parser.add_argument("--out", default=ROOT, help="root folder (default: the repository)")
    args = parser.parse_args(argv)
    for name in args.only or FIGURES:
        path = write(name, args.out)
        print(f"{name}: {os.path.relpath(path)} ({os.path.getsize(path) / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
