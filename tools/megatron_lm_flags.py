"""Megatron-LM's command-line flags, read off its source: the snapshots day 22's tests check.

    python tools/megatron_lm_flags.py REPO [--rev core_v0.16.1]            # counts, per parser
    python tools/megatron_lm_flags.py REPO --rev core_v0.16.1 --write      # the two snapshots

REPO is a Megatron-LM clone, a checkout or a bare mirror; the files are read at --rev with
`git show`, never imported (megatron/training needs Megatron-LM's training dependencies). Two
parsers, each written to day22_megatron/ as one flag per line, sorted, under a header naming the
commit and the function read:

    megatron_lm_flags.txt             pretrain_gpt.py: megatron/training/arguments.py parse_args
    megatron_lm_preprocess_flags.txt  tools/preprocess_data.py get_args

A parser's flags are what its function and every repository function it calls (resolved through
the file's imports) pass to `add_argument`, aliases included, the `--no-` twin of every
`BooleanOptionalAction` flag, and argparse's own `--help`. Most of pretrain_gpt.py's flags are
not written out: `ArgumentGroupFactory(SomeConfig, exclude=[...])` (megatron/training/
argument_utils.py) makes one per dataclass field, and this script applies its naming rule to the
class's source: `--field-name`; a bool field that does not
default to False is stored false and named `--no-field-name` and `--disable-field-name`; a
field's `metadata={"argparse_meta": {"arg_names": [...]}}` overrides the names; `init=False`
fields and the excluded names get none. Flags a function adds only when an optional package is
installed (kitchen's two) are listed too; the flags of `extra_args_provider` (pretrain_gpt.py's
modelopt ones, with nvidia-modelopt installed) are not.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTS = {  # file in day22_megatron/ -> (program, the file and function building its parser)
    "megatron_lm_flags.txt": ("pretrain_gpt.py", "megatron/training/arguments.py", "parse_args"),
    "megatron_lm_preprocess_flags.txt": (
        "tools/preprocess_data.py", "tools/preprocess_data.py", "get_args",
    ),
}  # fmt: skip
FACTORY = "ArgumentGroupFactory"
BOOL_TYPES = {"bool", "Optional[bool]", "typing.Optional[bool]", "bool | None", "None | bool"}

Reader = Callable[[str], "str | None"]  # a path in the repository -> its text, None if absent


def git_reader(repo: str, rev: str) -> Reader:
    def read(path: str) -> str | None:
        out = subprocess.run(
            ["git", "-C", repo, "show", f"{rev}:{path}"], capture_output=True, text=True
        )
        return out.stdout if out.returncode == 0 else None

    return read


class ParserReader:
    """Walks parser-building functions by AST: add_argument strings and factory-made flags."""

    def __init__(self, read: Reader):
        self.read = read
        self._trees: dict[str, ast.Module | None] = {}
        self._walked: set[tuple[str, str]] = set()

    def flags(self, path: str, function: str) -> set[str]:
        found = self._definition(path, function)
        if found is None or not isinstance(found[1], ast.FunctionDef):
            raise LookupError(f"no function {function} in {path}")
        return self._function_flags(*found)

    # --- the walk -------------------------------------------------------------------------------

    def _function_flags(self, path: str, fn: ast.FunctionDef) -> set[str]:
        if (path, fn.name) in self._walked:
            return set()
        self._walked.add((path, fn.name))
        flags: set[str] = set()
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            name = _callee_name(call)
            if name == "add_argument":
                flags |= _literal_flags(call, path)
            elif name == "ArgumentParser" and _keyword(call, "add_help", True) is not False:
                flags.add("--help")  # argparse's own
            elif name == FACTORY:
                flags |= self._factory_flags(path, fn, call)
            elif isinstance(call.func, ast.Name):  # a plain call: walk it if it is ours
                found = self._definition(path, call.func.id)
                if found and isinstance(found[1], ast.FunctionDef):
                    flags |= self._function_flags(*found)
        return flags

    def _factory_flags(self, path: str, fn: ast.FunctionDef, call: ast.Call) -> set[str]:
        """ArgumentGroupFactory(Config, exclude=[...]).build_group(...): a flag per field."""
        found = self._definition(path, call.args[0].id)
        if found is None or not isinstance(found[1], ast.ClassDef):
            raise LookupError(f"{path}:{call.lineno}: class {call.args[0].id} not found")
        exclude = _exclude_list(fn, call)
        flags = set()
        for name, (annotation, default, init, arg_names) in self._fields(*found).items():
            if not init or name in exclude:
                continue
            if arg_names is not None:  # the field's argparse_meta wins
                flags |= set(arg_names)
            elif annotation in BOOL_TYPES and default is not False:  # store_false
                flags |= {_flag("no_" + name), _flag("disable_" + name)}
            else:
                flags.add(_flag(name))
        return flags

    def _fields(self, path: str, cls: ast.ClassDef) -> dict[str, tuple]:
        """name -> (annotation, default, init, arg_names) of a dataclass, its bases' first."""
        fields: dict[str, tuple] = {}
        for base in cls.bases:
            found = self._definition(path, base.id) if isinstance(base, ast.Name) else None
            if found and isinstance(found[1], ast.ClassDef):
                fields.update(self._fields(*found))
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                annotation = ast.unparse(stmt.annotation)
                if not annotation.split("[")[0].endswith("ClassVar"):
                    fields[stmt.target.id] = (annotation, *_field_spec(stmt.value))
        return fields

    # --- names to definitions -------------------------------------------------------------------

    def _tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            text = self.read(path)
            self._trees[path] = None if text is None else ast.parse(text, path)
        return self._trees[path]

    def _definition(self, path: str, name: str) -> tuple[str, ast.AST] | None:
        """(file, node) of the function or class `name` means in `path`, through its imports
        (those inside functions included); None when it is not in the repository."""
        tree = self._tree(path)
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
                return path, node
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        module = self._module_path(path, node.module or "", node.level)
                        return self._definition(module, alias.name) if module else None
        return None

    def _module_path(self, path: str, module: str, level: int) -> str | None:
        parts = Path(path).parent.parts[: len(Path(path).parent.parts) - (level - 1)]
        base = "/".join([*parts, *module.split(".")] if level else module.split("."))
        base = base.strip("/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if self._tree(candidate) is not None:
                return candidate
        return None


# --- small AST readers --------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _callee_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _keyword(call: ast.Call, name: str, default):
    for kw in call.keywords:
        if kw.arg == name:
            return ast.literal_eval(kw.value)
    return default


def _literal_flags(call: ast.Call, path: str) -> set[str]:
    names = [a.value for a in call.args if isinstance(a, ast.Constant)]
    if len(names) != len(call.args) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}:{call.lineno}: a flag name that is not a string literal")
    flags = {n for n in names if n.startswith("--")}
    action = next((kw.value for kw in call.keywords if kw.arg == "action"), None)
    if action is not None and ast.unparse(action).endswith("BooleanOptionalAction"):
        flags |= {"--no-" + f[2:] for f in flags}  # argparse adds the negative form itself
    return flags


