"""Graded exercises: write a piece of the course's own code, and the course's checks grade it.

    python -m dtl.exercise list                     every exercise by day, with its status
    python -m dtl.exercise start day19.f_and_g      its region becomes a stub: yours to write
    python -m dtl.exercise hint day19.f_and_g
    python -m dtl.exercise grade day19.f_and_g      its graders, one line each: pass or fail
    python -m dtl.exercise grade ID --impl mypkg.mymodule   grade your own module instead
    python -m dtl.exercise reset ID                 the stub again (your version kept aside)
    python -m dtl.exercise solution ID              the course's code again (yours kept aside)
    python -m dtl.exercise progress

The exercises are declared beside each day (dayNN_topic/exercises.toml) and marked in the code
(dtl.exercise_regions).
The graders are the course's own tests: a single-process reference, counted bytes, schedules
checked as data. Nothing is lost: `start` refuses a region you already changed, `reset` and
`solution` keep your version in .exercises/yours/ beside a copy of the course's code in
.exercises/solutions/, and .exercises/progress.json survives a `git pull` (git ignores the
folder). Grading sets a short collective timeout (DTL_TIMEOUT_S=20), so a stub that only some
ranks reach fails in seconds, and the first rank that raises ends the others.

--impl MODULE: write the exercise in a module of your own instead. Each function of the course
marked `@exercise_seam.exercise("ID")` is then taken from MODULE, under the name the function
has in the course (a method as Class_method: `ColumnParallelLinear_forward`).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtl import exercise_regions as er

STATE = os.path.join(er.ROOT, ".exercises")
GRADING_ENV = {"DTL_TIMEOUT_S": "20"}  # a stub some ranks never reach: seconds, not minutes
IMPL_ENV = "DTL_EXERCISE_IMPL"  # "ID=module": read by dtl.exercise_seam in every process


# --- the state kept beside the checkout -------------------------------------------------------


def _state_path(*parts: str) -> str:
    path = os.path.join(STATE, *parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _saved_solution(ex: er.Exercise) -> list[str] | None:
    path = os.path.join(STATE, "solutions", f"{ex.id}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        bodies: list[str] = json.load(f)
        return bodies


def _progress() -> dict[str, dict[str, Any]]:
    path = os.path.join(STATE, "progress.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        progress: dict[str, dict[str, Any]] = json.load(f)
        return progress


def _record(ex: er.Exercise, **fields: object) -> None:
    progress = _progress()
    progress.setdefault(ex.id, {}).update(fields, at=time.strftime("%Y-%m-%d %H:%M:%S"))
    with open(_state_path("progress.json"), "w") as f:
        json.dump(progress, f, indent=1, sort_keys=True)


def _keep_yours(ex: er.Exercise, bodies: list[str]) -> str:
    path = _state_path("yours", f"{ex.id}.{time.strftime('%Y%m%d-%H%M%S')}.py")
    with open(path, "w") as f:
        for region, body in zip(er.regions_of(ex), bodies):
            f.write(f"# {region.path}, region of {ex.id}\n{body}\n")
    return os.path.relpath(path, er.ROOT)


def _committed_bodies(ex: er.Exercise) -> list[str] | None:
    """The regions as git's HEAD has them (None outside a git checkout, or before the regions
    are committed)."""
    bodies = []
    for path in dict.fromkeys(r.path for r in er.regions_of(ex)):
        shown = subprocess.run(
            ["git", "show", f"HEAD:{path}"], cwd=er.ROOT, capture_output=True, text=True
        )
        if shown.returncode != 0:
            return None
        regions = er.regions_in(path, shown.stdout.splitlines(keepends=True)).get(ex.id, [])
        bodies += [r.body for r in regions]
    return bodies if len(bodies) == len(er.regions_of(ex)) else None  # None: not committed yet


# --- what state an exercise is in -------------------------------------------------------------


@dataclass
class State:
    name: str  # "not started", "started", "yours", "solution"
    bodies: list[str]
    stubs: list[str]
    solution: list[str] | None  # the course's code, once known


def state(ex: er.Exercise) -> State:
    regions = er.regions_of(ex)
    bodies, stubs = [r.body for r in regions], [r.stub(ex) for r in regions]
    saved = _saved_solution(ex)
    if bodies == stubs:
        return State("started", bodies, stubs, saved)
    if saved is None:
        committed = _committed_bodies(ex)
        changed = committed is not None and committed != bodies
        return State("yours" if changed else "not started", bodies, stubs, committed or bodies)
    return State("solution" if bodies == saved else "yours", bodies, stubs, saved)


# --- the commands -----------------------------------------------------------------------------


def start(ex: er.Exercise) -> str:
    now = state(ex)
    if now.name == "started":
        raise er.ExerciseError(f"{ex.id} is already started: write its region, then grade it")
    if now.name == "yours":
        raise er.ExerciseError(
            f"{ex.id}'s region holds your own changes; `reset {ex.id}` keeps them aside and "
            "puts the stub back"
        )
    with open(_state_path("solutions", f"{ex.id}.json"), "w") as f:
        json.dump(now.bodies, f)
    er.write_bodies(ex, now.stubs)
    _record(ex, status="started")
    where = ", ".join(dict.fromkeys(r.path for r in er.regions_of(ex)))
    return (
        f"{ex.id} started: write the region(s) in {where} (about {ex.lines} lines); "
        f"then `python -m dtl.exercise grade {ex.id}`"
    )


def reset(ex: er.Exercise) -> str:
    now = state(ex)
    if now.solution is None and now.name != "started":
        raise er.ExerciseError(f"{ex.id} was never started: `start {ex.id}`")
    kept = _keep_yours(ex, now.bodies) if now.name == "yours" else None
    if now.solution is not None and _saved_solution(ex) is None:
        with open(_state_path("solutions", f"{ex.id}.json"), "w") as f:
            json.dump(now.solution, f)
    er.write_bodies(ex, now.stubs)
    _record(ex, status="started")
    return f"{ex.id}: the stub is back" + (f"; your version is in {kept}" if kept else "")


def solution(ex: er.Exercise) -> str:
    now = state(ex)
    if now.solution is None:
        raise er.ExerciseError(f"{ex.id}: the course's code is not known here (never started)")
    kept = _keep_yours(ex, now.bodies) if now.name == "yours" else None
    er.write_bodies(ex, now.solution)
    _record(ex, status="solution shown")
    return f"{ex.id}: the course's code is back" + (f"; yours is in {kept}" if kept else "")


def check_parses(ex: er.Exercise) -> None:
    for path in dict.fromkeys(r.path for r in er.regions_of(ex)):
        with open(os.path.join(er.ROOT, path)) as f:
            source = f.read()
        try:
            ast.parse(source, filename=path)
        except SyntaxError as e:
            raise er.ExerciseError(f"{path}:{e.lineno}:{e.offset}: {e.msg}") from None


@dataclass
class GraderResult:
    grader: str
    outcome: str  # "pass", "fail", "error" (collection, fixture), "skip"
    message: str  # the first line of the failure, "" when it passed
    text: str = ""  # the whole failure report
    seconds: float = 0.0  # the grader's test cases, summed (pytest's own timing)


def run_graders(
    graders: list[str], env: dict[str, str] | None = None, timeout_s: float = 600
) -> list[GraderResult]:
    """Run pytest on `graders` (node ids) and fold its cases into one result per grader."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "graders.xml")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            "-o",
            "addopts=",
            *graders,
        ]
        run_env = {**os.environ, **GRADING_ENV, **(env or {})}
        proc = subprocess.run(
            cmd, cwd=er.ROOT, env=run_env, capture_output=True, text=True, timeout=timeout_s
        )
        cases = _cases(xml) if os.path.exists(xml) else []
    if not cases:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        return [GraderResult(g, "error", f"pytest ran nothing: {tail[0]}") for g in graders]
    return [_fold(g, [c for c in cases if _belongs(c[0], g)]) for g in graders]


