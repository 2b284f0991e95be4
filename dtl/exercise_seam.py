"""The seam through which a reader's own module stands in for the course's code.

    @exercise("day19.column_row_forward")
    def forward(self, x): ...

Without DTL_EXERCISE_IMPL the decorator returns the function unchanged. `python -m dtl.exercise
grade ID --impl mypkg.mymodule` sets DTL_EXERCISE_IMPL=ID=mypkg.mymodule for the graders and
every process they start; each function marked with that ID then calls the reader's function
of the same name (a method as Class_method), looked up at the first call, so the reader's
module may import the course's. Standard library only.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

IMPL_ENV = "DTL_EXERCISE_IMPL"


def impl_module(exercise_id: str) -> str | None:
    """The reader's module standing in for `exercise_id`, from DTL_EXERCISE_IMPL
    ("ID=module[,ID=module...]"), or None."""
    for item in os.environ.get(IMPL_ENV, "").split(","):
        eid, _, module = item.partition("=")
        if eid.strip() == exercise_id and module.strip():
            return module.strip()
    return None


def reader_name(fn: Callable[..., Any]) -> str:
    """The name the reader's module gives `fn`: its qualified name, dots as underscores."""
    return fn.__qualname__.replace(".", "_")


def exercise(exercise_id: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    def mark(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        module = impl_module(exercise_id)
        if module is None:
            return fn

        @functools.wraps(fn)
        def reader_version(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            found = getattr(importlib.import_module(module), reader_name(fn), None)
            if found is None:
                raise AttributeError(
                    f"exercise {exercise_id}: {module} has no {reader_name(fn)} (--impl)"
                )
            result: _R = found(*args, **kwargs)
            return result

        return reader_version

    return mark
