"""Day 16 -> day 17: predict each bucket's all-reduce, and how long the step blocks on them, from
the alpha and beta that day 16's bench fitted on this machine; print both beside the measurement.

    t_bucket  = 2(n-1) (alpha + f S_b / (n beta))     day 16's ring closed form (cost_model),
                                                      f = 1 on links, max(2, 2n/C) on C cores
    blocked   = one queue: all-reduce b starts when its gradients are ready or when b-1 ends,
                whichever is later; blocked = how far the last end lies past backward's end

The ready times come from the run (each bucket's launch, relative to the end of backward compute);
only the durations are predicted. The queue is an assumption: gloo may run two all-reduces at
once on its worker threads, but on a CPU they share the same cores, so the bytes still queue.
"""

from __future__ import annotations

import json
import os
import statistics

from day16_nccl import cost_model
from day16_nccl.report import MODEL_FILE

DAY16_FIT = os.path.join("outputs", "day16_nccl", "bench", MODEL_FILE)  # the lesson line's output
DAY16_LINE = "torchrun --standalone --nproc_per_node=4 -m day16_nccl.bench"
MiB = 1024 * 1024


def load_fit(path: str) -> dict | None:
    """Day 16's fit (alpha_s, beta_bytes_per_s, n, cores), or None if that run was not made."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def predict_s(fit: dict, nbytes: int, n: int) -> float:
    """Day 16's model of one all-reduce of `nbytes` on n ranks, in the view it was fitted in."""
    return cost_model.ring_time(fit["alpha_s"], fit["beta_bytes_per_s"], nbytes, n, fit["cores"])


def all_reduces(model) -> list[tuple[int, float, float]] | None:
    """The last synced backward's all-reduces, in launch order: (bytes, launch time relative to
    the end of backward compute (negative: launched during backward), duration). Hand-written
    syncs record them (ddp_manual.CommStats); torch DDP does not expose them per bucket: None."""
    stats = getattr(model, "stats", None)
    if stats is None or not stats.events:
        return None
    return [(nb, t0 - stats.compute_end, t1 - t0) for t0, t1, nb, _ in sorted(stats.events)]


def queue_blocked_s(ready: list[float], durations: list[float]) -> float:
    """All-reduces in one queue, in order: each starts at max(its ready time, the previous end).
    Times relative to the end of backward compute; returns how long the thread then waits."""
    end = float("-inf")
    for r, d in zip(ready, durations):
        end = max(r, end) + d
    return max(0.0, end) if durations else 0.0


def report_lines(fit: dict, path: str, n: int, steps: list, blocked_ms: float) -> list[str]:
    """steps: all_reduces() of every timed step. Per bucket (or, for one per tensor, in total):
    predicted beside the median measured; then blocked, predicted and measured."""
    view = "links" if fit["cores"] is None else f"{fit['cores']}-core"
    head = (
        f"alpha-beta bridge from day 16's fit ({path}: alpha {fit['alpha_s'] * 1e6:.0f} us, "
        f"beta {fit['beta_bytes_per_s'] / 1e9:.2f} GB/s, {view} view, fitted on {fit['n']} ranks)"
    )
    first = steps[0]
    sizes = [nb for nb, _, _ in first]
    if any([nb for nb, _, _ in s] != sizes for s in steps):
        return [head, "  the all-reduces differ between timed steps: no per-bucket medians"]
    measured = [statistics.median(s[i][2] for s in steps) for i in range(len(sizes))]
    # ready = launch time, but a blocking sync (naive) launches only after the previous one
    # ended: all its gradients were ready when backward ended (time 0)
    ready = [min(0.0, statistics.median(s[i][1] for s in steps)) for i in range(len(sizes))]
    predicted = [predict_s(fit, nb, n) for nb in sizes]
    lines = [head]
    if len(sizes) <= 12:
        for b, (nb, p, m) in enumerate(zip(sizes, predicted, measured)):
            lines.append(
                f"  bucket {b:>2} {nb / MiB:>8.3f} MiB: all-reduce predicted {p * 1e3:6.1f} ms, "
                f"measured {m * 1e3:6.1f} ms (median of {len(steps)} steps)"
            )
    else:
        big = max(range(len(sizes)), key=lambda i: sizes[i])
        lines.append(
            f"  {len(sizes)} all-reduces (one per tensor): predicted {sum(predicted) * 1e3:.1f} ms "
            f"in all ({len(sizes)} x 2(n-1) rounds of alpha = "
            f"{len(sizes) * 2 * (n - 1) * fit['alpha_s'] * 1e3:.1f} ms of it latency), measured "
            f"{sum(measured) * 1e3:.1f} ms; the largest ({sizes[big] / MiB:.2f} MiB) predicted "
            f"{predicted[big] * 1e3:.1f} ms, measured {measured[big] * 1e3:.1f} ms"
        )
    lines.append(
        f"  blocked after backward: predicted {queue_blocked_s(ready, predicted) * 1e3:.0f} ms "
        f"(the measured ready times, predicted durations, one queue), measured {blocked_ms:.0f} ms"
    )
    return lines


def missing_line(path: str) -> str:
    return (
        f"alpha-beta bridge: no day-16 fit at {path}; run `{DAY16_LINE}` first to print each "
        "bucket's predicted all-reduce time beside the measured one"
    )
