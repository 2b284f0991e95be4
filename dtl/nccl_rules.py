"""Two rules NCCL enforces and gloo does not, made checkable on a CPU.

1. Every tensor in a collective or a send/recv lives on the run's device. NCCL raises at once on a
   CPU tensor ("No backend type associated with device type cpu"); gloo takes it. On a CPU box
   the run's device *is* the CPU, so no run here can tell a tensor that names its device from one
   that forgot to. The check is therefore on the source: `factories_without_device()` lists every
   tensor factory in dtl/ and the day folders (torch.zeros, torch.tensor, ...) that names no
   device. Each must pass `device=`, be moved at once (`.to(device)`), or say on its line that it
   stays on the host on purpose, with a comment starting `# host` (a CPU random generator, data
   loaded before it moves, a byte count).

2. NCCL ignores point-to-point tags: sends and receives between two ranks of a group match in the
   order they are posted. Gloo matches them by tag, so a pipeline schedule that posts its sends in
   one order and its receives in another passes here and swaps activations on GPUs. With
   DTL_P2P_IGNORE_TAGS=1 (the test suite sets it) `ignore_p2p_tags()` sets every tag to 0, and
   gloo then matches in posting order, as NCCL does.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

IGNORE_TAGS_ENV = "DTL_P2P_IGNORE_TAGS"
REPO = Path(__file__).resolve().parent.parent

# --- 1. tensors on the run's device -----------------------------------------------------------

# torch functions that make a tensor from sizes or data: they default to the CPU
FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "logspace",
    "eye",
    "empty_strided",
    "from_numpy",
    "frombuffer",
    "scalar_tensor",
}
HOST_COMMENT = re.compile(r"#\s*host\b")


def course_sources(root: Path = REPO) -> list[Path]:
    """Every Python file of the kit and the days (tests are CPU-only and not checked)."""
    return sorted(root.glob("dtl/**/*.py")) + sorted(root.glob("day*/**/*.py"))


def _names_device(call: ast.Call, parent: ast.AST | None) -> bool:
    if any(k.arg == "device" or k.arg is None for k in call.keywords):  # device= or **kwargs
        return True
    # torch.tensor(...).to(device) / .cuda(): moved before anything can use it
    return isinstance(parent, ast.Attribute) and parent.attr in ("to", "cuda")


def factories_without_device(paths: list[Path] | None = None) -> list[str]:
    """'path:line: source' for each factory call that names no device and is not marked
    `# host`. Empty when the rule holds."""
    found = []
    for path in paths or course_sources():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in FACTORIES
            ):
                continue
            if _names_device(node, parents.get(node)):
                continue
            span = lines[node.lineno - 1 : node.end_lineno]
            if any(HOST_COMMENT.search(line) for line in span):
                continue
            found.append(
                (
                    str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
                    node.lineno,
                    lines[node.lineno - 1].strip(),
                )
            )
    return [f"{path}:{line}: {text}" for path, line, text in sorted(found)]


# --- 2. point-to-point matching in posting order -------------------------------------------------

_ORIGINALS: dict[str, Any] = {}


def _untagged(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # the same signature, for CommCounter, which binds the arguments
    def untagged(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 3:  # (tensor, peer, group, tag, ...) given by position
            args = (*args[:3], 0, *args[4:])
        if "tag" in kwargs:
            kwargs["tag"] = 0
        return fn(*args, **kwargs)

    untagged.dtl_untagged = fn  # type: ignore[attr-defined]  # a marker attribute on a function
    return untagged


def ignore_p2p_tags() -> None:
    """Every send/recv (plain, async or in a P2POp batch) with tag 0, as NCCL treats them.
    Idempotent; `restore_p2p_tags()` undoes it."""
    if _ORIGINALS:
        return
    for name in ("send", "recv", "isend", "irecv", "P2POp"):
        _ORIGINALS[name] = getattr(dist, name)
    for name in ("send", "recv", "isend", "irecv"):
        setattr(dist, name, _untagged(_ORIGINALS[name]))
    # P2POp checks that its op *is* torch's isend/irecv: hand it those, with tag 0
    real = {dist.isend: _ORIGINALS["isend"], dist.irecv: _ORIGINALS["irecv"]}
    base = _ORIGINALS["P2POp"]

    # mypy cannot check a base class held in a variable (the class in force at this call)
    class P2POp(base):  # type: ignore[misc,valid-type]
        def __new__(
            cls,
            op: Callable[..., Any],
            tensor: torch.Tensor,
            peer: int | None = None,
            group: dist.ProcessGroup | None = None,
            tag: int = 0,
            group_peer: int | None = None,
        ) -> Any:
            return base.__new__(cls, real.get(op, op), tensor, peer, group, 0, group_peer)

        def __init__(
            self,
            op: Callable[..., Any],
            tensor: torch.Tensor,
            peer: int | None = None,
            group: dist.ProcessGroup | None = None,
            tag: int = 0,
            group_peer: int | None = None,
        ) -> None:
            super().__init__(real.get(op, op), tensor, peer, group, 0, group_peer)

    dist.P2POp = P2POp  # type: ignore[misc]  # replaced until restore_p2p_tags()


def restore_p2p_tags() -> None:
    for name, fn in _ORIGINALS.items():
        setattr(dist, name, fn)
    _ORIGINALS.clear()


def tags_ignored() -> bool:
    return bool(_ORIGINALS)


if os.environ.get(IGNORE_TAGS_ENV) == "1":
    ignore_p2p_tags()
