"""Day 20: pipeline schedules as pure functions: per rank, the ordered list of actions.

An action is (kind, micro-batch, chunk): kind F (forward), B (backward: input and weight
gradients together), I (backward for the input gradient only) or W (the weight gradient only).
`chunk` is the model chunk (interleaved schedules hold v chunks per rank); which stage a chunk is,
and which rank holds a stage, is the schedule's Placement (Megatron's loop: stage = chunk·p + rank).

    gpipe(p, m)          all m forwards, then all m backwards: m micro-batches in flight
    one_f_one_b(p, m)    p - r - 1 warm-up forwards, then one forward / one backward, then the
                         remaining backwards: at most p - r in flight on rank r
    interleaved(p, m, v) Megatron's interleaved 1F1B over v chunks per rank: bubble / v
    zero_bubble(p, m)    ZB-H1 (Qi et al. 2023): B split into I and W; the W's, which nothing
                         downstream waits for, fill the slots where 1F1B waits
    dualpipe_v(p, m)     DeepSeek's DualPipe-V (dualpipe.py): two chunks per rank on a V, the
                         first and last stage on rank 0; a forward of one chunk beside a
                         backward of the other, W's deferred as in ZB

Nothing here runs a model: `simulate` plays the lists with per-action costs and the pipeline's
dependencies, giving the timeline, the idle (bubble) fraction and, if the lists are wrong, the
deadlock. p2p.py plays the sends and receives the runtime posts for them the way NCCL runs
them, so a hang on GPUs shows there; placement.py says which rank holds which stage. The
runtime (pipeline.py) executes the same lists on real stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from day20_pp.dualpipe import dualpipe_v
from day20_pp.placement import Action, Placement, Schedule, ScheduleError, placement_of
from dtl.exercise_seam import exercise


def _check(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ScheduleError(f"need p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}")


def gpipe(p: int, m: int) -> Schedule:
    _check(p, m)
    acts = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return Schedule([list(acts) for _ in range(p)], Placement.loop(p))


@exercise("day20.one_f_one_b")
def one_f_one_b(p: int, m: int) -> Schedule:
    """Megatron's 1F1B, rank r's list: forwards until the first backward can come back, then one
    forward / one backward (the oldest), then the rest: at most min(p - r, m) in flight."""
    _check(p, m)
    out = []
    for r in range(p):
        # exercise day20.one_f_one_b: begin
        warmup = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: the forward of i + warmup, the backward of i
            acts += [Action("F", warmup + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warmup, m)]
        # exercise day20.one_f_one_b: end
        out.append(acts)
    return Schedule(out, Placement.loop(p))


@exercise("day20.interleaved")
def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B (schedules.py, forward_backward_pipelining_with_interleaving):
    virtual micro-batch k runs chunk (k // p) % v on micro-batch (k // (p·v))·p + k % p;
    backwards walk the chunks in reverse. Needs m to be a multiple of p."""
    _check(p, m)
    if v < 1:
        raise ScheduleError(f"interleaved needs v >= 1 model chunks per rank, got {v}")
    if m % p:
        raise ScheduleError(f"interleaved needs micro-batches m={m} to be a multiple of p={p}")
    total = m * v  # virtual micro-batches: (micro-batch, chunk) pairs

    # exercise day20.interleaved: begin
    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

    out = []
    for r in range(p):
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [Action("F", *unit(k, True)) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [Action("F", *unit(warmup + k, True)), Action("B", *unit(k, False))]
        acts += [Action("B", *unit(k, False)) for k in range(total - warmup, total)]
        out.append(acts)
    # exercise day20.interleaved: end
    return Schedule(out, Placement.loop(p, v))


def zero_bubble(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241): split B into I (the input gradient, which the
    previous stage waits for) and W (the weight gradient, which nobody waits for). Each rank
    keeps 1F1B's order of F and I; a W runs when the next F or I cannot start yet (its input
    has not arrived), when a forward would make more than p micro-batches hold activations
    (the H1 memory bound: 1F1B's peak, reached on its first stage; a W releases one), or at
    the end. Played with unit costs F = I = W = 1, so the W's land exactly in the slots where
    1F1B waits: the bubble drops from 3(p-1) to (p-1) units."""
    _check(p, m)
    order = [
        [Action("I", a.mb) if a.kind == "B" else a for a in acts] for acts in one_f_one_b(p, m)
    ]
    done: dict[tuple[str, int, int], int] = {}  # (kind, rank, mb) -> end time
    out = Schedule([[] for _ in range(p)], Placement.loop(p))
    pos, pending, free, alive = [0] * p, [[] for _ in range(p)], [0] * p, [0] * p
    t = 0
    while any(pos[r] < len(order[r]) or pending[r] for r in range(p)):
        for r in range(p):
            if free[r] > t:
                continue
            nxt = order[r][pos[r]] if pos[r] < len(order[r]) else None
            full = nxt is not None and nxt.kind == "F" and alive[r] >= p  # H1: 1F1B's peak, p
            if nxt is not None and not (full and pending[r]) and _zb_ready(nxt, r, p, t, done):
                pos[r] += 1
                if nxt.kind == "I":
                    pending[r].append(Action("W", nxt.mb))
            elif pending[r]:
                nxt = pending[r].pop(0)  # nothing else can run now: a W fills the wait
            else:
                continue
            out[r].append(nxt)
            done[(nxt.kind, r, nxt.mb)] = t + 1
            free[r] = t + 1
            alive[r] += {"F": 1, "W": -1}.get(nxt.kind, 0)
        t += 1
    return out


def _zb_ready(a: Action, r: int, p: int, t: int, done) -> bool:
    def by(key):
        return done.get(key, t + 1) <= t

    if a.kind == "F":
        return r == 0 or by(("F", r - 1, a.mb))
    return by(("F", r, a.mb)) and (r == p - 1 or by(("I", r + 1, a.mb)))


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule the course knows: its builder, its textbook bubble, whether its builder takes
    v (the chunks per rank it interleaves). How many chunks a rank holds, and which stages they
    are, is the built schedule's placement, not this entry. A new schedule is one entry here (and
    its builder); the tests run each."""

    build: Callable[..., Schedule]  # (p, m), or (p, m, v) when takes_v
    bubble: Callable[[int, int, int], float]  # (p, m, v) -> idle fraction
    takes_v: bool = False
    fewest_microbatches: Callable[[int], int] = lambda p: 1  # p -> the smallest m it takes


# The textbook idle fractions: (p-1)/(m+p-1) for GPipe and 1F1B ((p-1)(tF+tB) idle per rank over
# a makespan of (m+p-1)(tF+tB)); (p-1)/(v·m+p-1) interleaved; for ZB-H1, whose idle is
# (p-1)(tF+tI-tW) (Qi et al., section 3), (p-1)/(3m+p-1) with tF = tI = tW. DualPipe-V: each
# rank works 2 chunks x m x (tF + tB) = 6m units and, with tF = tI = tW, idles (p-1)·tF (the
# simulator's count at every p and m >= 2p the tests take: (p-1)/(6m+p-1), at this unit a chunk's
# forward; the fraction does not depend on the unit).
SCHEDULES = {
    "gpipe": ScheduleKind(gpipe, lambda p, m, v: (p - 1) / (m + p - 1)),
    "1f1b": ScheduleKind(one_f_one_b, lambda p, m, v: (p - 1) / (m + p - 1)),
    "interleaved": ScheduleKind(interleaved, lambda p, m, v: (p - 1) / (v * m + p - 1), True),
    "zb": ScheduleKind(zero_bubble, lambda p, m, v: (p - 1) / (3 * m + p - 1)),
    "dualpipev": ScheduleKind(
        dualpipe_v, lambda p, m, v: (p - 1) / (6 * m + p - 1), fewest_microbatches=lambda p: 2 * p
    ),
}


def every_schedule(chunks: int = 2) -> list[tuple[str, int]]:
    """(name, v) for every schedule: `chunks` model chunks per rank where it takes them. What the
    bench compares and the tests run: a new entry in SCHEDULES is benched and tested with it."""
    return [(name, chunks if kind.takes_v else 1) for name, kind in SCHEDULES.items()]


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule '{name}'; choose one of {', '.join(SCHEDULES)}")
    kind = SCHEDULES[name]
    if kind.takes_v:
        return kind.build(p, m, v)
    if v != 1:
        raise ScheduleError(f"--chunks {v} is for the interleaved schedule only")
    return kind.build(p, m)


# --- playing the lists: dependencies, timeline, bubble ------------------------------------------


@dataclass
class Timeline:
    """Per rank, (start, end, action) in time units; the idle fraction over the makespan."""

    spans: list[list[tuple[float, float, Action]]]
    makespan: float

    @property
    def bubble(self) -> float:
        busy = sum(e - s for rank in self.spans for s, e, _ in rank)
        return 1 - busy / (self.makespan * len(self.spans))

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most micro-batches (x chunks) forwarded whose weight gradient is not
        done yet: the activations a rank must hold."""
        peaks = []
        for rank in self.spans:
            alive = peak = 0
            for _, _, a in rank:
                alive += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
                peak = max(peak, alive)
            peaks.append(peak)
        return peaks


class Deadlock(RuntimeError):
    """No rank can run its next action: the lists wait on each other."""


COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # a backward costs about twice a forward


def simulate(schedule: Schedule, v: int = 1, costs: dict[str, float] | None = None) -> Timeline:
    """Run every rank's list in order; an action starts when its rank is free and its inputs
    exist: F of stage s needs F of stage s - 1 (same micro-batch) done; B or I of stage s needs
    B or I of stage s + 1 done (and its own F); W needs its own I. Stages: the placement's."""
    costs = costs or COSTS
    place = placement_of(schedule, v)
    p, n_stages = len(schedule), place.n_stages
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> end time
    pos, free = [0] * p, [0.0] * p
    spans: list[list] = [[] for _ in range(p)]
    remaining = sum(len(s) for s in schedule)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                stage = place.stage(r, a.chunk)
                ready = _ready_time(a, stage, n_stages, done)
                if ready is None:
                    break
                start = max(free[r], ready)
                end = start + costs[a.kind]
                kind = "I" if a.kind == "B" else a.kind  # a B satisfies what an I would
                done[(kind, stage, a.mb)] = end
                if a.kind == "B":
                    done[("W", stage, a.mb)] = end
                spans[r].append((start, end, a))
                free[r], pos[r] = end, pos[r] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule[r][pos[r]]) for r in range(p) if pos[r] < len(schedule[r])}
            raise Deadlock(f"no rank can proceed; next actions {stuck}")
    return Timeline(spans, max(free))


