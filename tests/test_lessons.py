"""Every CPU launch line in lessons.toml runs, exits 0 and prints its summary lines.

This is what keeps the README honest: a documented launch line is a tested launch line.
"""

import glob
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import time

import pytest

from dtl import config as dtl_config
from dtl import course_map, exercise_regions, extras, registry, tour
from dtl.script_server import run_script

LESSONS = registry.load()
RUNS = [(lesson, run) for lesson in LESSONS for run in lesson.runs]


@pytest.mark.launch
@pytest.mark.parametrize("lesson, run", RUNS, ids=[f"day{x.day}-{r.name}" for x, r in RUNS])
def test_cpu_launch_line_runs_and_prints_its_summary(lesson, run):
    # a benchmark runs as documented but shrunk by its smoke_args (they override the config)
    result = registry.execute(lesson, run, extra_args=run.smoke_args, prewarmed=True)
    line = f"{run.cpu} {run.smoke_args}".strip()
    tail = "\n".join(result.output.splitlines()[-25:])
    if result.status == "SKIP":  # e.g. DataParallel without 2 GPUs: said, not passed
        pytest.skip(f"`{line}` skipped itself: {result.skip_reason}")
    assert result.returncode == 0, f"`{line}` exited {result.returncode}:\n{tail}"
    assert not result.missing, f"`{line}` did not print {result.missing}:\n{tail}"
    assert result.summary_lines(), "a lesson run must print at least one `summary:` line"


def test_the_list_of_launch_lines_is_generated_from_the_registry():
    with open(course_map.LESSONS_DOC) as f:
        text = f.read()
    assert course_map.TABLE_BEGIN in text and course_map.TABLE_END in text
    assert course_map.render_lessons_doc(text, LESSONS) == text, "run `make readme`"


@pytest.mark.parametrize("lesson", LESSONS, ids=[f"day{x.day}" for x in LESSONS])
def test_every_lesson_has_notes_and_launch_lines_that_name_real_modules(lesson):
    assert importlib.util.find_spec(lesson.package) is not None
    spec = importlib.util.find_spec(lesson.package)
    notes = spec.submodule_search_locations[0] + "/README.md"
    with open(notes) as f:
        assert len(f.read()) > 2000, f"{notes} is too short to be the day's notes"
    for run in lesson.runs:
        for line in (run.cpu, run.gpu):
            words = shlex.split(line)
            assert words[0] == "torchrun" and "--standalone" in words
            module = words[words.index("-m") + 1]
            assert importlib.util.find_spec(module) is not None, module
        for pattern in (*run.expect, *(run.gpu_expect or ())):
            re.compile(pattern)


REGISTRY_ENTRY = """
[[lesson]]
day = 17
package = "day17_ddp"
title = "t"
idea = "i"
proves = "p"

[[lesson.run]]
name = "plan"
cpu = "torchrun --standalone --nproc_per_node=1 -m day22_megatron.plan"
gpu = "torchrun --standalone --nproc_per_node=1 -m day22_megatron.plan"
expect = ['^summary: ']
"""


def test_a_run_outside_its_lessons_package_is_refused_unless_marked_cross_day(tmp_path):
    path = tmp_path / "lessons.toml"
    path.write_text(REGISTRY_ENTRY)  # day 22's plan pasted under day 17
    with pytest.raises(ValueError, match="'plan' of day 17 launches day22_megatron, outside"):
        registry.load(str(path))
    path.write_text(REGISTRY_ENTRY + "cross_day = true\n")
    (lesson,) = registry.load(str(path))
    assert "(runs day22_megatron)" in course_map.lessons_table([lesson])  # said in docs/
    assert registry.launched_package("torchrun --nproc_per_node=2 tests/restart_worker.py") == (
        "tests"
    )


def test_the_real_registry_runs_each_line_once_under_its_own_day():
    lessons = registry.load(registry.REGISTRY)  # refuses a run outside its package
    for lesson in lessons:
        for run in lesson.runs:
            assert run.cross_day or registry.launched_package(run.cpu) == lesson.package
    lines = [run.cpu for lesson in lessons for run in lesson.runs]
    assert len(lines) == len(set(lines)), "a launch line registered twice runs twice in the tour"


def test_no_cpu_pattern_accepts_a_skipped_check():
    """On the CPU every one-process check runs: a pattern that lets "check skipped" through
    would pass a script whose check was switched off (only GPU configs may turn it off)."""
    for _, run in RUNS:
        for pattern in run.expect:
            assert "skipped" not in pattern, f"{run.name}: {pattern}"
        if "check skipped" in " ".join(run.gpu_expect or ()):
            assert "--config" in run.gpu, f"{run.name}: only a GPU config may skip the check"


def test_benchmarks_carry_smoke_args_and_lessons_shrink_only_sizes():
    for _, run in RUNS:
        if run.kind == "benchmark":
            assert run.smoke_args, run.name
            continue
        for word in shlex.split(run.smoke_args):
            key = word.removeprefix("--").split("=")[0]
            assert key in registry.SIZE_KEYS, f"{run.name}: smoke_args may set sizes only: {word}"


