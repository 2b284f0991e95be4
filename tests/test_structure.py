"""The course's shape, checked: no source file over MAX_LINES, and the import rules over the
import graph of every source file (lazy imports inside functions included): the kit never imports
a day, a day imports only *library* modules of other days (never their scripts: a module that
runs as `__main__`), and no import circle exists."""

import ast
import os

import pytest

from dtl.registry import REPO_ROOT

MAX_LINES = 450  # a file a reader holds in mind at once; past it, a file does more than one job


def _source_modules() -> dict[str, str]:
    """module name -> path, for dtl and every day folder."""
    out = {}
    for top in sorted(os.listdir(REPO_ROOT)):
        if top != "dtl" and not top.startswith("day"):
            continue
        folder = os.path.join(REPO_ROOT, top)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and name != "__init__.py":
                out[f"{top}.{name[:-3]}"] = os.path.join(folder, name)
    return out


MODULES = _source_modules()


def _imports(path: str) -> set[str]:
    """The project modules a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` names a module; `from pkg.mod import name` names pkg.mod
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        found |= {n for n in names if n in MODULES}
    return found


GRAPH = {mod: _imports(path) for mod, path in MODULES.items()}


def _day(mod: str) -> str:
    return mod.split(".")[0]


def _is_script(mod: str) -> bool:
    """What torchrun or python runs (it ends in `if __name__ == "__main__":`), whatever its
    name: other days may not import it."""
    with open(MODULES[mod]) as f:
        return '\nif __name__ == "__main__":' in f.read()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a self-import."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_project():
    assert len(MODULES) > 80 and "day22_megatron.stack" in GRAPH["day28_gpt125m.model_parallel"]


def test_the_kit_never_imports_a_day():
    bad = {m: sorted(i for i in GRAPH[m] if _day(i) != "dtl") for m in GRAPH if _day(m) == "dtl"}
    assert not {m: v for m, v in bad.items() if v}


def test_no_day_imports_another_days_script():
    bad = [
        f"{m} -> {i}"
        for m in sorted(GRAPH)
        for i in sorted(GRAPH[m])
        if _day(i) not in ("dtl", _day(m)) and _is_script(i)
    ]
    assert not bad, bad


def test_no_source_file_is_longer_than_max_lines():
    tools = os.path.join(REPO_ROOT, "tools")
    paths = [*MODULES.values(), *(os.path.join(tools, n) for n in os.listdir(tools))]
    lengths = {p: sum(1 for _ in open(p)) for p in paths if p.endswith(".py")}
    assert not {os.path.relpath(p, REPO_ROOT): n for p, n in lengths.items() if n > MAX_LINES}


def test_every_grid_parameter_is_typed_as_a_parallel_grid():
    untyped = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                for a in args.posonlyargs + args.args + args.kwonlyargs:
                    if a.arg == "grid" and ast.unparse(a.annotation or ast.Name("?")) != (
                        "ParallelGrid"
                    ):
                        untyped.append(f"{mod}.{node.name}")
    assert not untyped, untyped


def test_a_config_validate_sets_only_declared_fields():
    """validate() may fill derived fields, declared with field(init=False): never new ones."""
    undeclared = []
    for mod, path in MODULES.items():
        for cls in ast.walk(ast.parse(open(path).read(), path)):
            if not isinstance(cls, ast.ClassDef):
                continue
            declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "validate":
                    undeclared += [
                        f"{mod}.{cls.name}.{a.attr}"
                        for node in ast.walk(fn)
                        if isinstance(node, ast.Assign)
                        for t in node.targets
                        for a in ast.walk(t)
                        if isinstance(a, ast.Attribute)
                        and getattr(a.value, "id", None) == "self"
                        and a.attr not in declared
                    ]
    assert not undeclared, undeclared


def test_no_import_circle():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize(
    "graph, circles",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"a"}}, [["a"]]),
    ],
)
def test_the_circle_finder_finds_circles(graph, circles):
    assert _cycles(graph) == circles
