"""The notes cite no file the repository lacks (no processes, no torch; well under 1 s).

Scanned: README.md, docs/*.md and every day*/README.md, and for bare upper-case doc names
(REFERENCES.md, READING.md, ...) every .py, .md and .toml file too. The rules:
- a relative markdown link resolves to a file or folder of the repository;
- a backticked name ending in .py, .md, .toml or .json (`name`, `path/name`, `name:function`):
  - a path whose first folder is one of the repository's (day*, dtl, tests, tools, ..) resolves,
    from the repository root or from the note's folder; any other path is an outside
    project's (`torch/...`, `megatron/core/...`: the notes name the project beside it);
  - a bare name is a file of the repository, or a file the code writes (its name is a string
    literal in the code: `summary.md`, `meta.json`), or an outside project's file that the
    same note spells with its folder somewhere, or whose paragraph shows that folder;
  - names with a placeholder (`dayNN`, `<run>`, `*`, `{0,1}`) and command-line flags are skipped;
- an upper-case doc name (`FOO.md`) outside backticks is a repository file or part of an
  outside path (`doc/PERFORMANCE.md`, nccl-tests');
- a backticked dotted name of the course's own code (`dtl.optim.warmup_cosine`,
  `day20_pp.train`) names a module of the repository and, where it goes on, a name that module
  defines or imports at its top level (read from its source, nothing imported).
"""

import ast
import functools
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".venv", "outputs", "__pycache__", ".pytest_cache", ".ruff_cache"}


def _repo_files() -> set[str]:
    out = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = os.path.relpath(folder, ROOT)
        out.update(os.path.normpath(os.path.join(rel, f)) for f in files)
    return out


FILES = _repo_files()
FOLDERS = {os.path.dirname(f) for f in FILES} | {
    os.path.join(*f.split(os.sep)[:i]) for f in FILES for i in range(1, f.count(os.sep) + 1)
}
TOPS = {f.split(os.sep)[0] for f in FILES}


def _ours(path: str) -> bool:
    """A path in this repository's folders; `docs/x.md` is ours, a deeper `docs/...` path is an
    outside project's documentation (DeepSpeed's `docs/_pages/...`)."""
    top = path.split("/")[0]
    return top in TOPS | {".", ".."} and not (top == "docs" and path.count("/") > 1)


BASENAMES = {os.path.basename(f) for f in FILES}
NOTES = ["README.md"] + sorted(
    f for f in FILES if re.fullmatch(r"day\d\d_\w+/README\.md|docs/\w+\.md", f)
)
CODE = "\n".join(open(os.path.join(ROOT, f)).read() for f in sorted(FILES) if f.endswith(".py"))

FILE_NAME = re.compile(r"`([^`\s]*?\.(?:py|md|toml|json))(?::[\w.]+)?`")
PLACEHOLDER = re.compile(r"NN|[*<{]")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOC_NAME = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")


def _exists(path: str, note_dir: str) -> bool:
    for base in ("", note_dir):
        p = os.path.normpath(os.path.join(base, path))
        if p in FILES or p in FOLDERS:
            return True
    return False


def _outside_paths(text: str) -> list[str]:
    names = re.findall(r"`([^`\s]+)`", text)
    return [n.split(":")[0] for n in names if "/" in n and not _ours(n)]


def _problems(note: str) -> list[str]:
    text = open(os.path.join(ROOT, note)).read()
    here = os.path.dirname(note)
    spelled_in_full = _outside_paths(text)
    bad = []
    for m in LINK.finditer(text):
        if not re.match(r"[a-z]+:", m.group(1)) and not _exists(m.group(1), here):
            bad.append(f"link {m.group(1)}")
    for paragraph in re.split(r"\n\s*\n", text):
        outside_here = _outside_paths(paragraph)
        for m in FILE_NAME.finditer(paragraph):
            name = m.group(1)
            if name.startswith("-") or PLACEHOLDER.search(name):
                continue
            if "/" in name:
                if _ours(name) and not _exists(name, here):
                    bad.append(name)
                continue
            if name in BASENAMES or f'"{name}"' in CODE or f"'{name}'" in CODE:
                continue
            if outside_here or any(p.endswith("/" + name) for p in spelled_in_full):
                continue
            bad.append(name)
    return bad


def test_every_file_the_notes_cite_is_in_the_repository():
    bad = {note: found for note in NOTES if (found := _problems(note))}
    assert not bad, f"cited but not in the repository: {bad}"


def test_no_file_names_a_doc_the_repository_lacks():
    bad = []
    for f in sorted(FILES):
        if f.endswith((".py", ".md", ".toml")) and f != os.path.join("tests", "test_notes.py"):
            for name in DOC_NAME.findall(open(os.path.join(ROOT, f)).read()):
                if name not in BASENAMES:
                    bad.append(f"{f}: {name}")
    assert not bad, bad


OUR_NAME = re.compile(r"`((?:dtl|day\d\d_[a-z0-9_]+)(?:\.\w+)+)(?:\(\))?`")


@functools.cache
def _top_level_names(module_file: str) -> set[str]:
    names = set()
    for node in ast.parse(open(os.path.join(ROOT, module_file)).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _missing_kit_name(dotted: str) -> str | None:
    """What of `dotted` (package.module[.name...]) the repository lacks, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        path = os.path.join(*parts[:i])
        for module_file in (path + ".py", os.path.join(path, "__init__.py")):
            if module_file in FILES:
                if i < len(parts) and parts[i] not in _top_level_names(module_file):
                    return f"{'.'.join(parts[:i])} has no {parts[i]}"
                return None
    return f"no module {dotted}"


def test_every_name_of_the_course_code_the_notes_give_exists():
    bad = [
        f"{note}: {problem}"
        for note in NOTES
        for name in OUR_NAME.findall(open(os.path.join(ROOT, note)).read())
        if (problem := _missing_kit_name(name))
    ]
    assert not bad, bad


def test_the_scan_catches_what_it_should():
    assert _exists("day19_tp/bench.py", "") and _exists("bench.py", "day19_tp")
    assert not _exists("../shared/design/REFERENCES.md", "day16_nccl")
    assert DOC_NAME.findall("(REFERENCES.md: p = 4)") == ["REFERENCES.md"]
    assert DOC_NAME.findall("nccl-tests doc/PERFORMANCE.md") == []
    assert FILE_NAME.findall("`stage_1_and_2.py:DeepSpeedZeroOptimizer.__init__`") == [
        "stage_1_and_2.py"
    ]
    assert _missing_kit_name("dtl.model.warmup_cosine") == "dtl.model has no warmup_cosine"
    assert _missing_kit_name("dtl.optim.warmup_cosine") is None
    assert _missing_kit_name("dtl.profile.StepTimes.remainder_ms") is None  # a class's member
    assert _missing_kit_name("day20_pp.nope") == "day20_pp has no nope"
    assert _missing_kit_name("day99_x.train") == "no module day99_x.train"
