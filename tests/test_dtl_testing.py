"""run_distributed: results come back per rank; a failing rank fails fast with its traceback."""

import time

import pytest
import torch
import torch.distributed as dist

from dtl.testing import RankFailed, run_distributed


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _rank1_raises_while_rank0_waits():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 blocks here forever: the harness must not wait for the timeout


def test_run_distributed_returns_each_ranks_result_in_rank_order():
    assert run_distributed(_rank_and_sum, world_size=3) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_a_failing_rank_fails_the_test_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed.*ValueError: boom on rank 1"):
        run_distributed(_rank1_raises_while_rank0_waits, world_size=2, timeout_s=60)
    assert time.monotonic() - start < 20, "the harness waited for the collective timeout"


# --- the one-process reference and the gap checks ---------------------------------------------


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def test_reference_train_is_the_plain_loop_and_returns_its_losses():
    from dtl.reference import params_gap, reference_train

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = reference_train(model, _batch, opt, steps=3)
    by_hand = _model()
    opt2 = torch.optim.SGD(by_hand.parameters(), lr=0.5)
    expected = []
    for step in range(3):
        x, y = _batch(step)
        opt2.zero_grad()
        loss = torch.nn.functional.cross_entropy(by_hand(x), y)
        loss.backward()
        opt2.step()
        expected.append(loss.item())
    assert losses == expected and losses[-1] < losses[0]
    assert params_gap(model, by_hand) == 0.0
    assert params_gap(model, _model()) > 1e-3  # three SGD steps did move the weights
    with pytest.raises(ValueError, match="parameter names differ"):
        params_gap(model, torch.nn.Linear(4, 8))


def test_reference_train_clips_the_global_norm_and_reports_it_before_clipping():
    from dtl.reference import params_gap, reference_train

    model, by_hand = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms: list[float] = []
    reference_train(model, _batch, opt, steps=2, clip_grad=1e-3, grad_norms=norms)
    opt2 = torch.optim.SGD(by_hand.parameters(), lr=0.5)
    expected = []
    for step in range(2):
        x, y = _batch(step)
        opt2.zero_grad()
        torch.nn.functional.cross_entropy(by_hand(x), y).backward()
        expected.append(torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 1e-3).item())
        opt2.step()
    assert norms == expected and min(norms) > 1e-3  # the clip was active
    assert params_gap(model, by_hand) == 0.0
    unclipped = _model()
    reference_train(unclipped, _batch, torch.optim.SGD(unclipped.parameters(), lr=0.5), 2)
    assert params_gap(model, unclipped) > 1e-3


def _gap_with_one_rank_nudged(nudge):
    from dtl.reference import replica_gap

    model = _model()
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[0].weight[0, 0] += nudge
    return replica_gap(model)


def test_replica_gap_is_zero_for_identical_replicas_and_finds_a_one_element_drift():
    assert run_distributed(_gap_with_one_rank_nudged, 0.0, world_size=2) == [0.0, 0.0]
    gaps = run_distributed(_gap_with_one_rank_nudged, 0.25, world_size=2)
    assert gaps == [pytest.approx(0.25)] * 2  # every rank learns the max, not just the drifted one


def _verdicts():
    from dtl.reference import reference_verdict

    params = {"w": torch.ones(3)}
    ref = lambda losses, nudge=1e-5: lambda: (losses, {"w": torch.ones(3) + nudge})  # noqa: E731
    kw = dict(steps=2, device="cpu")
    same = reference_verdict([1.0, 2.0], params, ref([1.0, 2.0]), **kw)
    off = reference_verdict([1.0, 2.0], params, ref([1.0, 2.0001]), **kw)
    drifted = reference_verdict([1.0, 2.0], params, ref([1.0, 2.0], nudge=1e-3), **kw)
    short = reference_verdict([1.0], params, ref([1.0, 2.0]), **kw)  # a run that stopped early
    return same, off, drifted, short


def test_reference_verdict_says_yes_within_rtol_no_outside_and_the_same_on_every_rank():
    results = run_distributed(_verdicts, world_size=2)
    assert results[0] == results[1]  # rank 1 prints what rank 0 computed
    same, off, _, _ = results[0]
    assert same.ok and not off.ok  # what a script decides with, not a sentence to parse
    assert same.line.startswith("losses match one process yes (max rel diff 0.0e+00, rtol 1e-5;")
    assert "params max |diff| 1.0e-05, atol 1e-4; after 2 AdamW steps)" in same.line
    assert off.line.startswith("losses match one process NO (max rel diff 5.0e-05")
    assert f"{same}" == same.line and same.params_gap == pytest.approx(1e-5, rel=1e-2)  # fp32


