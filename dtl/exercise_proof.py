"""The graders proven: each exercise's stub fails every one of its graders, and the solutions
pass them all. nbgrader's `validate --invert`, per exercise; CI's second step.

    python -m dtl.exercise_proof                 every exercise
    python -m dtl.exercise_proof --only day15.closed_forms day19.column_row_forward

For each exercise, with only that exercise stubbed:
- each of its graders must fail, by an assertion or by the stub's own error, never by a
  collection error or a timeout (a grader that fails for another reason proves nothing);
- the graders of every other exercise whose test files import the stubbed code must still pass,
  unless that exercise declares it `needs` this one: a stub that breaks another exercise's
  graders without saying so is a dependency nobody wrote down.
Then, with every solution in place, every grader passes. The last line is the mutation score
of the course's own tests: how many stubs every one of their graders caught.

It edits the course's files in place and puts them back (also on Ctrl-C); it refuses to start
while any exercise is started or holds a reader's changes.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import sys
import time

from dtl import exercise as ex_tool
from dtl import exercise_regions as er


def _module_of(path: str) -> str:
    return path[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")


@functools.cache
def _imports(path: str) -> frozenset[str]:
    """The course modules a file imports, anywhere in it (tests import inside functions)."""
    with open(os.path.join(er.ROOT, path)) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return frozenset(m for m in out if m.split(".")[0] == "dtl" or m.startswith("day"))


@functools.cache
def _reaches(path: str) -> frozenset[str]:
    """Every course module a file reaches through imports, itself excluded."""
    modules = {_module_of(p): p for p in er.code_files()}
    seen, todo = set(), list(_imports(path))
    while todo:
        m = todo.pop()
        if m in seen or m not in modules:
            continue
        seen.add(m)
        todo += _imports(modules[m])
    return frozenset(seen)


def _needs(exercises: dict[str, er.Exercise], eid: str) -> set[str]:
    out, todo = set(), list(exercises[eid].needs)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += exercises[n].needs
    return out


def affected(exercises: dict[str, er.Exercise], stubbed: er.Exercise) -> list[er.Exercise]:
    """The other exercises whose grader files reach the stubbed code and do not need it."""
    stubbed_modules = {_module_of(r.path) for r in er.regions_of(stubbed)}
    out = []
    for other in exercises.values():
        if other.id == stubbed.id or stubbed.id in _needs(exercises, other.id):
            continue
        files = {g.split("::")[0] for g in other.graders}
        if any(stubbed_modules & _reaches(f) for f in files):
            out.append(other)
    return out


def honest_failure(result: ex_tool.GraderResult, stubbed: er.Exercise) -> bool:
    """Failed by an assertion or by the stub's own error: not a collection error or timeout."""
    if result.outcome != "fail":
        return False
    text = result.text
    timed_out = "Timeout" in result.message or "timed out" in result.message.lower()
    return not timed_out and (f"exercise {stubbed.id}" in text or "AssertionError" in text)


def prove_one(exercises: dict[str, er.Exercise], ex: er.Exercise) -> tuple[bool, list[str]]:
    """Stub `ex`, run its graders and the affected ones, put the code back; the verdict."""
    state = ex_tool.state(ex)
    others = affected(exercises, ex)
    graders = list(dict.fromkeys(ex.graders + [g for o in others for g in o.graders]))
    start = time.monotonic()
    try:
        er.write_bodies(ex, state.stubs)
        results = {r.grader: r for r in ex_tool.run_graders(graders)}
    finally:
        er.write_bodies(ex, state.bodies)
    lines, ok = [], True
    for g in ex.graders:
        caught = honest_failure(results[g], ex)
        ok &= caught
        if not caught:
            lines.append(f"  stub NOT caught by {g}: {results[g].outcome} {results[g].message}")
    for other in others:
        for g in other.graders:
            if results[g].outcome not in ("pass", "skip"):
                ok = False
                lines.append(
                    f"  {g} ({other.id}) breaks without declaring needs {ex.id}: "
                    f"{results[g].message}"
                )
    took = time.monotonic() - start
    head = f"{'ok  ' if ok else 'FAIL'} {ex.id}: stub fails {len(ex.graders)} grader(s)"
    return ok, [f"{head}, {len(others)} other exercise(s) unaffected ({took:.0f} s)", *lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these exercises only")
    args = parser.parse_args(argv)
    exercises = er.load()
    chosen = [er.find(exercises, i) for i in args.only] if args.only else list(exercises.values())
    busy = [e.id for e in chosen if ex_tool.state(e).name in ("started", "yours")]
    if busy:
        print(f"error: exercises in progress: {', '.join(busy)} (`solution` them first)")
        return 2
    missing = sorted(set(er.all_regions()) ^ set(exercises))
    if missing:
        print(f"error: marked regions and exercises.toml disagree on: {', '.join(missing)}")
        return 2
    start, caught, failures = time.monotonic(), 0, 0
    for ex in chosen:
        ok, lines = prove_one(exercises, ex)
        caught += ok
        failures += not ok
        print("\n".join(lines), flush=True)
    graders = list(dict.fromkeys(g for e in chosen for g in e.graders))
    solved = ex_tool.run_graders(graders)
    bad = [r for r in solved if r.outcome != "pass"]
    for r in bad:
        print(f"FAIL with the solution in place: {r.grader}: {r.outcome} {r.message}")
    seconds = {r.grader: r.seconds for r in solved}
    print("the first (discriminating) grader of each, with the solution in place:")
    for ex in chosen:
        print(f"  {ex.id:32} {seconds[ex.graders[0]]:5.1f} s  {ex.graders[0].split('::')[1]}")
    print(
        f"summary: exercise proof: {caught}/{len(chosen)} stubs caught by every grader "
        f"(mutation score {caught / max(1, len(chosen)):.0%}); {len(graders) - len(bad)}/"
        f"{len(graders)} graders pass with the solutions; {time.monotonic() - start:.0f} s"
    )
    return 0 if not failures and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
