"""Every summary line the notes quote is one the code prints now (no processes, no torch).

Each lesson's runs register `expect` patterns (lessons.toml) that its summary line must match.
A note that quotes `summary: dayNN ...` inside a code block quotes a run's output; when the code
changes what it prints, the quote goes stale while the prose around it still reads well. Here
every quoted summary line must match the pattern of at least one registered run: a change in a
summary's format fails until the note is regenerated from a run.
"""

import os
import re

import pytest

from dtl import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTES = ["README.md"] + sorted(
    os.path.join(d, "README.md") for d in os.listdir(ROOT) if re.fullmatch(r"day\d\d_\w+", d)
)
PATTERNS = [
    re.compile(p)
    for lesson in registry.load()
    for run in lesson.runs
    for p in (run.expect or []) + (run.gpu_expect or [])
    if p.startswith("^summary:")
]


def _quoted_summaries(note: str) -> list[tuple[int, str]]:
    """(line number, text) of every `summary: day...` line inside a fenced code block."""
    out, fenced = [], False
    with open(os.path.join(ROOT, note)) as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced and line.lstrip().startswith("summary: day"):
                out.append((number, line.strip()))
    return out


@pytest.mark.parametrize("note", NOTES)
def test_every_quoted_summary_matches_a_registered_run(note):
    stale = [
        f"{note}:{n}: {text[:120]}"
        for n, text in _quoted_summaries(note)
        if not any(p.search(text) for p in PATTERNS)
    ]
    assert not stale, "quoted summaries no registered run prints (regenerate them):\n" + "\n".join(
        stale
    )


def test_the_check_catches_a_changed_format():
    line = "summary: day21 recompute, one GPT-2-width layer per rank (none) worst 3%"
    assert not any(p.search(line) for p in PATTERNS)