def test_reference_verdict_judges_the_parameters_and_the_counts_not_only_the_losses():
    _, _, drifted, short = run_distributed(_verdicts, world_size=2)[1]  # rank 1: broadcast
    # equal losses, parameters 1e-3 apart (the last update, which no loss sees): NO
    assert not drifted.ok and drifted.loss_rel == 0.0 and drifted.params_gap > drifted.atol
    assert drifted.line.startswith("losses match one process NO")
    # one loss for two steps: zip would compare one pair and say yes
    assert not short.ok and short.loss_rel == 0.0
    assert short.counts == "values per run, 2 expected: losses 1"
    assert short.line.endswith("after 2 AdamW steps; values per run, 2 expected: losses 1)")


def test_adams_allowance_covers_only_the_elements_whose_gradient_was_rounding_noise():
    from dtl.reference import Reference, Verdict, _params_gaps, adam_allowance, adam_step_bound

    assert adam_step_bound((0.9, 0.999)) == pytest.approx(0.1 / 0.001**0.5)  # 3.16: Kingma & Ba
    assert adam_step_bound((0.9, 0.99)) == 1.0
    allowance = adam_allowance({"w": torch.tensor([0, 1, 0])}, lr=1e-3)  # element 1: one step
    assert allowance["w"].tolist() == pytest.approx([0.0, 2e-3 * adam_step_bound(), 0.0])
    ref = Reference([1.0], {"w": torch.zeros(3)}, allowance=allowance)
    # element 1's gradient was noise: 1.7e-4 apart is within its allowance, said apart
    gap, noisy, noisy_gap, allowed = _params_gaps(
        {"w": torch.tensor([5e-5, 1.7e-4, 0.0])}, ref, 1e-4
    )
    assert (gap, noisy, noisy_gap) == (pytest.approx(5e-5), 1, pytest.approx(1.7e-4))
    assert allowed == pytest.approx(allowance["w"][1].item())
    # the same difference on an element whose gradient was not noise is judged at atol
    assert _params_gaps({"w": torch.tensor([1.7e-4, 0, 0])}, ref, 1e-4)[0] == pytest.approx(1.7e-4)
    # a noise element beyond its allowance is beyond, by what exceeds it
    far = _params_gaps({"w": torch.tensor([0.0, 1e-2, 0.0])}, ref, 1e-4)
    assert far[0] == pytest.approx(1e-2 - allowed) and far[0] > 1e-4
    v = Verdict(True, 0.0, 5e-5, 1e-5, 5, noisy=1, noisy_gap=1.7e-4, noisy_allowance=6.3e-3)
    assert (
        "atol 1e-4 (and 1 element whose gradient was rounding noise: up to 1.7e-04 apart, "
        "within AdamW's bound 6.3e-03); after 5 AdamW steps" in v.line
    )