def _ready_time(a: Action, stage: int, n_stages: int, done) -> float | None:
    if a.kind == "F":
        need = [("F", stage - 1, a.mb)] if stage > 0 else []
    elif a.kind in ("B", "I"):
        need = [("F", stage, a.mb)] + ([("I", stage + 1, a.mb)] if stage < n_stages - 1 else [])
    else:  # W
        need = [("I", stage, a.mb)]
    times = [done.get(k) for k in need]
    return None if any(t is None for t in times) else max(times, default=0.0)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook idle fraction of schedule `name` (SCHEDULES: each kind's own formula)."""
    return SCHEDULES[name].bubble(p, m, v)


def ascii_timeline(tl: Timeline, unit: float = 1.0) -> str:
    """One row per rank, one 3-character cell per time unit: the action's kind and micro-batch
    (`F3`, `B0`, `I2`, `W1`; not the chunk), repeated over its duration; ' . ' marks idle."""
    width = int(round(tl.makespan / unit))
    rows = []
    for r, spans in enumerate(tl.spans):
        cells = [" . "] * width
        for s, e, a in spans:
            label = f"{a.kind}{a.mb}"[:3].ljust(3)
            for c in range(int(round(s / unit)), int(round(e / unit))):
                cells[c] = label
        rows.append(f"rank {r} |" + "".join(cells) + "|")
    return "\n".join(rows)
