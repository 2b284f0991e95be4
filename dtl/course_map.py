"""The course's two generated tables, both read from lessons.toml and the days' notes.

    python -m dtl.course_map --write     # `make readme`: rewrite both in place

- README.md's map: one short row per day (its idea, the core's reading time measured from the
  notes by dtl.notes, its first run, its first graded exercise from its exercises.toml).
- docs/lessons.md: every launch line, CPU and GPU, with what the day's runs prove.

Each lives between its begin and end markers; tests/test_notes_shape.py and
tests/test_lessons.py fail when either is stale.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable

from dtl import exercise_regions, notes
from dtl.registry import REPO_ROOT, Lesson, launched_package, load

README = os.path.join(REPO_ROOT, "README.md")
LESSONS_DOC = os.path.join(REPO_ROOT, "docs", "lessons.md")
MAP_BEGIN, MAP_END = "<!-- map:begin -->", "<!-- map:end -->"
TABLE_BEGIN, TABLE_END = "<!-- lessons:begin -->", "<!-- lessons:end -->"


def _notes_path(lesson: Lesson) -> str:
    return os.path.join(REPO_ROOT, lesson.package, "README.md")


def core_minutes(lesson: Lesson) -> int:
    """Minutes to read the day's core path, from its words (dtl.notes.WORDS_PER_MINUTE)."""
    with open(_notes_path(lesson)) as f:
        return notes.reading_minutes(notes.prose_words(notes.core(f.read())))


def first_run(lesson: Lesson) -> str:
    """The day's first launch line, short: `module args` and its process count."""
    words = shlex.split(lesson.runs[0].cpu)
    procs = next(w.split("=")[1] for w in words if w.startswith("--nproc_per_node="))
    module_and_args = " ".join(words[words.index("-m") + 1 :])
    return f"`{module_and_args}` ({procs} {'rank' if procs == '1' else 'ranks'})"


def first_exercise(lesson: Lesson, exercises: dict[str, exercise_regions.Exercise]) -> str:
    """The day's first graded exercise (exercises.toml order) and how many it has; or a dash."""
    mine = [e for e in exercises.values() if e.day == lesson.day]
    return f"`{mine[0].id}` (of {len(mine)})" if mine else "-"


def course_map(lessons: list[Lesson]) -> str:
    exercises = exercise_regions.load()
    rows = ["| day | the idea | core | first run | first exercise |", "|---|---|---|---|---|"]
    for lesson in lessons:
        day = f"[{lesson.day}]({lesson.package}/README.md)"
        rows.append(
            f"| {day} | {lesson.idea} | {core_minutes(lesson)} min | {first_run(lesson)} | "
            f"{first_exercise(lesson, exercises)} |"
        )
    return "\n".join(rows)


def lessons_table(lessons: list[Lesson]) -> str:
    """docs/lessons.md: per day, what its runs prove, then each run's CPU and GPU line."""
    parts = []
    for lesson in lessons:
        link = f"../{lesson.package}/README.md"
        parts += [f"### [Day {lesson.day}]({link}): {lesson.title}", "", lesson.proves, ""]
        for run in lesson.runs:
            label = f"**{run.name}**" + (" (benchmark)" if run.kind == "benchmark" else "")
            if run.cross_day:
                label += f" (runs {launched_package(run.cpu)})"
            parts += [f"- {label}", f"  - CPU: `{run.cpu}`", f"  - GPU: `{run.gpu}`"]
        parts.append("")
    return "\n".join(parts).rstrip()


def _between(text: str, begin: str, end: str, body: str) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"markers {begin} and {end} are missing")
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def render_readme(text: str, lessons: list[Lesson]) -> str:
    return _between(text, MAP_BEGIN, MAP_END, course_map(lessons))


def render_lessons_doc(text: str, lessons: list[Lesson]) -> str:
    return _between(text, TABLE_BEGIN, TABLE_END, lessons_table(lessons))


def _rewrite(path: str, render: Callable[[str, list[Lesson]], str], lessons: list[Lesson]) -> None:
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(render(text, lessons))
    print(f"{os.path.relpath(path, REPO_ROOT)} regenerated from lessons.toml")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    lessons = load()
    if argv == ["--write"]:
        _rewrite(README, render_readme, lessons)
        _rewrite(LESSONS_DOC, render_lessons_doc, lessons)
        return 0
    print(course_map(lessons))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
