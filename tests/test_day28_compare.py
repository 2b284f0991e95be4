"""Day 28's compare.py and day 22's plan.py, the model they share (one process, no group):
ZeRO-3's traffic is day 18's three passes on every micro-step, the usable memory decides what
fits, the step model's inputs move the step time, and the run writes a PNG and the summary lines
lessons.toml expects."""

import re

import pytest

from day18_zero import formulas as zero_formulas
from day22_megatron import planner
from day22_megatron.step_model import GB, StepModel
from day28_gpt125m import compare
from dtl import registry
from dtl.model import num_params
from dtl.script_server import run_script


def test_zero3_sends_three_passes_of_bf16_parameters_on_every_micro_step():
    """compare.zero3_traffic_bytes alone (no memory model): day 18's ZeRO-3 volume, 3Ψ(N-1)/N
    bf16 elements, on every micro-step; a count of two passes once per step is far too small."""
    psi = num_params(compare.MODELS["gpt-6.6b"])
    micro_steps = 4_194_304 // (4096 * 1 * 16)  # tokens / (seq_len x micro-batch x GPUs): 64
    per_micro_step = zero_formulas.comm_bytes_per_rank(psi, 16, 3, 2)
    sent = compare.zero3_traffic_bytes(psi, 16, micro_steps)
    assert sent == pytest.approx(micro_steps * per_micro_step)
    once = 2 * 2 * psi * 15 / 16  # 2 x 2Ψ(N-1)/N once per step: 64 x 3/2 = 96 times too small
    assert sent / once == pytest.approx(96)
    # gpt3-125m on 8 GPUs, 4 micro-steps: 24Ψ(N-1)/N bytes; one rank alone sends nothing
    small = num_params(compare.MODELS["gpt3-125m"])
    assert compare.zero3_traffic_bytes(small, 8, 4) == pytest.approx(24 * small * 7 / 8)
    assert compare.zero3_traffic_bytes(small, 1, 4) == 0


def test_the_zero3_row_counts_every_micro_step_and_crosses_infiniband_past_a_node():
    model = compare.MODELS["gpt-6.6b"]
    row = compare.zero3_row("gpt-6.6b", 16, compare.Config())
    assert row["m"] == 64  # micro-batch 1 of 4096 tokens: 4,194,304 / (4096 x 16)
    want = compare.zero3_traffic_bytes(num_params(model), 16, row["m"])
    assert row["comm_gb"] * GB == pytest.approx(want)
    # 16 GPUs span two nodes of 8: the traffic crosses InfiniBand at 50 GB/s
    assert row["comm_s"] == pytest.approx(row["comm_gb"] / 50)


def test_the_usable_memory_fraction_decides_what_fits_in_both_scripts():
    # gpt-6.6b's ZeRO-3 needs 45.7 GB per GPU on 8: inside 50 GB, not inside 90% of it
    for fraction, fits in ((1.0, True), (0.9, False)):
        cfg = compare.Config(models="gpt-6.6b", gpus="8", gpu_memory_gb=50,
                             usable_memory_fraction=fraction)  # fmt: skip
        zero3 = next(r for r in compare.compare(cfg) if r["strategy"] == "zero3")
        assert zero3["fits"] is fits
    # day 22: DP 8 needs 68.7 GB of an 80 GB GPU, so 90% of it fits DP 8, 85% does not
    picks = {}
    for fraction in (0.9, 0.85):
        _, rows, best = planner.plan_for(
            planner.PlanConfig(usable_memory_fraction=fraction), "gpt-6.6b", 8
        )
        assert best["memory_gb"] <= 80 * fraction
        picks[fraction] = best["layout"]
    assert picks == {0.9: "tp1-pp1-dp8", 0.85: "tp1-pp2-dp4"}


