"""The exercises' data: each day's exercises.toml, and the regions of the course's code they mark.

An exercise is one or more regions of the course's own code, each between two marker lines:

        # exercise <id>: begin
        y = F.linear(x, self.weight, self.bias)   # the reader's work
        # exercise <id>: end

Everything outside the markers (the signature, the docstring, the shapes in the comments, what
the collective moves) is what the reader sees. A started exercise has each region replaced by a
stub, one line that raises and says whose work it is. Standard library only: the reader's tool
runs when the course's own code is half written.

Each day declares its exercises once, beside its code, in dayNN_topic/exercises.toml:

    [[exercise]]
    id       day<NN>.<name>: the markers' name
    day      the day whose notes explain it
    title    what the reader writes, in a few words
    graders  pytest node ids (a function's id covers all its parameters); the first is the one
             that discriminates, in seconds, on 2 ranks, without DeepSpeed or megatron-core
    hint     a sentence or two that unblocks without giving the code away
    lines    about how many lines the reader writes
    needs    other exercises whose stubs also fail these graders (the code builds on theirs)

The function that holds a region carries `@exercise("ID")` (dtl.exercise_seam), the seam
through which `grade --impl` takes the reader's own module instead.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECLARATIONS = "exercises.toml"  # in each day's folder
CODE_DIRS = ("dtl",)  # and every day*/ folder
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# exercise (?P<id>[\w.]+): begin[ \t]*$")
END = re.compile(r"^[ \t]*# exercise (?P<id>[\w.]+): end[ \t]*$")
STUB = 'raise NotImplementedError("exercise {id}: yours to write (see {notes}, Exercises)")'


class ExerciseError(ValueError):
    """Bad input to the exercise tool: said in one line."""


@dataclass(frozen=True)
class Exercise:
    id: str
    day: int
    title: str
    graders: list[str]  # pytest node ids; the first is the discriminating one
    hint: str
    lines: int  # about how many lines the reader writes
    needs: list[str] = field(default_factory=list)  # exercises whose stubs also fail these graders

    @property
    def notes(self) -> str:
        package = next(d for d in os.listdir(ROOT) if d.startswith(f"day{self.day}_"))
        return f"{package}/README.md"


def declaration_files() -> list[str]:
    days = [d for d in sorted(os.listdir(ROOT)) if re.fullmatch(r"day\d\d_\w+", d)]
    return [p for d in days if os.path.exists(p := os.path.join(ROOT, d, DECLARATIONS))]


def load() -> dict[str, Exercise]:
    out = {}
    for path in declaration_files():
        with open(path, "rb") as f:
            entries = tomllib.load(f).get("exercise", [])
        for entry in entries:
            ex = Exercise(**entry)
            if ex.id in out:
                raise ExerciseError(f"{ex.id} is declared twice")
            if not ex.graders:
                raise ExerciseError(f"{path}: {ex.id} has no grader")
            out[ex.id] = ex
    for ex in out.values():
        unknown = [n for n in ex.needs if n not in out]
        if unknown:
            raise ExerciseError(f"{ex.id} needs unknown {', '.join(unknown)}")
    return out


def find(exercises: dict[str, Exercise], exercise_id: str) -> Exercise:
    if exercise_id in exercises:
        return exercises[exercise_id]
    close = difflib.get_close_matches(exercise_id, list(exercises), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `list` shows them all"
    raise ExerciseError(f"no exercise {exercise_id!r}{hint}")


@dataclass
class Region:
    path: str  # relative to the repository root
    begin: int  # index of the begin marker's line
    end: int  # index of the end marker's line
    indent: str
    body: str  # the lines between the markers, newline-terminated

    def stub(self, ex: Exercise) -> str:
        return self.indent + STUB.format(id=ex.id, notes=ex.notes) + "\n"


def code_files() -> list[str]:
    out = []
    for top in sorted(os.listdir(ROOT)):
        if top in CODE_DIRS or re.fullmatch(r"day\d\d_\w+", top):
            for folder, _, files in os.walk(os.path.join(ROOT, top)):
                out += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return [os.path.relpath(p, ROOT) for p in out]


def _read(path: str) -> list[str]:
    with open(os.path.join(ROOT, path)) as f:
        return f.read().splitlines(keepends=True)


def regions_in(path: str, lines: list[str] | None = None) -> dict[str, list[Region]]:
    """id -> its regions in one file (or in `lines`, that file's text at another time), in
    order; a begin without its end is an error."""
    out: dict[str, list[Region]]
    lines, out, open_at = _read(path) if lines is None else lines, {}, None
    for i, line in enumerate(lines):
        if m := BEGIN.match(line):
            if open_at is not None:
                raise ExerciseError(f"{path}:{i + 1}: a begin marker inside another region")
            open_at = (i, m.group("id"), m.group("indent"))
        elif m := END.match(line):
            if open_at is None or open_at[1] != m.group("id"):
                raise ExerciseError(f"{path}:{i + 1}: end marker of {m.group('id')} without begin")
            start, eid, indent = open_at
            body = "".join(lines[start + 1 : i])
            out.setdefault(eid, []).append(Region(path, start, i, indent, body))
            open_at = None
    if open_at is not None:
        raise ExerciseError(f"{path}:{open_at[0] + 1}: region {open_at[1]} has no end marker")
    return out


def all_regions() -> dict[str, list[Region]]:
    out: dict[str, list[Region]] = {}
    for path in code_files():
        for eid, regions in regions_in(path).items():
            out.setdefault(eid, []).extend(regions)
    return out


def regions_of(ex: Exercise) -> list[Region]:
    found = all_regions().get(ex.id)
    if not found:
        raise ExerciseError(f"exercise {ex.id} has no region in the code (markers missing)")
    return found


def write_bodies(ex: Exercise, bodies: list[str]) -> None:
    """Put `bodies` (one per region, in order) between the markers of `ex`'s regions."""
    regions = regions_of(ex)
    if len(bodies) != len(regions):
        raise ExerciseError(f"exercise {ex.id}: {len(regions)} regions, {len(bodies)} bodies")
    for path in dict.fromkeys(r.path for r in regions):
        lines = _read(path)
        mine = [(r, b) for r, b in zip(regions, bodies) if r.path == path]
        for region, body in sorted(mine, key=lambda rb: -rb[0].begin):  # bottom up: indices hold
            lines[region.begin + 1 : region.end] = [body] if body else []
        with open(os.path.join(ROOT, path), "w") as f:
            f.write("".join(lines))