def _exclude_list(fn: ast.FunctionDef, call: ast.Call) -> set[str]:
    """The factory's exclude=: a list literal, or a name assigned one in the same function."""
    node = next((kw.value for kw in call.keywords if kw.arg == "exclude"), None)
    if isinstance(node, ast.Name):
        name = node.id
        assigned = [s for s in ast.walk(fn) if isinstance(s, ast.Assign)]
        node = [s.value for s in assigned if [getattr(t, "id", 0) for t in s.targets] == [name]][-1]
    return set(ast.literal_eval(node)) if node is not None else set()


def _field_spec(value: ast.expr | None) -> tuple:
    """(default, init, arg_names) of a field's right-hand side; default None when absent."""
    if not (isinstance(value, ast.Call) and _callee_name(value) == "field"):
        return _constant(value), True, None
    kwargs = {kw.arg: kw.value for kw in value.keywords}
    init = ast.literal_eval(kwargs["init"]) if "init" in kwargs else True
    return _constant(kwargs.get("default")), init, _arg_names(kwargs.get("metadata"))


def _constant(node: ast.expr | None):
    return node.value if isinstance(node, ast.Constant) else node


def _arg_names(metadata: ast.expr | None) -> list[str] | None:
    """metadata={"argparse_meta": {"arg_names": [...]}}: the names, else None."""
    for key in ("argparse_meta", "arg_names"):
        if not isinstance(metadata, ast.Dict):
            return None
        keys = [k.value if isinstance(k, ast.Constant) else None for k in metadata.keys]
        if key not in keys:
            return None
        metadata = metadata.values[keys.index(key)]
    return ast.literal_eval(metadata)


# --- the snapshots ------------------------------------------------------------------------------


def snapshot(read: Reader, label: str, program: str, path: str, function: str) -> str:
    flags = sorted(ParserReader(read).flags(path, function))
    header = (
        f"# Megatron-LM {label}: the {len(flags)} flags of {program}'s parser,\n"
        f"# read from {path} {function} by tools/megatron_lm_flags.py (AST, never run)\n"
    )
    return header + "".join(f"{f}\n" for f in flags)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo", help="a Megatron-LM clone (checkout or bare)")
    p.add_argument("--rev", default="HEAD", help="tag, branch or commit to read")
    p.add_argument("--write", action="store_true", help="write the snapshots in day22_megatron/")
    args = p.parse_args(argv)
    commit = subprocess.run(
        ["git", "-C", args.repo, "rev-parse", f"{args.rev}^{{commit}}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    label = f"{args.rev} ({commit})" if args.rev != commit else commit
    read = git_reader(args.repo, commit)
    for name, (program, path, function) in SNAPSHOTS.items():
        text = snapshot(read, label, program, path, function)
        out = REPO / "day22_megatron" / name
        if args.write:
            out.write_text(text)
        count = sum(line.startswith("--") for line in text.splitlines())
        print(f"{program}: {count} flags" + (f" -> {out}" if args.write else ""))


if __name__ == "__main__":
    main()
