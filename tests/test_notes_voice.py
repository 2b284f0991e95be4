"""The course speaks of its subject, never of its own making (no processes; well under 1 s).

A reader needs "a resumed LambdaLR writes lr only at its next step: save the groups'
hyperparameters", not the story of when that was found; "not run on a GPU", not which machine
was lent to whom. PROCESS_WORDS is the list of phrasings that tell such a story; the scan covers
the READMEs, docs/, lessons.toml, the Makefile and every .py file of the kit, the days and
tools/ (docstrings, comments and the messages a run prints).

An exception (a quotation, a name that happens to match) says so where it stands: a line that
holds `voice: quoted` is skipped, and in markdown so is the paragraph that follows it when the
marker is an HTML comment on a line of its own.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOW = "voice: quoted"

PROCESS_WORDS = [
    r"\blent\b",
    r"\bborrowed\b",
    r"\bno GPU was (?:available|lent|drawn)",
    r"\b(?:this|that|an earlier|a later|the next) session\b",
    r"\bwhile writing (?:these notes|this (?:lesson|course|note|code)|the (?:lesson|course)|`)",
    r"\bwhile the (?:lesson|course|notes?) (?:was|were) written",
    r"\b(?:was|were) written\b",
    r"\b(?:an |the )?earlier versions?\b",
    r"\b(?:an |the )?older versions? of (?:this|the) (?:code|course|lesson|notes)",
    r"\baudit(?:ed|s)?\b",
    r"\bused to\b",  # "X used to do Y"; the passive "is (then) used to" is the subject's
    r"(?:^|[.;(]\s*)(?:it|they|this|the code|the test) now\b",  # "It now builds ..."
    r"\bthe old (?:line|lines|code|count|rule|formula|version|behaviou?r|wording)\b",
    r"\bthe code did\b",
    r"\bnot (?:been )?rerun\b",
    r"\bthe then \d+\b",
    r"\bfirst formula written\b",
    r"\bwe (?:saw|found|fixed|changed|rewrote|noticed|decided)\b",
    r"\b(?:before|after|until) the fix\b",
    r"\bnot (?:been )?run on (?:a|the) GPUs? yet\b",
    r"\b(?:lines?|lessons?|GPUs?) ha(?:s|ve)(?:n't| not) (?:been )?run yet\b",
    r"\bline has run yet\b",
    r"\bwhen (?:it|this lesson|the lesson|this course) was\b",
    r"\bthe course's (?:own )?(?:gpu|audit|review|routine|history)",
    r"\b(?:a|the) reviewer\b",
    r"\bin this (?:change|commit|issue)\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in PROCESS_WORDS), re.I)
PASSIVE = {"is", "are", "be", "been", "was", "were", "being", "get", "gets", "got"}
SKIP_DIRS = {".git", ".venv", "outputs", "__pycache__", ".pytest_cache", ".ruff_cache", "tests"}


def scanned_files() -> list[str]:
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), ROOT)
            top = rel.split(os.sep)[0]
            if name.endswith(".md") or (
                name.endswith(".py") and (top in ("dtl", "tools") or top.startswith("day"))
            ):
                out.append(rel)
    return sorted(out) + ["lessons.toml", "Makefile", "pyproject.toml"]


def findings(text: str, markdown: bool) -> list[str]:
    """'line N: the matched words' for every process phrase outside an allowed exception."""
    bad, allowed_paragraph = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            allowed_paragraph = False
            continue
        if ALLOW in line:
            allowed_paragraph = markdown and line.strip().startswith("<!--")
            continue
        if allowed_paragraph:
            continue
        bad += [f"line {n}: {m.group(0)!r}" for m in PATTERN.finditer(line) if not _passive(m)]
    return bad


def _passive(m: re.Match) -> bool:
    """'used to' after is/are/was/... within two words: a thing used for a purpose."""
    before = re.findall(r"[a-z']+", m.string[: m.start()].lower())[-3:]
    return m.group(0).lower() == "used to" and bool(PASSIVE & set(before))


def test_no_passage_tells_how_the_course_was_made():
    bad = {}
    for rel in scanned_files():
        with open(os.path.join(ROOT, rel)) as f:
            found = findings(f.read(), markdown=rel.endswith(".md"))
        if found:
            bad[rel] = found
    assert not bad, f"passages about the course's making, not its subject: {bad}"


def test_the_scan_finds_a_planted_sentence_and_honours_a_quoted_exception():
    planted = "Rank 0 saves.\n\nNo GPU was lent to this session, so the figure is a model's.\n"
    assert len(findings(planted, markdown=True)) == 2
    for sentence in (
        "The wrapper used to add CUDA kernels.",
        "An earlier version counted twice.",
        "Measured while writing these notes.",
        "It now builds the tensor on the device.",
        "The GPU lines have not run yet.",
        "No GPU line has run yet.",
        "11 of the then 24 tests failed.",
    ):
        assert findings(sentence, markdown=False), sentence
    for fine in (
        "The scale is used to quantize the weights.",
        "Not run on a GPU.",
        "The writer process is killed while writing the step-3 checkpoint.",
        "The buffer is then used to hold the sums.",
        "The bucket holds it now; the model keeps no gradient.",
        "The target's init() has not run yet, so ask its rule.",
    ):
        assert not findings(fine, markdown=False), fine
    quoted = f"<!-- {ALLOW}: a PR title -->\nThe PR says: we fixed the sync.\n\nWe saw it.\n"
    assert findings(quoted, markdown=True) == ["line 4: 'We saw'"]
    assert not findings(f"x = 1  # we saw it  ({ALLOW})", markdown=False)