def test_each_step_model_input_moves_the_step_time():
    base = compare.zero3_row("gpt-6.6b", 16, compare.Config())  # traffic-bound across nodes
    assert base["step_s"] == pytest.approx(base["comm_s"]) and base["comm_s"] > base["compute_s"]
    slower_ib = compare.zero3_row("gpt-6.6b", 16, compare.Config(ib_gbs=25))
    assert slower_ib["step_s"] == pytest.approx(2 * base["step_s"])
    no_overlap = compare.zero3_row("gpt-6.6b", 16, compare.Config(overlap_fraction=0))
    assert no_overlap["step_s"] == pytest.approx(base["compute_s"] + base["comm_s"])
    # on one node the traffic hides behind compute: the step is compute, and MFU scales it
    inside = compare.zero3_row("gpt-6.6b", 8, compare.Config())
    faster = compare.zero3_row("gpt-6.6b", 8, compare.Config(mfu=0.5))
    assert faster["step_s"] == pytest.approx(inside["step_s"] * 0.4 / 0.5)
    # day 22's DP traffic obeys the same overlap: exposed in full when nothing overlaps
    lay = planner.layouts_of(planner.MODELS["gpt-6.6b"], 64, 8)[0]  # tp1-pp1-dp64
    kw = dict(tokens=4_194_304, b=1, per_node=8)
    hidden = planner.evaluate(planner.MODELS["gpt-6.6b"], lay, step=StepModel(), **kw)
    exposed = planner.evaluate(planner.MODELS["gpt-6.6b"], lay, step=StepModel(overlap=0), **kw)
    assert hidden["step_s"] == pytest.approx(hidden["compute_s"])
    assert exposed["step_s"] == pytest.approx(hidden["compute_s"] + hidden["dp_s"])


def test_partial_overlap_hides_its_share_of_the_traffic_up_to_the_compute():
    half = StepModel(overlap=0.5)
    assert half.exposed_s(10.0, 3.0) == pytest.approx(7.0)  # 5 s could hide, 3 s of compute do
    assert half.exposed_s(4.0, 3.0) == pytest.approx(2.0)  # 2 s hide
    assert StepModel().exposed_s(4.0, 3.0) == pytest.approx(1.0)  # today's: all, up to compute


def test_the_run_writes_a_png_and_the_summary_lines_lessons_toml_expects(tmp_path):
    run = run_script("day28_gpt125m.compare", "--measured=false", "--plot_gpus=8,16,32",
                     f"--out_dir={tmp_path}", merge=True)  # fmt: skip
    assert run.code == 0, run.stdout
    png = (tmp_path / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    lesson = next(lesson for lesson in registry.load() if lesson.day == 28)
    expect = next(r for r in lesson.runs if r.name == "compare").expect
    lines = run.stdout.splitlines()
    for pattern in expect:
        assert any(re.search(pattern, line) for line in lines), pattern
    assert "| fits 68.0 GB |" in run.stdout  # the table's header states the usable memory


def test_simulated_zero3_sends_compare_py_traffic_per_step_not_once_per_step():
    """Rank 0 of 8 under hand ZeRO-3 (dtl.simulate) over gpt3-125m's configured 4 micro-steps
    sends compare.py's zero3_traffic_bytes (to the bucket padding), and holds fit.py's 16Ψ/N:
    the old once-per-step count, 2 x 2Ψ(N-1)/N bytes, is a sixth of what was sent (3Ψ(N-1)/N
    bf16 elements per micro-step, 4 micro-steps: 24Ψ(N-1)/N bytes) and fails."""
    from day28_gpt125m import scale

    row = scale.zero3_row("gpt3-125m", 8)
    assert row["m"] == 4
    assert row["traffic_sim"] == pytest.approx(row["traffic_formula"], rel=1e-5)
    old = 2 * 2 * num_params(compare.MODELS["gpt3-125m"]) * 7 / 8
    assert row["traffic_sim"] / old == pytest.approx(6, rel=1e-5)
    assert row["state_sim"] == pytest.approx(row["state_formula"], rel=1e-5)
