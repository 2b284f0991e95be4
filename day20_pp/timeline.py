"""Day 20: draw a pipeline timeline (one lane per rank, one box per action), ideal or measured.

The ideal one comes from schedules.simulate (unit costs), the measured one from the runtime's
host timestamps (PipelineRunner's StepRecord): the same drawing code for both, so a reader can
put the schedule's promise beside what the machine did.
"""

from __future__ import annotations

COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}


def draw(ax, spans_per_rank, title: str, t0: float = 0.0, scale: float = 1.0) -> None:
    """spans_per_rank[r] = [(start, end, action), ...]; times shifted by t0, times scale."""
    for r, spans in enumerate(spans_per_rank):
        for start, end, a in spans:
            x, w = (start - t0) * scale, (end - start) * scale
            ax.broken_barh(
                [(x, w)],
                (r - 0.4, 0.8),
                facecolors=COLORS[a.kind],
                edgecolor="white",
                linewidth=0.5,
            )
            label = f"{a.kind}{a.mb}" + (f".{a.chunk}" if a.chunk else "")
            ax.text(x + w / 2, r, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(spans_per_rank)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(spans_per_rank))])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)


def save_pair(ideal, measured, title_ideal: str, title_measured: str, path: str) -> None:
    """Two panels: the ideal schedule (time units) over the measured one (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = len(ideal)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(12, 1.2 + 1.1 * p * 2))
    draw(a1, ideal, title_ideal)
    a1.set_xlabel("time (units: F = 1, B = 2, I = W = 1)")
    t0 = min(s for spans in measured for s, _, _ in spans)
    draw(a2, measured, title_measured, t0=t0, scale=1e3)
    a2.set_xlabel("time (ms, host clock, from the first action of any rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