def _cases(xml: str) -> list[tuple[str, str, str, str, float]]:
    """(node id, outcome, first line of the message, the whole report, seconds) per test case."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        outcome, message, text = "pass", "", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "fail", "error": "error", "skipped": "skip"}[kind]
                text = f"{found.get('message') or ''}\n{found.text or ''}"
                message = _headline(text)
                break
        out.append((node, outcome, message, text, float(case.get("time") or 0)))
    return out


ERROR_LINE = re.compile(r"^(?:E\s+)?((?:[\w.]+(?:Error|Exception|Failed)|assert)\b.*)$")


def _headline(text: str) -> str:
    """The line of a failure report that says what went wrong: the last `SomeError: ...` or
    `assert ...` line (a rank's traceback ends with its own), else the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = [m.group(1) for ln in lines if (m := ERROR_LINE.match(ln))]
    return (found[-1] if found else lines[0] if lines else "")[:300]


def _belongs(node: str, grader: str) -> bool:
    return node == grader or node.startswith(grader + "[")


def _fold(grader: str, cases: list[tuple[str, str, str, str, float]]) -> GraderResult:
    if not cases:
        return GraderResult(grader, "error", "no test case ran (wrong id?)")
    seconds = sum(c[4] for c in cases)
    for outcome in ("error", "fail"):
        bad = [c for c in cases if c[1] == outcome]
        if bad:
            case = bad[0][0].split("::")[-1]
            return GraderResult(grader, outcome, f"{case}: {bad[0][2]}", bad[0][3], seconds)
    if all(c[1] == "skip" for c in cases):
        return GraderResult(grader, "skip", cases[0][2], seconds=seconds)
    return GraderResult(grader, "pass", "", seconds=seconds)


def grade(ex: er.Exercise, impl: str | None = None) -> tuple[bool, list[str]]:
    check_parses(ex)
    env = {IMPL_ENV: f"{ex.id}={impl}"} if impl else {}
    start_s = time.monotonic()
    results = run_graders(ex.graders, env)
    lines = [
        f"{r.outcome.upper():5} {r.grader}" + (f"\n      {r.message}" if r.message else "")
        for r in results
    ]
    ok = all(r.outcome == "pass" for r in results)
    lines.append(f"{ex.id}: {'passed' if ok else 'not yet'} ({time.monotonic() - start_s:.0f} s)")
    _record(ex, last_grade="pass" if ok else "fail")
    return ok, lines


def listing(exercises: dict[str, er.Exercise]) -> list[str]:
    progress, lines, day = _progress(), [], None
    for ex in sorted(exercises.values(), key=lambda e: (e.day, e.id)):
        if ex.day != day:
            day = ex.day
            lines.append(f"day {day}  ({ex.notes}, Exercises)")
        graded = progress.get(ex.id, {}).get("last_grade", "")
        status = state(ex).name + (f", last grade {graded}" if graded else "")
        lines.append(f"  {ex.id:32} {ex.title} (~{ex.lines} lines) [{status}]")
    return lines


def progress_lines(exercises: dict[str, er.Exercise]) -> list[str]:
    progress = _progress()
    passed = [i for i in exercises if progress.get(i, {}).get("last_grade") == "pass"]
    shown = [i for i in exercises if progress.get(i, {}).get("status") == "solution shown"]
    lines = [
        f"{len(passed)} of {len(exercises)} exercises passed their graders; "
        f"{len(shown)} with the solution shown"
    ]
    for eid, record in sorted(progress.items()):
        if eid in exercises:
            lines.append(f"  {eid:32} {record.get('last_grade', 'not graded'):10} {record['at']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "command", choices=["list", "start", "hint", "grade", "reset", "solution", "progress"]
    )
    parser.add_argument("id", nargs="?", help="the exercise, e.g. day19.column_row_forward")
    parser.add_argument("--impl", help="grade: take the marked functions from this module")
    args = parser.parse_args(argv)
    try:
        exercises = er.load()
        if args.command == "list":
            print("\n".join(listing(exercises)))
            return 0
        if args.command == "progress":
            print("\n".join(progress_lines(exercises)))
            return 0
        if not args.id:
            raise er.ExerciseError(f"`{args.command}` needs an exercise id (see `list`)")
        ex = er.find(exercises, args.id)
        if args.command == "grade":
            ok, lines = grade(ex, args.impl)
            print("\n".join(lines))
            return 0 if ok else 1
        action: Callable[[er.Exercise], str] = {
            "start": start,
            "reset": reset,
            "solution": solution,
            "hint": lambda e: f"{e.id}: {e.hint}",
        }[args.command]
        print(action(ex))
        return 0
    except er.ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
