"""Day 20's placement: the schedule says where the stages live, and everything follows it.

A V at p = 2 (rank 0 holds stages 0 and 3, rank 1 holds 1 and 2) is the hard case: the first and
the last stage share rank 0 (the tied embedding is summed in place, no group), and stage 1 -> 2
is a hand-off inside rank 1 (no post, no process group). GPipe's order played on that V is
checked as lists (simulate, p2p) and run on 2 gloo ranks against one process: loss rtol 1e-6,
gradients rtol 1e-5 atol 1e-7 (fp32, the same sums in another order).
"""

import pytest
import torch

from day20_pp import p2p, schedules
from day20_pp.pipeline import PipelineRunner, build_stages, stage_parameters
from day20_pp.placement import Placement, PlacementError, Schedule
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn
from dtl.testing import run_distributed

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=16, vocab_size=64, bias=False)
B, T, M = 2, 8, 3
V = Placement.v_shape(2)


def test_a_v_places_the_ends_on_rank_0_and_the_turn_inside_rank_1():
    assert V.stages_of == ((0, 3), (1, 2))
    assert [V.rank(s) for s in range(4)] == [0, 1, 1, 0]
    assert [V.chunk(s) for s in range(4)] == [0, 0, 1, 1]
    assert V.tied_ranks() == (0,)  # both ends on one rank: summed in place
    assert Placement.loop(2, 2).tied_ranks() == (0, 1)  # the loop: the two pipeline ends
    assert Placement.loop(4, 2).stages_of == ((0, 4), (1, 5), (2, 6), (3, 7))
    with pytest.raises(PlacementError, match="not 0..S-1"):
        Placement(((0, 1), (1, 2)))  # stage 1 twice, stage 3 nowhere
    with pytest.raises(PlacementError, match="same number"):
        Placement(((0,), (1, 2)))


def _gpipe_on(place: Placement, m: int) -> Schedule:
    """GPipe's order on any placement: every forward chunk by chunk, then every backward in the
    reverse chunk order (a valid, if idle, schedule for a V)."""
    ranks = []
    for _r in range(place.p):
        acts = [schedules.Action("F", mb, c) for c in range(place.v) for mb in range(m)]
        acts += [schedules.Action("B", mb, c) for c in reversed(range(place.v)) for mb in range(m)]
        ranks.append(acts)
    return Schedule(ranks, place)


def test_the_lists_on_a_v_run_and_its_turn_posts_nothing():
    sched = _gpipe_on(V, M)
    schedules.simulate(sched)  # no Deadlock: the dependencies follow the V's stages
    posts = p2p.p2p_posts(sched)
    assert all(peer != r for r, ops in enumerate(posts) for _, peer, _ in ops)  # no self-post
    # rank 1's only messages: stage 0's activations in, stage 1's gradients back out, with
    # stage 2's output to stage 3 on rank 0; nothing between its own stages 1 and 2
    assert {msg[1] for _, _, msg in posts[1]} == {1, 3, 0, 2}
    assert ("act", 2, 0) not in {msg for _, _, msg in posts[1]}  # the turn: a hand-off
    p2p.play_p2p(sched)
    p2p.play_p2p(sched, per_group=True)


def _batches():
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(0, CFG.vocab_size, (B * M, T + 1), generator=g)
    return [(rows[i * B : (i + 1) * B, :-1], rows[i * B : (i + 1) * B, 1:]) for i in range(M)]


def _v_step():
    grid = ParallelGrid(pp=2)
    sched = _gpipe_on(V, M)
    stages = build_stages(CFG, grid, sched.placement)
    runner = PipelineRunner(stages, grid, CFG, (B, T), placement=sched.placement)
    loss, _ = runner.step(sched[grid.pp_rank], _batches())
    ends = [(s.wte is not None, s.lm_head is not None) for s in stages]
    blocks = [sorted(int(k) for k in s.blocks) for s in stages]
    grads = {n: p.grad.clone() for n, p in stage_parameters(stages).items()}
    return dict(loss=loss, ends=ends, blocks=blocks, grads=grads, tied_group=runner.tied_group)


def test_a_v_pipeline_cuts_its_stages_hands_off_its_turn_and_sums_its_tie_like_one_process():
    rank0, rank1 = run_distributed(_v_step, world_size=2)
    assert rank0["blocks"] == [[0], [3]] and rank1["blocks"] == [[1], [2]]  # the V's stages
    assert rank0["ends"] == [(True, False), (False, True)]  # wte on stage 0, lm_head on 3
    assert rank1["ends"] == [(False, False), (False, False)]
    assert rank0["tied_group"] is None  # both copies on rank 0: no group, a sum in place
    assert rank1["loss"] is None  # the loss is on the last stage's rank: rank 0

    gpt = GPT(CFG, seed=0)
    x, y = (torch.cat(t) for t in zip(*_batches()))
    want_loss = loss_fn(gpt(x), y)
    want_loss.backward()
    assert rank0["loss"] == pytest.approx(want_loss.item(), rel=1e-6)
    want = {n: p.grad for n, p in gpt.named_parameters(remove_duplicate=False)}
    got = {**rank0["grads"], **rank1["grads"]}
    assert set(got) == set(want)
    for name, g in got.items():  # wte and lm_head: both the one-process (summed) gradient
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7, msg=name)
    # summed in place on rank 0: the two copies hold the same gradient, bit for bit
    assert torch.equal(rank0["grads"]["wte.weight"], rank0["grads"]["lm_head.weight"])