def test_the_reference_counts_the_steps_at_which_a_gradient_was_near_zero():
    from dtl.reference import reference_train

    model = torch.nn.Linear(2, 1, bias=False)
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0]])  # input 1 is always 0: its weight's gradient is 0
    batch = lambda step: (x, torch.zeros(2, 1))  # noqa: E731
    mse = lambda m, x, y: ((m(x) - y) ** 2).mean()  # noqa: E731
    counts: dict[str, torch.Tensor] = {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_train(model, batch, opt, 3, mse, noise_steps=counts, noise_floor=1e-7)
    assert counts["weight"].tolist() == [[0, 3]]


def _norm_verdicts():
    from dtl.reference import reference_verdict

    params = {"w": torch.ones(3)}
    ref = lambda: ([1.0, 2.0], {"w": torch.ones(3)}, [3.0, 4.0])  # noqa: E731
    kw = dict(steps=2, device="cpu")
    same = reference_verdict([1.0, 2.0], params, ref, grad_norms=[3.0, 4.0], **kw)
    off = reference_verdict([1.0, 2.0], params, ref, grad_norms=[3.0, 4.01], **kw)
    return same, off


def test_reference_verdict_compares_gradient_norms_when_both_runs_give_them():
    same, off = run_distributed(_norm_verdicts, world_size=2)[1]  # rank 1: what rank 0 sent
    assert same.ok and same.norm_rel == 0.0 and "grad norms max rel diff 0.0e+00" in same.line
    assert not off.ok and off.norm_rel == pytest.approx(0.0025) and "NO" in off.line


def test_a_skipped_verdict_is_ok_and_its_line_says_why():
    from dtl.reference import Verdict

    v = Verdict.skip("one-process check skipped (check=false)")
    assert v.ok and str(v) == "one-process check skipped (check=false)"


def test_one_process_gpt_trains_the_seeded_gpt_on_get_batch_rows_with_the_given_optimizer():
    from dtl.data import get_batch
    from dtl.model import GPT, preset
    from dtl.reference import one_process_gpt, params_gap, reference_train

    cfg, tokens = preset("tiny"), torch.arange(2000) % 256
    losses, gpt = one_process_gpt(cfg, tokens, seq_len=8, rows=3, steps=2, seed=1, lr=1e-2)
    by_hand = GPT(cfg, seed=1)
    opt = torch.optim.AdamW(by_hand.parameters(), lr=1e-2)
    expected = reference_train(
        by_hand, lambda s: get_batch(tokens, 8, 3, seed=1, step=s), opt, steps=2
    )
    assert losses == expected and params_gap(gpt, by_hand) == 0.0
    sgd, _ = one_process_gpt(
        cfg,
        tokens,
        seq_len=8,
        rows=3,
        steps=2,
        seed=1,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
    )
    assert sgd[0] == losses[0] and sgd[1] != losses[1]  # same start, another optimizer


def test_a_missing_extra_skips_but_fails_under_make_tests_flag(tmp_path):
    """needs_extras: a plain pytest skips, DTL_REQUIRE_EXTRAS=1 (make test) fails the test."""
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).parent
    probe = here / f"_probe_extras_{os.getpid()}.py"  # under tests/: conftest.py applies
    probe.write_text(
        "from dtl import extras\n"
        "from dtl.testing import needs_extras\n\n"
        "extras.EXTRA_MODULES['no_such_extra_dtl'] = 'no_such_module_dtl'\n"
        "pytestmark = needs_extras('no_such_extra_dtl')\n\n\n"
        "def test_needs_it():\n    pass\n"
    )
    try:
        runs = {}
        for strict in ("0", "1"):
            env = {**os.environ, "DTL_REQUIRE_EXTRAS": strict}
            runs[strict] = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)],
                capture_output=True, text=True, env=env, cwd=here.parent, timeout=120,
            )  # fmt: skip
    finally:
        probe.unlink()
    assert runs["0"].returncode == 0 and "1 skipped" in runs["0"].stdout, runs["0"].stdout
    assert runs["1"].returncode == 1 and "1 error" in runs["1"].stdout, runs["1"].stdout  # setup
    assert "DTL_REQUIRE_EXTRAS=1 (make test): Skipped: missing extra: no_such_extra_dtl" in (
        runs["1"].stdout
    )


def test_an_absent_extra_stops_a_script_in_one_line_and_skips_its_launch_line(monkeypatch):
    from dtl import config as dtl_config
    from dtl import extras, registry

    monkeypatch.setitem(extras.EXTRA_MODULES, "absent_dtl", "no_such_module_dtl")
    with pytest.raises(dtl_config.ConfigError) as err:
        extras.require("part=ratio", "absent_dtl")
    assert str(err.value) == (
        "part=ratio needs absent_dtl, which is not installed: pip install -e '.[absent_dtl]'"
    )
    extras.require("plain", *[])  # nothing needed: no stop
    with pytest.raises(ValueError, match="unknown extra"):
        extras.missing(["deepspeeed"])  # a typo is refused, not read as "absent"
    lesson = registry.load()[0]
    run = registry.Run("probe", "torchrun -m day15_collectives.nope", "", [], extras=["absent_dtl"])
    result = registry.execute(lesson, run)  # never started: the module does not exist
    assert result.status == "SKIP" and result.skip_reason.startswith(extras.MISSING_EXTRA)
    with pytest.raises(ValueError, match="unknown extras"):
        registry.Run("probe", "x", "", [], extras=["deepspeeed"])
