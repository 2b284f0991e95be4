"""Day 27: a pipeline step's idle read from its trace by day 20's own rule.

Day 20's runtime times each action from the moment its input is there (after its receive) to
the moment its work is done, and calls the rest of the step idle: 1 - sum(spans) / step. The
trace holds the same step as named ranges: `schedule` around the runner's step, one range per
action (`F3`, `B3`, `I3`, `W3`, `F3.1`), and `recv F3` inside an action for its wait. So

    idle (trace) = 1 - sum(action ranges - their receive ranges) / the schedule range

is the run's figure measured on the trace's clock, over the same step: the two agree to the
profiler's overhead, and a trace that lost or misplaced a range does not.
"""

from __future__ import annotations

import re

from day20_pp.pipeline import SCHEDULE_RANGE
from dtl.profile import Span, parse_trace

ACTION = re.compile(r"^[FBIW]\d+(\.\d+)?$")  # the runtime's names for its actions


class TraceError(ValueError):
    """A trace without the ranges this reading needs; a one-line message."""


def schedule_idle(path: str) -> float:
    """The idle share of the traced pipeline step in the trace at `path` (day 20's rule)."""
    spans = parse_trace(path)
    steps = [s for s in spans if s.name == SCHEDULE_RANGE]
    if len(steps) != 1:
        raise TraceError(f"{path}: {len(steps)} '{SCHEDULE_RANGE}' ranges, expected one step")
    (step,) = steps
    mine = [s for s in spans if s.tid == step.tid and step.start_ms <= s.start_ms <= step.end_ms]
    actions = [s for s in mine if ACTION.match(s.name)]
    if not actions:
        raise TraceError(f"{path}: no action ranges (F0, B0, ...) inside the traced step")
    busy = sum(_busy(a, mine) for a in actions)
    return 1 - busy / (step.end_ms - step.start_ms)


def _busy(action: Span, spans: list[Span]) -> float:
    """The action's range less its receive's: the work, not the wait for the neighbour."""
    waits = [
        s
        for s in spans
        if s.name == f"recv {action.name}" and action.start_ms <= s.start_ms <= action.end_ms
    ]
    return (action.end_ms - action.start_ms) - sum(w.end_ms - w.start_ms for w in waits)