def test_tour_table_shows_summary_pass_fail_and_skip():
    lesson, run = RUNS[0]
    ok = registry.Result(lesson, run, 0, 3.2, "noise\nsummary: 5/5 checks passed\n", [])
    bad = registry.Result(lesson, run, 1, 9.0, "Traceback ...\n", [])
    skip = registry.Result(lesson, run, 0, 1.0, "skipped: needs 2 GPUs\n", ["^summary: x"])
    assert (ok.status, bad.status, skip.status) == ("PASS", "FAIL", "SKIP")
    text = tour.table([ok, bad, skip])
    assert "5/5 checks passed" in text and "PASS" in text
    assert "(no summary line)" in text and "FAIL" in text
    assert "skipped: needs 2 GPUs" in text and text.rstrip().endswith("SKIP")
    # a crash that printed a skip line first is still a failure
    crashed = registry.Result(lesson, run, 1, 1.0, "skipped: x\nTraceback\n", [])
    assert crashed.status == "FAIL" and not crashed.ok


def test_gpu_all_without_enough_gpus_shows_skip_with_the_reason_never_pass(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs: make gpu-all would really run the lines")
    assert tour.main(["--gpu-all", "--day", "17"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("17 ")]
    assert len(rows) == len(next(x for x in LESSONS if x.day == 17).runs)
    assert all(r.endswith("SKIP") for r in rows) and "PASS" not in out
    assert "needs 2 GPUs, this machine has 0" in out  # dataparallel's min_gpus


SCRIPTS = sorted(
    {shlex.split(r.cpu)[shlex.split(r.cpu).index("-m") + 1] for _, r in RUNS}
    | {"day16_nccl.nccl_log"}
)


@pytest.mark.parametrize("module", SCRIPTS)
def test_every_script_answers_help_before_any_process_group(module):
    out = run_script(module, "--help", timeout_s=60)
    assert out.code == 0 and out.stderr == "", out.stderr[-2000:]
    assert not out.group, f"{module} --help created a process group"
    assert out.stdout.startswith("usage: "), out.stdout[:300]
    options = [ln for ln in out.stdout.splitlines() if ln.startswith("  --") and "=" in ln]
    for line in options:  # every field: a flag, a one-line description and its default
        flag, _, doc = line.strip().partition("  ")
        assert doc.strip() and not doc.strip().startswith("(default"), f"{module}: {line}"


@pytest.mark.parametrize("prewarmed", [False, True], ids=["torchrun", "prewarmed"])
def test_a_launch_line_that_times_out_leaves_no_workers_behind(prewarmed):
    lesson = next(x for x in LESSONS if x.day == 15)
    run = next(r for r in lesson.runs if r.name == "ddp_mnist")
    slow = registry.Run(run.name, run.cpu, run.gpu, run.expect, timeout_s=5)
    result = registry.execute(lesson, slow, prewarmed=prewarmed)
    assert result.returncode == 124 and "[timed out after 5 s]" in result.output
    for _ in range(20):  # torchrun's workers live in their own sessions: they must be gone too
        alive = subprocess.run(["pgrep", "-f", "day15_collectives.ddp_mnist"], capture_output=True)
        if alive.returncode == 1:
            break
        time.sleep(0.5)
    assert alive.returncode == 1, f"orphaned workers: {alive.stdout}"


def _config_uses() -> list[tuple[str, str, list[str], int, list[str]]]:
    """(config file, module, the line's arguments, world size, the extras it needs) for every
    line that passes a `--config`: the registry's CPU and GPU lines and each config file's own
    `# Use:` line."""
    lines = [(r.cpu, 2, r.extras) for x in LESSONS for r in x.runs]
    lines += [(r.gpu, max(8, r.min_gpus), r.extras) for x in LESSONS for r in x.runs]
    for path in sorted(glob.glob(os.path.join(registry.REPO_ROOT, "day*", "*.toml"))):
        with open(path) as f:
            lines += [(line[len("# Use:") :], 2, []) for line in f if line.startswith("# Use:")]
    uses = []
    for line, gpus, needs in lines:
        words = shlex.split(line)
        if "--config" not in words:
            continue
        args = words[words.index("-m") + 2 :]
        module = words[words.index("-m") + 1]
        if "--" in args and args.index("--") < args.index("--config"):  # a wrapped script's
            module = next(a.split("=")[1] for a in args if a.startswith("--target="))
        args = args[args.index("--") + 1 :] if "--" in args else args
        procs = next(w.split("=")[1] for w in words if w.startswith("--nproc_per_node="))
        world = gpus if procs == "gpu" else int(procs)
        uses.append((args[args.index("--config") + 1], module, args, world, needs))
    return uses


def test_every_shipped_config_file_loads_into_the_script_that_names_it(tmp_path, monkeypatch):
    uses = _config_uses()
    shipped = {
        os.path.relpath(p, registry.REPO_ROOT)
        for p in glob.glob("day*/*.toml", root_dir=registry.REPO_ROOT)
        if os.path.basename(p) != exercise_regions.DECLARATIONS  # the exercises, not a config
    }
    assert shipped <= {path for path, *_ in uses}, "a config file no line or `# Use:` names"
    monkeypatch.setenv("DTL_DEVICE_MEMORY_GB", "80")  # the GPUs the gpu.toml files are sized for
    absent: set[str] = set()
    for _path, module, args, world, needs in uses:
        missing_here = extras.missing(needs)
        if missing_here:
            absent.update(missing_here)
            continue
        monkeypatch.setenv("WORLD_SIZE", str(world))
        config = importlib.import_module(module).Config
        dtl_config.load(config, [*args, f"--out_dir={tmp_path}"])  # a bad key stops it here
    if absent:  # the others loaded; these could not be asked
        pytest.skip(extras.skip_reason(sorted(absent)))
