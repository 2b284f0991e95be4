"""Day 20: pipeline schedules (pure action lists) and the runtime that runs them, vs one process.

Reference: the whole GPT (seed 0) in one process on all micro-batches at once; the pipeline's
loss is the mean of the micro-batch losses, the same number for equal-sized micro-batches.
Tolerances: loss rtol 1e-6, gradients rtol 1e-5 atol 1e-7 (fp32, the same sums in another
order), parameters after SGD steps atol 1e-6.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

from day20_pp import p2p, schedules
from day20_pp.pipeline import (
    PipelineError,
    PipelineRunner,
    apply_pp,
    build_stages,
    check_pipeline,
    stage_parameters,
)
from dtl import dist as dtl_dist
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn
from dtl.testing import run_distributed, script_error

CFG = GPTConfig(n_layer=8, n_head=2, n_embd=16, block_size=16, vocab_size=64, bias=False)
B, T, M, K = 2, 8, 4, 2
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
RUNS = schedules.every_schedule()  # (name, v): interleaved with 2 chunks


# --- the action lists, without any model --------------------------------------------------------


def _cases():
    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            yield p, m


def _check_lists(name, v):
    """Schedule `name`'s lists for every (p, m) of _cases it takes: complete and ordered (each
    (chunk, micro-batch) has exactly one F and either one B or one I and one W, all after the F),
    free of deadlock (simulate raises Deadlock if the lists wait on each other), exactly as idle
    as the formula, and between any two ranks the messages are received in the order they are
    sent (what NCCL, which ignores tags, relies on). Returns each (p, m)'s peaks in flight."""
    peaks = {}
    kind = schedules.SCHEDULES[name]
    for p, m in _cases():
        if (kind.takes_v and m % p) or m < kind.fewest_microbatches(p):
            continue
        sched = schedules.make(name, p, m, v)
        tl = schedules.simulate(sched, v=v)
        for r, acts in enumerate(sched):
            seen = {}
            for i, a in enumerate(acts):
                seen.setdefault((a.kind, a.chunk, a.mb), []).append(i)
            for c in range(v):
                for mb in range(m):
                    (f,) = seen[("F", c, mb)]  # exactly one forward per micro-batch
                    backs = [k for k in ("B", "I", "W") if (k, c, mb) in seen]
                    assert backs in (["B"], ["I", "W"]), (name, p, m, r, c, mb, backs)
                    assert all(len(seen[(k, c, mb)]) == 1 for k in backs)
                    assert all(f < i for k in backs for i in seen[(k, c, mb)])
        formula = schedules.bubble_formula(name, p, m, v)
        assert tl.bubble == pytest.approx(formula, abs=1e-12), (name, p, m, v)
        for lane, (sent, received) in p2p.message_orders(sched, v).items():
            assert sent == received, (name, p, m, v, lane)
        peaks[(p, m)] = tl.peak_in_flight()
    assert peaks, f"{name}: no (p, m) of the cases was checked"
    return peaks


def test_the_1f1b_lists_are_complete_deadlock_free_as_idle_as_the_formula_and_hold_p_minus_r():
    for (p, m), peaks in _check_lists("1f1b", 1).items():
        assert peaks == [min(p - r, m) for r in range(p)], (p, m, peaks)


