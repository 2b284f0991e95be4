"""DualPipe-V (DeepSeek-V3 report, arXiv 2412.19437; the "V" cut-in-half variant of DualPipe),
as action lists on the V placement: rank r holds stage r on the way down (chunk 0) and stage
2p - 1 - r on the way back (chunk 1), so the first and the last stage share rank 0.

Each rank runs eight phases, their lengths set by its distance from the V's turn (rank p - 1):

    1  warm-up            F on chunk 0, 2(p - 1 - r) times: fill the way down
    2  both chunks        (F0, F1), r + 1 times: the way back starts
    3  zero bubble        (I1, W of the oldest pending I, F1), p - 1 - r times
    4  steady             (F0 + B1, F1 + B0), m - 2p + r + 1 times: a forward beside a backward
                          of the other chunk (DualPipe overlaps the two: one's compute hides the
                          other's communication; here they run one after the other)
    5  drain chunk 1      (B1, F1 + B0), p - 1 - r times
    6  both backwards     (B1, B0), r + 1 times; halfway the full backward B gives way to I
                          (odd ranks before B1, even ranks after it): its W waits
    7  drain chunk 0      (W pending, B0 or I0), p - 1 - r times
    8  the last weights   W pending, r + 1 times

B is a full backward (input and weight gradients); I the input gradient alone, whose W runs
later from a first-in, first-out queue. Micro-batches are numbered per chunk and kind in the
order they run. It needs m >= 2p micro-batches (every stage's first backward before the
warm-up of the other chunk ends).

These lists are torch's `ScheduleDualPipeV` plan, action for action
(tests/test_day20_dualpipe.py), registered as "dualpipev" in `schedules.SCHEDULES`: the
simulator, the p2p replay, the runtime and the bench run them as every other schedule. On
NCCL they need the runtime's four lanes (p2p.p2p_lane: direction and message kind): rank r
sends chunk 0's activations and chunk 1's gradients up the same rank pair, in an order its
neighbour does not receive them in.
"""

from __future__ import annotations

from day20_pp.placement import Action, Placement, Schedule, ScheduleError
from dtl.exercise_seam import exercise

DOWN, BACK = 0, 1  # the chunks of a V rank: its stage on the way down, its stage coming back


class _RankPlan:
    """One rank's action list as it is written, with the micro-batch counters it needs."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.forwarded = [0, 0]  # chunk -> micro-batches forwarded
        self.backwarded = [0, 0]  # chunk -> micro-batches whose input gradient is done
        self.weights_due: list[tuple[int, int]] = []  # (chunk, mb) whose W is pending, oldest first

    def forward(self, chunk: int) -> None:
        self.actions.append(Action("F", self.forwarded[chunk], chunk))
        self.forwarded[chunk] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        """B (input and weight gradients), or I alone with its W queued (`split`)."""
        mb = self.backwarded[chunk]
        self.actions.append(Action("I" if split else "B", mb, chunk))
        self.backwarded[chunk] += 1
        if split:
            self.weights_due.append((chunk, mb))

    def weight(self) -> None:
        """The oldest pending W, if one is pending."""
        if self.weights_due:
            chunk, mb = self.weights_due.pop(0)
            self.actions.append(Action("W", mb, chunk))


@exercise("day20.dualpipe_v")
def _rank_actions(r: int, p: int, m: int) -> list[Action]:
    """Rank r's list: the eight phases of the module docstring, in order, on a _RankPlan."""
    plan = _RankPlan()
    to_turn = p - 1 - r  # how far this rank is from the V's turn
    for _ in range(2 * to_turn):  # 1
        plan.forward(DOWN)
    for _ in range(r + 1):  # 2
        plan.forward(DOWN)
        plan.forward(BACK)
    # exercise day20.dualpipe_v: begin
    for _ in range(to_turn):  # 3
        plan.backward(BACK, split=True)
        plan.weight()
        plan.forward(BACK)
    for _ in range(m - 2 * p + r + 1):  # 4
        plan.forward(DOWN)
        plan.backward(BACK)
        plan.forward(BACK)
        plan.backward(DOWN)
    for _ in range(to_turn):  # 5
        plan.backward(BACK)
        plan.forward(BACK)
        plan.backward(DOWN)
    split = False
    for i in range(r + 1):  # 6
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        plan.backward(BACK, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        plan.backward(DOWN, split)
    for _ in range(to_turn):  # 7
        plan.weight()
        plan.backward(DOWN, split)
    # exercise day20.dualpipe_v: end
    for _ in range(r + 1):  # 8
        plan.weight()
    return plan.actions


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipe-V's action lists for p ranks (2p stages on the V placement) and m micro-batches."""
    if p < 1 or m < 2 * p:
        raise ScheduleError(f"DualPipe-V needs m >= 2p micro-batches: m = {m}, p = {p}")
    return Schedule([_rank_actions(r, p, m) for r in range(p)], Placement.v_shape(p))
