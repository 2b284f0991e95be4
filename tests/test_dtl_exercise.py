"""The exercise tool (dtl.exercise) on a small course of its own, and the real exercises' data.

A reader's work is never lost: `start` refuses a region the reader changed, `reset` and
`solution` keep the reader's version aside. Bad input is one line. The grader folds pytest's
cases into one line per grader. The declared exercises match the marked regions, every grader
names a test that exists, and every day has graded exercises.
"""

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from dtl import exercise as tool
from dtl import exercise_proof as proof
from dtl import exercise_regions as er
from dtl import exercise_seam, registry

LESSON = '''\
def add(a, b):
    """a + b, the reader's to write."""
    # exercise day99.add: begin
    return a + b
    # exercise day99.add: end
'''
GRADER = """\
from day99_toy.lesson import add


def test_add():
    assert add(2, 3) == 5
"""
REGISTRY = """\
[[exercise]]
id = "day99.add"
day = 99
title = "add two numbers"
graders = ["tests/test_toy.py::test_add"]
hint = "the plus sign"
lines = 1
"""


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course of one day and one exercise, in git (the course's code is its HEAD)."""
    (tmp_path / "day99_toy").mkdir()
    (tmp_path / "day99_toy" / "__init__.py").write_text("")
    (tmp_path / "day99_toy" / "lesson.py").write_text(LESSON)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_toy.py").write_text(GRADER)
    (tmp_path / "day99_toy" / "exercises.toml").write_text(REGISTRY)
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t",
                                               "commit", "-qm", "course"]):  # fmt: skip
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True)
    monkeypatch.setattr(er, "ROOT", str(tmp_path))
    monkeypatch.setattr(tool, "STATE", str(tmp_path / ".exercises"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def _lesson(course) -> str:
    return (course / "day99_toy" / "lesson.py").read_text()


def _write_region(course, body: str) -> None:
    text = _lesson(course)
    begin, end = (
        text.index("# exercise day99.add: begin\n"),
        text.index("    # exercise day99.add: end"),
    )
    begin += len("# exercise day99.add: begin\n")
    (course / "day99_toy" / "lesson.py").write_text(text[:begin] + body + text[end:])


def test_start_stubs_the_region_and_a_second_start_is_one_line(course):
    ex = er.find(er.load(), "day99.add")
    assert tool.state(ex).name == "not started"
    tool.start(ex)
    assert 'raise NotImplementedError("exercise day99.add: yours to write' in _lesson(course)
    assert '"""a + b, the reader\'s to write."""' in _lesson(course)  # the rest stays
    with pytest.raises(er.ExerciseError, match="already started"):
        tool.start(ex)


def test_the_readers_work_survives_start_reset_and_solution(course):
    ex = er.find(er.load(), "day99.add")
    tool.start(ex)
    _write_region(course, "    return b + a  # mine\n")
    assert tool.state(ex).name == "yours"
    with pytest.raises(er.ExerciseError, match="holds your own changes"):
        tool.start(ex)  # never overwrites the reader's region
    said = tool.reset(ex)
    kept = course / said.split("your version is in ")[1]
    assert "return b + a  # mine" in kept.read_text() and "raise NotImplementedError" in _lesson(
        course
    )
    _write_region(course, "    return b + a  # mine, again\n")
    said = tool.solution(ex)
    assert "    return a + b\n" in _lesson(course)
    assert "mine, again" in (course / said.split("yours is in ")[1]).read_text()
    assert tool.state(ex).name == "solution"


def test_a_region_changed_by_hand_before_start_is_refused(course):
    ex = er.find(er.load(), "day99.add")
    _write_region(course, "    return 5\n")  # edited without `start`: git's HEAD says so
    assert tool.state(ex).name == "yours"
    with pytest.raises(er.ExerciseError, match="holds your own changes"):
        tool.start(ex)


def test_bad_input_is_one_line(course, capsys):
    assert tool.main(["start", "day99.ad"]) == 2
    assert capsys.readouterr().err == "error: no exercise 'day99.ad'; did you mean day99.add?\n"
    assert tool.main(["grade"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    tool.main(["start", "day99.add"])
    _write_region(course, "    return a +\n")  # a file that no longer parses
    assert tool.main(["grade", "day99.add"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: day99_toy/lesson.py:4:") and err.count("\n") == 1


def test_grade_says_fail_on_the_stub_and_pass_on_the_solution_and_progress_keeps_it(course):
    ex = er.find(er.load(), "day99.add")
    tool.start(ex)
    ok, lines = tool.grade(ex)
    head, why = lines[0].splitlines()
    assert not ok and head == "FAIL  tests/test_toy.py::test_add"
    assert "NotImplementedError: exercise day99.add: yours to write" in why
    result = tool.run_graders(ex.graders)[0]
    assert proof.honest_failure(result, ex)  # failed by the stub's own error
    _write_region(course, "    return a + b\n")
    ok, lines = tool.grade(ex)
    assert ok and lines[0] == "PASS  tests/test_toy.py::test_add"
    assert tool.progress_lines(er.load())[0].startswith("1 of 1 exercises passed")


def test_a_grader_that_fails_for_another_reason_proves_nothing(course):
    ex = er.find(er.load(), "day99.add")
    (course / "tests" / "test_toy.py").write_text(
        "import no_such_module\n\ndef test_add():\n    pass\n"
    )
    (result,) = tool.run_graders(ex.graders)
    assert result.outcome == "error" and not proof.honest_failure(result, ex)


def test_the_proof_fails_when_a_grader_stops_failing_on_its_stub(course, capsys):
    assert proof.main(["--only", "day99.add"]) == 0
    assert "(mutation score 100%)" in capsys.readouterr().out
    (course / "tests" / "test_toy.py").write_text(  # the planted bug: its assertion removed
        "from day99_toy.lesson import add\n\n\ndef test_add():\n    pass\n"
    )
    assert proof.main(["--only", "day99.add"]) == 1
    out = capsys.readouterr().out
    assert "stub NOT caught by tests/test_toy.py::test_add: pass" in out
    assert "(mutation score 0%)" in out
    assert "def add(a, b)" in _lesson(course) and "return a + b" in _lesson(course)  # put back


def test_the_seam_takes_a_readers_module(course, monkeypatch):
    (course / "mine.py").write_text("def add(a, b):\n    return 40 + 2\n")
    monkeypatch.setenv(exercise_seam.IMPL_ENV, "day99.add=mine")
    sys.path.insert(0, str(course))
    try:
        namespace = {}
        exec("def add(a, b):\n    return a + b\n", namespace)  # a module-level function
        seamed = exercise_seam.exercise("day99.add")(namespace["add"])
        assert exercise_seam.reader_name(namespace["add"]) == "add"
        assert seamed(1, 1) == 42
        untouched = exercise_seam.exercise("day99.other")(lambda a, b: a + b)
        assert untouched(1, 1) == 2
    finally:
        sys.path.remove(str(course))


# --- the real exercises ------------------------------------------------------------------------


def test_every_region_is_declared_and_every_exercise_is_marked():
    exercises, regions = er.load(), er.all_regions()
    assert set(exercises) == set(regions)
    for ex in exercises.values():
        assert ex.id.startswith(f"day{ex.day}.") and ex.lines >= 1 and ex.hint


def test_every_grader_names_a_test_that_exists():
    for ex in er.load().values():
        for grader in ex.graders:
            path, _, name = grader.partition("::")
            with open(os.path.join(registry.REPO_ROOT, path)) as f:
                tests = {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)}
            assert name.split("[")[0] in tests, f"{ex.id}: {grader}"


def test_each_exercise_says_where_its_stub_points():
    for ex in er.load().values():
        assert os.path.exists(os.path.join(registry.REPO_ROOT, ex.notes))
        stub = er.regions_of(ex)[0].stub(ex)
        compile(textwrap.dedent(stub), "<stub>", "exec")  # a stub is one valid statement


def test_every_day_has_graded_exercises_thirty_in_all():
    exercises = er.load()
    per_day = {x.day: sum(e.day == x.day for e in exercises.values()) for x in registry.load()}
    assert all(n >= 2 for n in per_day.values()), per_day
    assert len(exercises) >= 30