def test_the_interleaved_lists_are_complete_deadlock_free_and_as_idle_as_the_formula():
    for v in (2, 3):
        for (p, m), peaks in _check_lists("interleaved", v).items():
            # at most Megatron's warm-up + 1 (p, m, v = 4, 8, 2: [11, 9, 7, 5]); all at m = p
            most = [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
            most = [m * v] * p if m == p else most
            assert all(g <= w for g, w in zip(peaks, most)), (p, m, v, peaks, most)


def test_every_other_schedule_is_complete_deadlock_free_and_as_idle_as_the_formula():
    for name, v in RUNS:
        if name in ("1f1b", "interleaved"):  # their own tests above
            continue
        for (p, m), peaks in _check_lists(name, v).items():
            if name == "gpipe":
                assert peaks == [m] * p, (p, m, peaks)
            if name == "zb":
                assert max(peaks) <= p, (p, m, peaks)
            if name == "dualpipev":  # DeepSeek's bound: 2p + 1 chunk-micro-batches in flight
                assert max(peaks) <= 2 * p + 1, (p, m, peaks)


def test_a_wrong_schedule_is_caught_as_a_deadlock():
    sched = schedules.one_f_one_b(2, 2)
    sched[1] = [schedules.Action("B", 0), schedules.Action("F", 0), *sched[1][2:]]  # B before F
    with pytest.raises(schedules.Deadlock, match="no rank can proceed"):
        schedules.simulate(sched)


def test_ascii_timeline_shows_every_action():
    tl = schedules.simulate(schedules.one_f_one_b(2, 2))
    text = schedules.ascii_timeline(tl)
    assert text.count("F0") == 2 and text.count("B1") == 4  # B costs 2 units: 2 cells x 2 ranks


# --- the runtime on real stages -----------------------------------------------------------------


def _micro_batches(step, dp_rank=0, dp_size=1, m=M):
    """This DP rank's B·M rows of the step, cut into m micro-batches (M of B rows by default)."""
    g = torch.Generator().manual_seed(10 + step)
    rows = torch.randint(0, CFG.vocab_size, (B * M * dp_size, T + 1), generator=g)
    mine = rows[dp_rank * B * M : (dp_rank + 1) * B * M]
    b = B * M // m
    return [(mine[i * b : (i + 1) * b, :-1], mine[i * b : (i + 1) * b, 1:]) for i in range(m)]


def _microbatches_for(name, p):
    """M, or the fewest the schedule takes at p (DualPipe-V: 2p), the same B·M rows either way."""
    m = max(M, schedules.SCHEDULES[name].fewest_microbatches(p))
    assert (B * M) % m == 0, (name, p, m)
    return m


def _pipeline_runs(pp, dp):
    """Each schedule: one step's loss and gradients, then (1F1B) K SGD steps' parameters."""
    grid = ParallelGrid(pp=pp, dp=dp)
    out = {}
    for name, v in RUNS:
        m = _microbatches_for(name, pp)
        try:
            plan = schedules.make(name, pp, m, v)
        except NotImplementedError as e:  # a started exercise's stub: the other schedules run
            out[name] = str(e)
            continue
        actions = plan[grid.pp_rank]
        stages = build_stages(CFG, grid, plan.placement)
        runner = PipelineRunner(stages, grid, CFG, (B * M // m, T), placement=plan.placement)
        params = stage_parameters(stages)
        opt = torch.optim.SGD(list(params.values()), lr=0.5)
        losses, grads, peak = [], None, None
        for step in range(K):
            loss, rec = runner.step(actions, _micro_batches(step, grid.dp_rank, dp, m))
            # DP beside the pipeline, the lesson's own path (day20_pp/train.py's run)
            dtl_dist.average_gradients(list(params.values()), grid.dp_group)
            if step == 0:
                grads = {n: p.grad.clone() for n, p in params.items()}
                peak = rec.peak_in_flight
            opt.step()
            opt.zero_grad()
            # the global batch's loss, as train.py's run: the replicas' last stages, averaged
            losses.append(dtl_dist.all_reduce_scalar(loss or 0.0) / dp)
        out[name] = dict(
            losses=losses,
            grads=grads,
            peak=peak,
            params={n: p.detach().clone() for n, p in params.items()},
        )
    # apply_pp (what day 22 composes) on an existing model: the same first-step gradients
    if isinstance(out["1f1b"], str):
        return out
    pipe = apply_pp(GPT(CFG, seed=0), grid, "1f1b", M, (B, T))
    pipe.step(_micro_batches(0, grid.dp_rank, dp))
    for p in pipe.parameters():
        dist.all_reduce(p.grad, group=grid.dp_group)
        p.grad /= dp
    out["apply_pp"] = {n: p.grad.clone() for n, p in stage_parameters(pipe.stages).items()}
    return out


def _torch_pipelining(pp):
    """The same stages through torch.distributed.pipelining, each schedule on the placement ours
    has (DualPipe-V's V: torch 2.13's ScheduleDualPipeV, where this torch has it); the tied
    embedding's two copies summed by hand (torch's schedules do not know the tie). scale_grads
    (the default) divides by the number of micro-batches: the mean, as our runtime's loss / m."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    grid = ParallelGrid(pp=pp)
    out = {}
    for name, v, cls in (
        ("gpipe", 1, ScheduleGPipe),
        ("1f1b", 1, Schedule1F1B),
        ("interleaved", 2, ScheduleInterleaved1F1B),
        ("dualpipev", 1, getattr(torch_schedules, "ScheduleDualPipeV", None)),
    ):
        if cls is None:
            continue
        m = _microbatches_for(name, pp)
        try:
            place = schedules.make(name, pp, m, v).placement
        except NotImplementedError:  # a started exercise's stub: the test names it
            continue
        rows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in _micro_batches(0, m=m)])
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # its shape checks: strides
        stages = build_stages(CFG, grid, place)
        pstages = []
        for c, mod in enumerate(stages):
            index, b = place.stage(grid.pp_rank, c), B * M // m
            example = (
                torch.zeros(b, T, dtype=torch.long) if index == 0 else torch.zeros(b, T, CFG.n_embd)
            )
            pstages.append(
                PipelineStage(
                    mod, index, place.n_stages, torch.device("cpu"), input_args=(example,)
                )
            )
        sched = cls(pstages if place.v > 1 else pstages[0], m, loss_fn=loss_fn)
        first = any(s.is_first for s in pstages)
        last = any(s.is_last for s in pstages)
        sched.step(*((x,) if first else ()), **(dict(target=y) if last else {}))
        _sum_tied_copies(stages, grid, place)
        out[name] = {n: p.grad.clone() for n, p in stage_parameters(stages).items()}
    return out


def _sum_tied_copies(stages, grid, place):
    """wte's and the tied lm_head's gradients summed: over the embedding group when the ends
    are on two ranks, in place when one rank holds both (a V's rank 0)."""
    copies = [s.wte for s in stages if s.wte is not None]
    copies += [s.lm_head for s in stages if s.lm_head is not None]
    if len(place.tied_ranks()) == 2 and copies:
        dist.all_reduce(copies[0].weight.grad, group=grid.embedding_group)
    elif len(copies) == 2:
        total = copies[0].weight.grad + copies[1].weight.grad
        for c in copies:
            c.weight.grad.copy_(total)


def _built(ranks, names):
    """The schedules among `names` whose lists the runs built. A stubbed builder (a started
    exercise) left its message instead; _no_stubs fails the test on it once the rest is checked."""
    return [n for n in names if not isinstance(ranks[0][n], str)]


def _no_stubs(ranks):
    stubbed = sorted({res for res in ranks[0].values() if isinstance(res, str)})
    assert not stubbed, stubbed


def _all_runs(pp, dp):
    out = _pipeline_runs(pp, dp)
    if dp == 1:
        out["torch"] = _torch_pipelining(pp)
    return out


@pytest.fixture(scope="module", params=[(2, 1), (4, 1), (2, 2)], ids=["pp2", "pp4", "pp2dp2"])
def runs(request):
    pp, dp = request.param
    return pp, dp, run_distributed(_all_runs, pp, dp, world_size=pp * dp, timeout_s=240)


def _reference(dp):
    gpt = GPT(CFG, seed=0)
    opt = torch.optim.SGD(gpt.parameters(), lr=0.5)
    losses, grads = [], None
    for step in range(K):
        batches = [b for r in range(dp) for b in _micro_batches(step, r, dp)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loss = loss_fn(gpt(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in gpt.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach() for n, p in gpt.named_parameters(remove_duplicate=False)}
    return losses, grads, params


def _gpipe_step_on_two_ranks():
    """One GPipe step (no exercise's list) on 2 stages: the loss and this rank's gradients."""
    grid = ParallelGrid(pp=2)
    plan = schedules.gpipe(2, M)
    stages = build_stages(CFG, grid, plan.placement)
    runner = PipelineRunner(stages, grid, CFG, (B, T), placement=plan.placement)
    loss, _ = runner.step(plan[grid.pp_rank], _micro_batches(0))
    return loss, {n: p.grad.clone() for n, p in stage_parameters(stages).items()}


def test_the_forward_step_on_two_ranks_gives_the_one_process_loss_and_gradients():
    (loss0, grads0), (loss1, grads1) = run_distributed(_gpipe_step_on_two_ranks, world_size=2)
    ref_losses, ref_grads, _ = _reference(1)
    assert loss0 is None, "only the last stage computes the loss"
    torch.testing.assert_close(loss1, ref_losses[0], rtol=1e-6, atol=0)  # the mean over m
    assert {**grads0, **grads1}.keys() == ref_grads.keys()
    for n, g in {**grads0, **grads1}.items():
        torch.testing.assert_close(g, ref_grads[n], **GRAD_TOL, msg=lambda m, n=n: f"{n}: {m}")


def test_every_schedule_gives_the_one_process_loss_gradients_and_parameters(runs):
    pp, dp, ranks = runs
    ref_losses, ref_grads, ref_params = _reference(dp)
    for name in _built(ranks, [name for name, _ in RUNS]):
        grads, params = {}, {}
        for res in ranks:
            grads.update(res[name]["grads"])
            params.update(res[name]["params"])
        for res in ranks:  # every rank: the global batch's loss, dp = 2 included
            torch.testing.assert_close(res[name]["losses"], ref_losses, rtol=1e-6, atol=0)
        assert grads.keys() == ref_grads.keys(), name  # lm_head: the last stage's tied copy
        for n in ref_grads:
            torch.testing.assert_close(
                grads[n], ref_grads[n], **GRAD_TOL, msg=lambda m, n=n, s=name: f"{s} {n}: {m}"
            )
            torch.testing.assert_close(
                params[n],
                ref_params[n],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=n, s=name: f"{s} {n}: {m}",
            )
    _no_stubs(ranks)


@pytest.mark.parametrize("runs", [(2, 1), (4, 1)], ids=["pp2", "pp4"], indirect=True)
def test_torch_pipelining_schedules_give_the_same_gradients_as_ours(runs):
    pp, dp, ranks = runs
    names = ["gpipe", "1f1b", "interleaved"]
    if hasattr(torch_schedules, "ScheduleDualPipeV"):  # torch >= 2.13
        names.append("dualpipev")
    assert set(names) <= set(ranks[0]["torch"]), sorted(ranks[0]["torch"])
    for name in _built(ranks, names):
        theirs, ours = {}, {}
        for res in ranks:
            theirs.update(res["torch"][name])
            ours.update(res[name]["grads"])
        assert theirs.keys() == ours.keys()
        for n in ours:
            torch.testing.assert_close(
                theirs[n], ours[n], **GRAD_TOL, msg=lambda m, n=n, s=name: f"{s} {n}: {m}"
            )
    _no_stubs(ranks)


def test_apply_pp_on_an_existing_model_gives_the_same_gradients(runs):
    _, _, ranks = runs
    _no_stubs(ranks)
    for res in ranks:
        for n, g in res["apply_pp"].items():
            torch.testing.assert_close(g, res["1f1b"]["grads"][n], rtol=0, atol=0)


def test_the_runtime_counts_the_in_flight_micro_batches_the_lists_promise(runs):
    pp, dp, ranks = runs
    first_pipeline = ranks[::dp]  # ranks 0, dp, 2dp, ...: stages 0..pp-1 of DP replica 0
    for name, v in RUNS:
        if name not in _built(ranks, [name]):
            continue
        m = _microbatches_for(name, pp)
        want = schedules.simulate(schedules.make(name, pp, m, v), v=v).peak_in_flight()
        got = [res[name]["peak"] for res in first_pipeline]
        assert got == want, (name, got, want)
        if name == "gpipe":
            assert got == [M] * pp
        if name == "1f1b":
            assert max(got) <= pp
    _no_stubs(ranks)


# --- bad input ----------------------------------------------------------------------------------


def test_sizes_a_pipeline_cannot_take_are_one_line_errors():
    for call, pattern in (
        (lambda: check_pipeline(CFG, 16), "16 stages .* only 8 layers"),
        (lambda: check_pipeline(CFG, 3), "n_layer 8 is not divisible by pp 3"),
        (lambda: check_pipeline(CFG, 2, 3), "pp 2 x chunks 3"),
        (lambda: check_pipeline(CFG, 1, 2), "need pp >= 2"),
    ):
        with pytest.raises(PipelineError, match=pattern) as info:
            call()
        assert "\n" not in str(info.value)
    with pytest.raises(schedules.ScheduleError, match="multiple of p=4"):
        schedules.make("interleaved", 4, 6, 2)
    with pytest.raises(schedules.ScheduleError, match="unknown schedule"):
        schedules.make("pipedream", 2, 4)


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--pp=3"], "4", "pp 3 does not divide the world size 4"),
        (["--pp=8"], "8", "8 stages (pp 8 x chunks 1) but only 4 layers"),
        (["--schedule=interleaved", "--chunks=2", "--microbatches=3"], "2", "multiple of p=2"),
        (["--schedule=1f1b", "--chunks=2"], "2", "for the interleaved schedule only"),
    ],
)
def test_train_script_rejects_bad_input_with_one_line_and_exit_2(args, world, message):
    assert message in script_error("day20_pp.train", *args, env={"WORLD_SIZE": world})


def test_every_schedule_runs_under_nccls_p2p_rules():
    # FIFO streams, no buffering, no tags: one stream per (group, rank pair), or one per group
    for p, m in _cases():
        for name, v in RUNS + [("interleaved", 3), ("interleaved", 4)]:
            kind = schedules.SCHEDULES[name]
            if (kind.takes_v and m % p) or m < kind.fewest_microbatches(p):
                continue
            sched = schedules.make(name, p, m, v)
            p2p.play_p2p(sched, v)
            p2p.play_p2p(sched, v, per_group=True)


def test_one_group_per_message_kind_hangs_interleaved_at_pp2():
    # the old layout (activations on one group, gradients on another) deadlocks under NCCL
    with pytest.raises(schedules.Deadlock, match="no rank can proceed"):
        p2p.play_p2p(schedules.make("interleaved", 2, 4, 2), 2, lane=lambda src, dst, msg: msg[0])


def test_receives_out_of_send_order_are_caught():
    A = schedules.Action
    sched = schedules.one_f_one_b(2, 2)
    sched[1] = [A("F", 1), A("B", 1), A("F", 0), A("B", 0)]
    with pytest.raises(schedules.Deadlock, match="wrong tensor"):
        p2p.play_p2p(sched)


def test_one_group_per_direction_hands_dualpipe_v_the_wrong_tensor_at_pp4():
    # lanes by direction alone: chunk 0's activations and chunk 1's gradients share the up lane
    sched = schedules.make("dualpipev", 4, 8)
    with pytest.raises(schedules.Deadlock, match="wrong tensor"):
        p2p.play_p2p(sched, lane=lambda src, dst, msg: "up" if src < dst else "down")


def test_lanes_are_one_way_and_of_one_kind():
    assert p2p.p2p_lane(0, 1, "act") == p2p.p2p_lane(3, 5, "act") == "up-act"
    assert p2p.p2p_lane(1, 0, "grad") == p2p.p2p_lane(3, 0, "grad") == "down-grad"
    assert {p2p.p2p_lane(s, d, k) for s, d in ((0, 1), (1, 0)) for k in ("act", "grad")} == set(
        p2p.LANES
    )


def _crossed_receives_on_the_runtime():
    """1F1B on 2 ranks, rank 1's list reordered to take micro-batch 1 before 0 while rank 0
    sends 0 first: the runtime's real sends and receives, matched by tag (gloo) and in posting
    order (NCCL's rule, DTL_P2P_IGNORE_TAGS). Returns the first-step gradients of each."""
    from dtl import nccl_rules

    grid = ParallelGrid(pp=2)
    A = schedules.Action
    good = schedules.make("1f1b", 2, M, 1)
    assert good[1][:4] == [A("F", 0), A("B", 0), A("F", 1), A("B", 1)]
    crossed = [good[0], [A("F", 1), A("B", 1), A("F", 0), A("B", 0), *good[1][4:]]]
    out = {}
    for name, sched, ignore_tags in (
        ("valid", good, True),
        ("crossed, by tag", crossed, False),
        ("crossed, in posting order", crossed, True),
    ):
        (nccl_rules.ignore_p2p_tags if ignore_tags else nccl_rules.restore_p2p_tags)()
        stages = build_stages(CFG, grid, good.placement)
        runner = PipelineRunner(stages, grid, CFG, (B, T), placement=good.placement)
        runner.step(sched[grid.pp_rank], _micro_batches(0))
        out[name] = {n: p.grad.clone() for n, p in stage_parameters(stages).items()}
    return out


def test_ignoring_tags_catches_receives_posted_out_of_send_order_in_the_runtime():
    for rank in run_distributed(_crossed_receives_on_the_runtime, world_size=2):
        valid = rank["valid"]
        for n in valid:  # gloo's tags hide the crossed order: the same gradients
            torch.testing.assert_close(rank["crossed, by tag"][n], valid[n], rtol=0, atol=0)
        # matched in posting order, as on a GPU, the activations swap: wrong gradients
        wrong = [
            n for n in valid if not torch.equal(rank["crossed, in posting order"][n], valid[n])
        ]
        assert wrong, "ignoring tags changed nothing: the check could not catch this bug"


def test_every_stage_has_one_home_and_every_schedule_carries_its_placement():
    import pickle

    for name, v in RUNS:
        sched = schedules.make(name, 4, 8, v)
        place = sched.placement
        assert place.p == 4, name
        if schedules.SCHEDULES[name].takes_v:  # the chunks asked for; else the schedule's own
            assert place.v == v, name
        homes = {place.stage(r, c): (r, c) for r in range(4) for c in range(place.v)}
        assert sorted(homes) == list(range(place.n_stages)), name  # each stage exactly once
        assert all((place.rank(s), place.chunk(s)) == rc for s, rc in homes.items()), name
        assert pickle.loads(pickle.dumps(sched)).placement == place  # travels to the ranks
