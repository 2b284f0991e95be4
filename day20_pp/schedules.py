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

Nothing here runs a model: `simulate` plays the lists with per-action costs and the pipeline's
dependencies, giving the timeline, the idle (bubble) fraction and, if the lists are wrong, the
deadlock. `play_p2p` plays the sends and receives the runtime posts for them the way NCCL runs
them (one stream per rank pair and process group, no buffering), so a hang on GPUs shows here.
The runtime (pipeline.py) executes the same lists on real stages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from dtl.exercise_seam import exercise


class Action(NamedTuple):
    kind: str  # "F", "B", "I" or "W"
    mb: int  # micro-batch
    chunk: int = 0  # model chunk on this rank (interleaved); its stage: Placement.stage

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Placement:
    """Where the p·v pipeline stages live. Megatron's interleaving loops over the ranks: chunk c
    of rank r is stage c·p + r, so rank r holds stages r, r + p, r + 2p, ... Every user of a
    stage number (the simulator, the p2p plan, the runtime, the stage builder) asks the
    placement, never the formula: a V-shaped schedule (DualPipe-V: rank r holds stages r and
    2p - 1 - r) is then one more Placement, not six silent bugs."""

    p: int
    v: int = 1

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int = 0) -> int:
        return chunk * self.p + rank

    def rank(self, stage: int) -> int:
        return stage % self.p

    def chunk(self, stage: int) -> int:
        return stage // self.p


class Schedule(list):
    """Per rank, the ordered list of actions ([rank][step]), carrying the placement of its
    stages (a plain list of lists is read as the loop over len(schedule) ranks)."""

    def __init__(self, ranks=(), placement: Placement | None = None):
        super().__init__(ranks)
        self.placement = placement or Placement(len(self))


def placement_of(schedule, v: int = 1) -> Placement:
    """The schedule's own placement, or the loop over its ranks with v chunks each."""
    return getattr(schedule, "placement", None) or Placement(len(schedule), v)


class ScheduleError(ValueError):
    """Sizes a schedule cannot take; a one-line message."""


