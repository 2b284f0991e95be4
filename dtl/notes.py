"""How a day's notes are laid out, so that a test and the README's map can read them.

Every day's README.md has this shape (the headings are the markers):

    # Day NN · title
    ## Goal                 what you can do by the end, in a few lines
    ## From yesterday       the bridge from the day before
    ## The core             the one idea, the one picture, the one command, what to look for,
                            what to read in the code, and the day's own test command
    ## ...                  everything from here on is depth: Check yourself, Exercises,
                            `## Deep dive: <topic>` sections, Read the code, How the tests
                            check this, Pitfalls, References

The core path is everything above the first `## ` heading after "The core": at most CORE_WORDS
words of prose (fenced blocks are counted apart, in lines), so a reader finishes it in about
15 minutes, the run included.

Quoted output: a fenced block with `<!-- output: NAME -->` on the line above it is what a run
printed. A paragraph that repeats its figures starts with `<!-- figures: NAME -->`; every
figure in that paragraph (a number with a decimal point or a unit: 278 ms, 8%, 24.56 MiB, ×4.5)
must then appear among the block's numbers, so the prose and the block cannot drift apart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

CORE_WORDS = 1500  # the core path's prose, at most
CORE_FENCED_LINES = 80  # the core's commands and output blocks, at most
WORDS_PER_MINUTE = 150  # technical prose read with care, beside the code
# the headings that open a day, in this order; the core is the last of them
OPENING = ("Goal", "From yesterday", "The core")
# what may follow the core (besides `Deep dive: <topic>`), in this order
AFTER_CORE = (
    "Check yourself",
    "Exercises",
    "Deep dive",
    "Read the code",
    "How the tests check this",
    "Pitfalls",
    "References",
)
DEEP_DIVE = "Deep dive: "

FENCE = re.compile(r"^(```|~~~)")
COMMENT = re.compile(r"<!--.*?-->", re.S)
OUTPUT_MARK = re.compile(r"^<!-- output: ([\w.-]+) -->\s*$")
FIGURES_MARK = re.compile(r"<!-- figures: ([\w.-]+) -->")
NUMBER = re.compile(r"(?<![\d.,])\d[\d,]*(?:\.\d+)?")
# a figure: a number with a decimal point, or an integer with a unit after it
UNIT = r"\s?(?:%|ms\b|µs|us\b|s\b|[KMGT]i?B\b|kB\b|B\b|x\b|×|tok/s|tokens/s|GFLOP)"
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*\.\d+|\d[\d,]*(?=" + UNIT + r"))")


@dataclass(frozen=True)
class Section:
    title: str  # the `## ` heading's text
    text: str  # from the heading to the next `## ` heading


def sections(note: str) -> list[Section]:
    """The note's `## ` sections in order (the title and text above the first one dropped);
    a `## ` line inside a fenced block is not a heading."""
    out, title, lines = [], None, []
    for line, fenced in _lines(note):
        if line.startswith("## ") and not fenced:
            if title is not None:
                out.append(Section(title, "\n".join(lines)))
            title, lines = line[3:].strip(), [line]
        elif title is not None:
            lines.append(line)
    if title is not None:
        out.append(Section(title, "\n".join(lines)))
    return out


def _lines(note: str) -> Iterator[tuple[str, bool]]:
    """(line, inside a fenced block?) for every line; the fences themselves count as inside."""
    inside = False
    for line in note.splitlines():
        if FENCE.match(line):
            inside = not inside
            yield line, True
            continue
        yield line, inside


def core(note: str) -> str:
    """The core path: from the top of the note to the end of its "The core" section."""
    parts = sections(note)
    titles = [s.title for s in parts]
    head = note.split("\n## ", 1)[0] if parts else note
    if "The core" not in titles:
        return head
    return "\n".join([head, *(s.text for s in parts[: titles.index("The core") + 1])])


def prose_words(text: str) -> int:
    """Words of prose: fenced blocks, HTML comments and table rules left out."""
    prose = "\n".join(line for line, fenced in _lines(COMMENT.sub("", text)) if not fenced)
    return len([w for w in prose.split() if re.search(r"\w", w)])


def fenced_lines(text: str) -> int:
    """Lines inside fenced blocks (the fences themselves not counted)."""
    return sum(1 for line, fenced in _lines(text) if fenced and not FENCE.match(line))


def reading_minutes(words: int) -> int:
    return max(1, math.ceil(words / WORDS_PER_MINUTE))


def output_blocks(note: str) -> dict[str, str]:
    """NAME -> the fenced block below each `<!-- output: NAME -->`."""
    lines, blocks = note.splitlines(), {}
    for i, line in enumerate(lines):
        m = OUTPUT_MARK.match(line.strip())
        if not m:
            continue
        if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
            raise ValueError(f"<!-- output: {m.group(1)} --> is not right above a fenced block")
        if m.group(1) in blocks:
            raise ValueError(f"two output blocks are named {m.group(1)}")
        end = next(j for j in range(i + 2, len(lines)) if FENCE.match(lines[j]))
        blocks[m.group(1)] = "\n".join(lines[i + 2 : end])
    return blocks


def cited_paragraphs(note: str) -> list[tuple[str, str]]:
    """(block NAME, paragraph) for every paragraph that opens with `<!-- figures: NAME -->`."""
    text = "\n".join(line for line, fenced in _lines(note) if not fenced)
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        m = FIGURES_MARK.match(paragraph.strip())
        if m:
            out.append((m.group(1), paragraph.strip()[m.end() :]))
    return out


def figures(text: str) -> list[str]:
    """The figures of a piece of prose (numbers with a decimal point or a unit), commas dropped;
    what sits inside backticks (code, flags) is not a figure."""
    plain = re.sub(r"`[^`]*`", " ", COMMENT.sub(" ", text))
    return [m.group(1).replace(",", "") for m in FIGURE.finditer(plain)]


def numbers(text: str) -> set[str]:
    """Every number in a block, commas dropped, with and without trailing zeros after a point."""
    out = set()
    for n in NUMBER.findall(text):
        n = n.replace(",", "")
        out.add(n)
        if "." in n:
            out.add(n.rstrip("0").rstrip("."))
    return out


def stray_figures(note: str) -> list[str]:
    """'NAME: figure' for every figure of a citing paragraph its block does not hold, and
    'NAME: no such block' for a citation of a block that is not there."""
    blocks, bad = output_blocks(note), []
    for name, paragraph in cited_paragraphs(note):
        if name not in blocks:
            bad.append(f"{name}: no such block")
            continue
        held = numbers(blocks[name])
        bad += [f"{name}: {f}" for f in figures(paragraph) if f not in held]
    return bad
