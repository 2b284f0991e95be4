"""Every torch API the course names, and whether this torch has it: the floor kept honest.

    python tools/torch_api.py                 # the paths that do not resolve in this torch
    python tools/torch_api.py --write FILE    # every path, resolved here, into FILE

The course promises a floor torch (pyproject.toml). tests/torch_api_floor.txt is what this
script wrote under that floor (a venv with it: `pip install torch==<floor>`, the project, then
`python tools/torch_api.py --write tests/torch_api_floor.txt`). The suite checks that every path
the code names today is in that file, so a call that only a newer torch has fails the suite on
any torch, before a reader with the older one meets it.

A path is read off the source, not the running code: `dist.all_reduce` after `import
torch.distributed as dist` is torch.distributed.all_reduce; `from torch.distributed.fsdp import
fully_shard` is torch.distributed.fsdp.fully_shard. Only names written out are seen
(getattr(dist, name) is not): dtl/compat.py, which looks names up by string on purpose, is where
such lookups belong.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sources(root: Path = REPO) -> list[Path]:
    return sorted(root.glob("dtl/**/*.py")) + sorted(root.glob("day*/**/*.py"))


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch path it stands for, from every import in the file."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _chain(node: ast.Attribute) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def used_paths(paths: list[Path] | None = None) -> dict[str, str]:
    """torch path -> the first 'file:line' that names it."""
    found: dict[str, str] = {}
    for path in paths or sources():
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for target in aliases.values():
            found.setdefault(target, f"{rel}:import")
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            # the whole chain only (a.b.c, not a.b inside it); reads, not the names we assign
            if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
                continue
            if not isinstance(node.ctx, ast.Load):
                continue
            chain = _chain(node)
            if chain and chain[0] in aliases:
                found.setdefault(".".join([aliases[chain[0]], *chain[1:]]), f"{rel}:{node.lineno}")
    return dict(sorted(found.items()))


def resolves(path: str) -> bool:
    """Does this torch have `path`: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="write every resolved path here")
    args = parser.parse_args(argv)
    import torch

    used = used_paths()
    missing = {p: where for p, where in used.items() if not resolves(p)}
    for p, where in missing.items():
        print(f"not in torch {torch.__version__}: {p}  ({where})")
    if args.write:
        have = [p for p in used if p not in missing]
        header = f"# torch API paths the course names that torch {torch.__version__} has\n"
        Path(args.write).write_text(header + "\n".join(have) + "\n")
        print(f"torch_api: {len(have)} paths written to {args.write}")
    print(
        f"torch_api: {len(used)} paths named, {len(missing)} missing in torch {torch.__version__}"
    )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