def _check(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ScheduleError(f"need p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}")


def gpipe(p: int, m: int) -> Schedule:
    _check(p, m)
    acts = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return Schedule([list(acts) for _ in range(p)], Placement(p))


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
    return Schedule(out, Placement(p))


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
    return Schedule(out, Placement(p, v))


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
    out = Schedule([[] for _ in range(p)], Placement(p))
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
    """A schedule the course knows: its builder, its textbook bubble, whether it takes v model
    chunks per rank. A new schedule is one entry here (and its builder); the tests run each."""

    build: Callable[..., Schedule]  # (p, m), or (p, m, v) when chunks
    bubble: Callable[[int, int, int], float]  # (p, m, v) -> idle fraction
    chunks: bool = False


# The textbook idle fractions: (p-1)/(m+p-1) for GPipe and 1F1B ((p-1)(tF+tB) idle per rank over
# a makespan of (m+p-1)(tF+tB)); (p-1)/(v·m+p-1) interleaved; for ZB-H1, whose idle is
# (p-1)(tF+tI-tW) (Qi et al., section 3), (p-1)/(3m+p-1) with tF = tI = tW.
SCHEDULES = {
    "gpipe": ScheduleKind(gpipe, lambda p, m, v: (p - 1) / (m + p - 1)),
    "1f1b": ScheduleKind(one_f_one_b, lambda p, m, v: (p - 1) / (m + p - 1)),
    "interleaved": ScheduleKind(interleaved, lambda p, m, v: (p - 1) / (v * m + p - 1), True),
    "zb": ScheduleKind(zero_bubble, lambda p, m, v: (p - 1) / (3 * m + p - 1)),
}


def every_schedule(chunks: int = 2) -> list[tuple[str, int]]:
    """(name, v) for every schedule: `chunks` model chunks per rank where it takes them. What the
    bench compares and the tests run: a new entry in SCHEDULES is benched and tested with it."""
    return [(name, chunks if kind.chunks else 1) for name, kind in SCHEDULES.items()]


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule '{name}'; choose one of {', '.join(SCHEDULES)}")
    kind = SCHEDULES[name]
    if kind.chunks:
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


def p2p_posts(schedule: Schedule, v: int = 1) -> list[list[tuple[str, int, tuple]]]:
    """Per rank, its point-to-point operations in the order the runtime (pipeline.py) posts
    them: ("recv", source rank, message) before an action's compute, ("send", destination rank,
    message) after it. A message is (kind, receiving stage, micro-batch), kind "act" or "grad"."""
    place = placement_of(schedule, v)
    n_stages, rank = place.n_stages, place.rank
    out = []
    for r, acts in enumerate(schedule):
        posts = []
        for a in acts:
            stage = place.stage(r, a.chunk)
            if a.kind == "F":  # the activation from the previous stage, then to the next
                if stage > 0:
                    posts.append(("recv", rank(stage - 1), ("act", stage, a.mb)))
                if stage < n_stages - 1:
                    posts.append(("send", rank(stage + 1), ("act", stage + 1, a.mb)))
            elif a.kind in ("B", "I"):  # dL/d(output) from the next stage, dL/d(input) back
                if stage < n_stages - 1:
                    posts.append(("recv", rank(stage + 1), ("grad", stage, a.mb)))
                if stage > 0:
                    posts.append(("send", rank(stage - 1), ("grad", stage - 1, a.mb)))
        out.append(posts)
    return out


def message_orders(schedule: Schedule, v: int = 1) -> dict[tuple[int, int], tuple[list, list]]:
    """For every (sender, receiver) rank pair: the messages in the order the sender posts them
    and in the order the receiver waits for them. NCCL ignores p2p tags and matches messages
    between two ranks by order alone, so the two lists must be equal (gloo matches by tag)."""
    out: dict[tuple[int, int], tuple[list, list]] = {}
    for r, posts in enumerate(p2p_posts(schedule, v)):
        for op, peer, msg in posts:
            pair, side = ((r, peer), 0) if op == "send" else ((peer, r), 1)
            out.setdefault(pair, ([], []))[side].append(msg)
    return out


# --- the same lists as NCCL runs them: one stream per rank pair and process group ----------------


def p2p_lane(src: int, dst: int) -> str:
    """The process group ("lane") a message from pipeline rank `src` to `dst` travels on: "up"
    toward a higher rank, "down" toward a lower one. NCCL runs every p2p operation between two
    ranks of one group on one stream, in posting order; with one lane per direction each stream
    carries one-way traffic, whose order message_orders checks. (Lanes by message kind would
    not do: interleaved at pp = 2 sends activations both ways between the same two ranks.)"""
    return "up" if src < dst else "down"


def play_p2p(schedule: Schedule, v: int = 1, lane=None, per_group: bool = False) -> None:
    """Post every rank's sends and receives as the runtime does and run them as NCCL does;
    raise Deadlock if they hang or would hand a receive the wrong message.

    The runtime posts a send and goes on (isend), and blocks on each receive. NCCL queues the
    operations of a (group, rank pair) on one stream per rank, in posting order, and moves a
    large message only while its send heads the sender's stream and its receive heads the
    receiver's: a send waits for its receive, and everything behind it waits too. `lane(src,
    dst, message)` names the group a message travels on; default: the runtime's p2p_lane.
    per_group=True: one stream per (rank, group) for every peer, the stricter order of a torch
    that runs p2p on the group's own communicator (eager init)."""
    lane = lane or (lambda src, dst, msg: p2p_lane(src, dst))
    posts = p2p_posts(schedule, v)
    pos, waiting = [0] * len(posts), [None] * len(posts)
    streams: dict[tuple, deque] = {}  # (rank, lane[, peer]) -> [op, peer, message, done]

    def stream(rank: int, ln: str, peer: int) -> tuple:
        return (rank, ln) if per_group else (rank, ln, peer)

    while True:
        moved = _post(posts, pos, waiting, streams, lane, stream)
        moved = _match_heads(streams, stream) or moved
        if all(pos[r] == len(ops) for r, ops in enumerate(posts)):
            if not any(streams.values()):
                return
        if not moved:
            blocked = {r: ops[pos[r]] for r, ops in enumerate(posts) if pos[r] < len(ops)}
            heads = {k: q[0][:3] for k, q in streams.items() if q}
            raise Deadlock(f"p2p: no rank can proceed; next posts {blocked}; stream heads {heads}")


def _post(posts, pos, waiting, streams, lane, stream) -> bool:
    """Each rank posts until it blocks in a receive that has not completed."""
    moved = False
    for r, ops in enumerate(posts):
        while pos[r] < len(ops):
            if waiting[r] is not None:  # inside a receive: wait for it
                if not waiting[r][3]:
                    break
                waiting[r], pos[r], moved = None, pos[r] + 1, True
                continue
            op, peer, msg = ops[pos[r]]
            src, dst = (r, peer) if op == "send" else (peer, r)
            ln = lane(src, dst, msg)
            entry = [op, peer, msg, False]
            streams.setdefault(stream(r, ln, peer), deque()).append(entry)
            moved = True
            if op == "recv":
                waiting[r] = entry
            else:
                pos[r] += 1
    return moved


def _match_heads(streams, stream) -> bool:
    """A send at the head of its stream meets the receive at the head of its peer's."""
    moved = False
    for key, queue in streams.items():
        if not queue or queue[0][0] != "send":
            continue
        (r, ln), (_, peer, msg, _) = key[:2], queue[0]
        other = streams.get(stream(peer, ln, r))
        if not other or other[0][0] != "recv" or other[0][1] != r:
            continue
        if other[0][2] != msg:
            raise Deadlock(
                f"p2p: rank {r} sends {msg} to rank {peer} on lane {ln}, whose receive there "
                f"waits for {other[0][2]}: NCCL would hand it the wrong tensor"
            )
        queue.popleft()
        other.popleft()[3] = True
        moved = True
    return moved
