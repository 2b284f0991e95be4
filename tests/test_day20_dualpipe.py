"""DualPipe-V's action lists (day20_pp/dualpipe.py) against torch's own plan: torch 2.13's
ScheduleDualPipeV computes, per rank, the same actions on the same stages for the same
micro-batches, action for action (its overlapped forward + backward pairs read as the forward,
then the backward). And the unit-cost simulator plays them with a smaller bubble than 1F1B's."""

from __future__ import annotations

import pytest

from day20_pp.dualpipe import dualpipe_v
from day20_pp.schedules import ScheduleError, one_f_one_b, simulate

# torch's computation types, by the letters the course's actions use
LETTER = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_plan(p: int, m: int) -> list[list[tuple[int, str, int]]]:
    """ScheduleDualPipeV's per-rank plan as (stage, kind, micro-batch), without building stages:
    the plan is a function of (p, m) alone, which the schedule computes in its constructor."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV (torch 2.13 has)")
    plan = object.__new__(schedules.ScheduleDualPipeV)
    plan.pp_group_size, plan._n_microbatches = p, m
    out = []
    for rank in range(p):
        actions = []
        for a in plan._calculate_single_rank_operations(rank):
            for sub in a.sub_actions or (a,):  # an overlapped F + B: the F, then the B
                kind = LETTER[sub.computation_type.name]
                actions.append((sub.stage_index, kind, sub.microbatch_index))
        out.append(actions)
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_dualpipe_v_is_torchs_plan_action_for_action(p):
    for m in (2 * p, 2 * p + 1, 3 * p, 20):
        ours = dualpipe_v(p, m)
        stages = [
            [(ours.placement.stage(r, a.chunk), a.kind, a.mb) for a in acts]
            for r, acts in enumerate(ours)
        ]
        assert stages == torch_plan(p, m), (p, m)


def test_dualpipe_v_lives_on_the_v_and_runs_every_micro_batch_once_per_stage():
    p, m = 4, 9
    s = dualpipe_v(p, m)
    assert s.placement.stages_of == ((0, 7), (1, 6), (2, 5), (3, 4))
    # per rank and chunk: every micro-batch forwarded once, its input gradient (B or I) once,
    # its weight gradient (B or W) once
    for r, acts in enumerate(s):
        for chunk in (0, 1):
            for kinds in (("F",), ("B", "I"), ("B", "W")):
                done = sorted(a.mb for a in acts if a.chunk == chunk and a.kind in kinds)
                assert done == list(range(m)), (r, chunk, kinds)


def test_dualpipe_v_needs_two_micro_batches_per_rank():
    with pytest.raises(ScheduleError, match="m >= 2p"):
        dualpipe_v(4, 7)


def test_dualpipe_v_idles_less_than_1f1b_in_the_unit_cost_simulator():
    for m in (4, 8):
        assert simulate(dualpipe_v(2, m)).bubble < simulate(one_f_one_b(2, m)).bubble / 3
