"""The notes as a reader meets them (no processes, no torch; well under 1 s).

- The root README reaches day 15's first command within its first 40 lines, and its map lists
  every day of lessons.toml.
- Every day opens with Goal, From yesterday and The core; the core path (dtl.notes.core) holds
  at most dtl.notes.CORE_WORDS words of prose and names the day's own test command; what follows
  is depth, in the template's order, with at least one `## Deep dive: <topic>`.
- "Check yourself" asks questions, each with its answer folded below it.
- A paragraph that repeats figures of an output block holds only figures that block printed
  (dtl.notes.stray_figures), and each day's core quotes a block and cites it.
"""

import os
import re

import pytest

from dtl import course_map, notes, registry

ROOT = registry.REPO_ROOT
LESSONS = registry.load()
DAY_NOTES = {x.day: os.path.join(ROOT, x.package, "README.md") for x in LESSONS}
IDS = [f"day{d}" for d in DAY_NOTES]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_the_front_door_reaches_day_15s_first_command_within_40_lines():
    head = "\n".join(_read(course_map.README).splitlines()[:40])
    first = LESSONS[0].runs[0]
    assert first.cpu in head, f"`{first.cpu}` is not in the root README's first 40 lines"


def test_the_map_lists_every_day_with_its_notes():
    text = _read(course_map.README)
    assert course_map.render_readme(text, LESSONS) == text, "run `make readme` to regenerate it"
    the_map = text.split(course_map.MAP_BEGIN)[1].split(course_map.MAP_END)[0]
    for lesson in LESSONS:
        assert f"]({lesson.package}/README.md)" in the_map, f"day {lesson.day} is not on the map"


@pytest.mark.parametrize("day", DAY_NOTES, ids=IDS)
def test_a_day_opens_with_the_bridge_and_a_core_path_then_its_depth(day):
    titles = [s.title for s in notes.sections(_read(DAY_NOTES[day]))]
    assert tuple(titles[: len(notes.OPENING)]) == notes.OPENING, titles
    rest = [t.split(":")[0] if t.startswith(notes.DEEP_DIVE) else t for t in titles[3:]]
    unknown = [t for t in rest if t not in notes.AFTER_CORE]
    assert not unknown, f"headings outside the template: {unknown}"
    order = [notes.AFTER_CORE.index(t) for t in rest]
    assert order == sorted(order), f"out of the template's order: {rest}"
    assert "Deep dive" in rest, "the depth goes in `## Deep dive: <topic>` sections"


@pytest.mark.parametrize("day", DAY_NOTES, ids=IDS)
def test_the_core_path_fits_in_about_15_minutes(day):
    core = notes.core(_read(DAY_NOTES[day]))
    words, fenced = notes.prose_words(core), notes.fenced_lines(core)
    assert words <= notes.CORE_WORDS, f"day {day}'s core has {words} words of prose"
    assert fenced <= notes.CORE_FENCED_LINES, f"day {day}'s core has {fenced} fenced lines"
    assert f"make test DAY={day}" in core, "the core names the day's own test command"


@pytest.mark.parametrize("day", DAY_NOTES, ids=IDS)
def test_check_yourself_asks_questions_with_the_answers_folded(day):
    (check,) = [s for s in notes.sections(_read(DAY_NOTES[day])) if s.title == "Check yourself"]
    questions = re.findall(r"^\d+\. .*\?", check.text, re.M)
    answers = re.findall(r"<details><summary>Answer</summary>", check.text)
    assert len(questions) >= 3, "at least three questions"
    assert len(answers) == len(questions), f"{len(questions)} questions, {len(answers)} answers"


@pytest.mark.parametrize("day", DAY_NOTES, ids=IDS)
def test_prose_figures_are_the_figures_of_the_block_they_cite(day):
    text = _read(DAY_NOTES[day])
    assert not notes.stray_figures(text)
    cited_in_core = {name for name, _ in notes.cited_paragraphs(notes.core(text))}
    assert cited_in_core & set(notes.output_blocks(notes.core(text))), (
        "the core quotes what its command prints and reads it in a cited paragraph"
    )


NOTE = """# Day 99 · x

## Goal
g

## From yesterday
y

## The core
Run it:

<!-- output: run -->
```
step 278 ms = fwd 63 + bwd 142 ms; overlap 50%, 8% of busy time; 24.56 MiB; x4.5
```

<!-- figures: run -->
The step took 278 ms, 142 ms of it backward; only 8% overlapped, 24.56 MiB, a ×4.5 gap.

## Check yourself
"""


def test_the_figure_check_catches_a_changed_figure_and_a_missing_block():
    assert notes.stray_figures(NOTE) == []
    assert notes.stray_figures(NOTE.replace("took 278 ms", "took 279 ms")) == ["run: 279"]
    assert notes.stray_figures(NOTE.replace("only 8%", "only 9%")) == ["run: 9"]
    assert notes.stray_figures(NOTE.replace("24.56 MiB,", "24.57 MiB,")) == ["run: 24.57"]
    assert notes.stray_figures(NOTE.replace("figures: run", "figures: nope")) == [
        "nope: no such block"
    ]
    assert notes.prose_words(notes.core(NOTE)) == 30  # headings and prose, not the block
    assert [s.title for s in notes.sections(NOTE)][-1] == "Check yourself"
