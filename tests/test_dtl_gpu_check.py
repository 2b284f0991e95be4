"""The time-boxed GPU check (dtl/gpu_check.py): its plan, its budget, and its folder."""

import os
import sys

import pytest

from dtl import gpu_check, registry, tour

PLAN = gpu_check.load_plan()


def test_the_dry_run_prints_each_line_with_its_estimate_and_the_budget(capsys):
    assert tour.main(["--gpu-check", "--budget_s=480", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "budget 480 s" in out
    for p in PLAN:  # every line as it would run, with its estimate
        assert p.line in out and f"{p.check.estimate_s:>5}s" in out
    fitting = sum(gpu_check.fits(PLAN, 480))
    assert f"{fitting} of {len(PLAN)} lines fit" in out


def test_the_plan_covers_what_only_a_gpu_can_show_and_fits_eight_minutes():
    covered = {(p.lesson.day, p.run.name) for p in PLAN}
    wanted = {
        (28, "bench-mfu"),  # GPT-2 124M MFU
        (16, "forensics"),  # a real NCCL log read
        (18, "ds-zero3"),  # ZeRO-3 at 124M (DeepSpeed)
        (24, "drills"),  # save and resume (kill_rank, on the run's backend)
        (27, "profile"),  # a profile
        (28, "fsdp2"),  # a day-28 strategy
    }
    fp8 = [p for p in PLAN if "--precision=fp8" in p.check.args]
    assert fp8, "an FP8 line: float8 matmuls on tensor cores, which a CPU only emulates"
    assert wanted <= covered, wanted - covered
    fitting = [p for p, ok in zip(PLAN, gpu_check.fits(PLAN, 480)) if ok]
    assert wanted <= {(p.lesson.day, p.run.name) for p in fitting}  # all inside 8 minutes
    assert fp8[0] in fitting
    assert sum(p.check.estimate_s for p in fitting) <= 480
    assert PLAN[0].run.name == "bench-mfu"  # the headline number comes first
    drill = next(p for p in PLAN if p.run.name == "drills")
    assert "--backend=auto" in drill.check.args  # on NCCL, not the drills' default gloo
    for p in PLAN:
        assert p.run.min_gpus == 1, f"{p.run.name}: the check runs on one GPU"
        assert p.check.why


def _planned(name: str, estimate_s: int, command: str) -> gpu_check.Planned:
    lesson = registry.Lesson(99, "day99", "t", "i", "p")
    run = registry.Run(name, command, command, expect=["^summary: "])
    return gpu_check.Planned(gpu_check.CheckLine(99, name, estimate_s, "why"), lesson, run)


def test_lines_past_the_budget_are_not_started_and_a_slow_line_is_stopped(tmp_path):
    py = sys.executable
    plan = [
        _planned("quick", 1, f"{py} -c \"print('summary: done')\""),
        _planned("too-long", 1000, f"{py} -c \"print('summary: never')\""),
        _planned("overruns", 1, f'{py} -c "import time; time.sleep(60)"'),
    ]
    results = gpu_check.run_plan(plan, budget_s=6, out_dir=str(tmp_path), n_gpus=1)
    status = [r.status for _, r in results]
    assert status == ["PASS", "SKIP", "FAIL"]
    assert "budget: ~1000 s estimated" in results[1][1].skip_reason
    assert results[2][1].returncode == 124 and results[2][1].seconds < 10  # stopped at the budget
    assert sorted(os.listdir(tmp_path)) == [
        "01-day99-quick.log", "02-day99-too-long.log", "03-day99-overruns.log"
    ]  # fmt: skip


def test_without_a_gpu_every_line_skips_and_the_folder_holds_the_summary(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would really run")
    assert tour.main(["--gpu-check", "--budget_s=60", f"--out={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "PASS" not in out.split("# GPU check")[-1].replace("passed", "")
    summary = (tmp_path / "summary.md").read_text()
    assert f"0 passed, 0 failed, {len(PLAN)} skipped" in summary
    assert "needs 1 GPU(s), this machine has 0" in summary
    assert "torch " in (tmp_path / "env.txt").read_text()
    assert (tmp_path / "plan.txt").exists()


def test_a_plan_entry_must_name_a_real_run(tmp_path):
    bad = tmp_path / "lessons.toml"
    with open(registry.REGISTRY) as f:
        entry = '\n[[gpu_check]]\nday = 15\nrun = "nope"\nestimate_s = 1\nwhy = "x"\n'
        bad.write_text(f.read() + entry)
    with pytest.raises(ValueError, match="no run 'nope' on day 15"):
        gpu_check.load_plan(str(bad))
